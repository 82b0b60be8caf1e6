"""Prefill with a quantized storage against the full-precision dense cache, in one run: peak
memory above the model and time, per storage, prompt length and chunking.

Each case runs in a fresh process: load the model (``--dtype``, float32 by default), note the
resident set, reset its high-water mark (``/proc/self/clear_refs``), prefill ``--tokens`` random
token ids through a ``dense:<storage>`` cache sized to the prompt, one chunk or ``--chunk``-token
chunks, and report the high-water mark above what the process held before the cache was made
(the cache, the activations and the attention temporaries), the prefill's wall time and the
process's CPU time over it. Storages take turns case by case, so a slow moment of a shared
machine lands on all of them alike; the best of ``--repeats`` times is reported, with the ratio
to dense in the same run.

Models: ``bundled`` (the reference model: 4 layers, head_dim 32, 2 K/V heads, 4096 positions),
``llama128`` (a random Llama with one layer of 8 query heads, 2 K/V heads and head_dim 128,
32768 positions), so that head_dim 128 and 32k-token prompts are covered, and ``llama64`` and
``llama256`` (the same with head_dim 64 and 16 query heads, 256 and 4).

    python benchmarks/prefill.py [--tokens 4096 32768] [--models bundled llama128] [--dtype float16]
                                 [--no-chunked] [--out FILE]

Prints one JSON object; progress on stderr. CPU figures (one thread by default).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path

import rss  # benchmarks/rss.py: the script's own folder is on the path
import torch
from emit import emit
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import kvcache
from kvcache.runtime.threads import set_threads

STORAGES = ["full", "int8", "int4", "int2", "token4"]
MODELS = {"bundled": 4096, "llama64": 32768, "llama128": 32768, "llama256": 32768}  # the longest prompt each takes
DEFAULT_MODELS = ["bundled", "llama128"]


def log(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


def build_llama(path: Path, head_dim: int = 128) -> None:
    """A random one-layer Llama with ``head_dim`` (1024 channels of queries, 2 K/V heads), saved
    for kvcache.load."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=4096, hidden_size=1024, intermediate_size=2048, num_hidden_layers=1,
                      num_attention_heads=1024 // head_dim, num_key_value_heads=2, head_dim=head_dim,
                      max_position_embeddings=32768)
    LlamaForCausalLM(cfg).save_pretrained(path)


class LiveBytes(TorchDispatchMode):
    """The bytes of tensor storages made under it and still alive, and their peak: what a
    computation holds, whatever the allocator keeps of what it freed."""

    def __init__(self) -> None:
        super().__init__()
        self.live, self.peak, self.sizes = 0, 0, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key in self.sizes or storage.nbytes() == 0:
                    continue
                self.sizes[key] = storage.nbytes()
                self.live += storage.nbytes()
                self.peak = max(self.peak, self.live)
                weakref.finalize(storage, self._free, key)
        return out

    def _free(self, key: int) -> None:
        self.live -= self.sizes.pop(key, 0)


def prefill(model, ids: torch.Tensor, storage: str, chunk: int | None):
    tokens = ids.shape[1]
    with torch.inference_mode():
        cache = kvcache.make_cache(model, f"dense:{storage}", cache_length=tokens)
        cache.allocate()  # every slot up front, as KIVI's: no storage's peak holds a growth's copy
        step = tokens if chunk is None else chunk
        for s in range(0, tokens, step):
            logits = model(ids[:, s : s + step], cache=cache, last_only=True)
    return cache, logits


def run_case(model_dir: str | None, storage: str, tokens: int, chunk: int | None, threads: int,
             dtype: str = "float32", live: bool = False) -> dict:
    """One prefill in this process: peak memory above the model, seconds and CPU seconds; with
    ``live``, then the peak of live tensor bytes of a second prefill (the cache included)."""
    set_threads(threads)
    model = kvcache.load(model_dir, dtype=getattr(torch, dtype))
    ids = torch.randint(3, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(1))
    rss.trim()
    before = rss.status("VmRSS")
    rss.reset_peak()
    start, cpu = time.perf_counter(), time.process_time()
    cache, logits = prefill(model, ids, storage, chunk)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    peak = rss.status("VmHWM") - before
    result = {"seconds": elapsed, "cpu_seconds": cpu, "peak_mib": peak / 2**20, "cache_mib": cache.nbytes() / 2**20,
              "finite": bool(torch.isfinite(logits).all())}
    if live:
        del cache, logits
        tracker = LiveBytes()
        with tracker:
            prefill(model, ids, storage, chunk)
        result["live_peak_mib"] = tracker.peak / 2**20
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 32768])
    parser.add_argument("--models", nargs="+", default=DEFAULT_MODELS, choices=list(MODELS))
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--no-chunked", action="store_true", help="one chunk only")
    parser.add_argument("--live", action="store_true",
                        help="also the peak of live tensor bytes (a second, untimed prefill per case) and the "
                             "resident peak with glibc's mmap threshold fixed (MALLOC_MMAP_THRESHOLD_=131072: freed "
                             "temporaries go back to the system rather than staying in the heap)")
    parser.add_argument("--storages", nargs="+", default=STORAGES)
    parser.add_argument("--chunk", type=int, default=512, help="the chunked prefill's chunk (besides one chunk)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", help="also write the JSON here")
    parser.add_argument("--case", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        model_dir, storage, tokens, chunk = json.loads(args.case)
        print(json.dumps(run_case(model_dir, storage, tokens, chunk, args.threads, args.dtype, args.live)))
        return
    report = {"torch": torch.__version__, "threads": args.threads, "device": "cpu", "dtype": args.dtype,
              "results": []}
    with tempfile.TemporaryDirectory() as tmp:
        dirs = {"bundled": None}
        for model in args.models:
            if model != "bundled":
                dirs[model] = str(Path(tmp) / model)
                build_llama(Path(dirs[model]), int(model.removeprefix("llama")))
        for model in args.models:
            for tokens in args.tokens:
                if tokens > MODELS[model]:
                    continue
                for chunk in (None,) if args.no_chunked else (None, args.chunk):
                    best: dict[str, dict] = {}
                    for _ in range(args.repeats):
                        for storage in args.storages:
                            case = json.dumps([dirs[model], storage, tokens, chunk])
                            command = [sys.executable, __file__, "--case", case, "--threads", str(args.threads),
                                       "--dtype", args.dtype] + (["--live"] if args.live else [])
                            out = subprocess.run(command, capture_output=True, text=True, check=True)
                            r = json.loads(out.stdout.strip().splitlines()[-1])
                            if args.live:
                                fixed = subprocess.run(command[:-1], capture_output=True, text=True, check=True,
                                                       env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"})
                                r["fixed_threshold_peak_mib"] = json.loads(fixed.stdout.strip().splitlines()[-1])["peak_mib"]
                            old = best.get(storage)
                            best[storage] = r if old is None else {
                                **r, **{k: min(r[k], old[k]) for k in ("seconds", "cpu_seconds", "peak_mib",
                                                                        "fixed_threshold_peak_mib") if k in r}}
                    dense = best["full"]
                    for storage, r in best.items():
                        row = {"model": model, "tokens": tokens, "chunk": chunk, "storage": storage,
                               "seconds": round(r["seconds"], 3), "cpu_seconds": round(r["cpu_seconds"], 3),
                               "peak_mib": round(r["peak_mib"], 1),
                               "cache_mib": round(r["cache_mib"], 2), "finite": r["finite"],
                               "time_vs_dense": round(r["seconds"] / dense["seconds"], 3),
                               "cpu_vs_dense": round(r["cpu_seconds"] / dense["cpu_seconds"], 3),
                               "peak_vs_dense": round(r["peak_mib"] / dense["peak_mib"], 3),
                               "peak_above_dense_mib": round(r["peak_mib"] - dense["peak_mib"], 1)}
                        for k in ("live_peak_mib", "fixed_threshold_peak_mib"):
                            if k in r:
                                row[k] = round(r[k], 1)
                                row[k.replace("_mib", "_above_dense_mib")] = round(r[k] - dense[k], 1)
                        report["results"].append(row)
                        log(json.dumps(row))
    emit(report, args.out, indent=2)


if __name__ == "__main__":
    main()
