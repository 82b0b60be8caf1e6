"""Prefill with a quantized storage against the full-precision dense cache, in one run: peak
memory above the model and time, per storage, prompt length and chunking.

Each case runs in a fresh process: load the model (float32), note the resident set, reset its
high-water mark (``/proc/self/clear_refs``), prefill ``--tokens`` random token ids through a
``dense:<storage>`` cache sized to the prompt, one chunk or ``--chunk``-token chunks, and report
the high-water mark above what the process held before the cache was made (the cache, the
activations and the attention temporaries) and the prefill's wall time. Storages take turns
case by case, so a slow moment of a shared machine lands on all of them alike; the best of
``--repeats`` times is reported, with the ratio to dense in the same run.

Models: ``bundled`` (the reference model: 4 layers, head_dim 32, 2 K/V heads, 4096 positions)
and ``llama128`` (a random Llama with one layer of 8 query heads, 2 K/V heads and head_dim 128,
32768 positions), so that head_dim 128 and 32k-token prompts are covered.

    python benchmarks/prefill.py [--tokens 4096 32768] [--models bundled llama128] [--out FILE]

Prints one JSON object; progress on stderr. CPU figures (one thread by default).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import kvcache
import rss  # benchmarks/rss.py: the script's own folder is on the path

STORAGES = ["full", "int8", "int4", "int2", "token4"]
MODELS = {"bundled": 4096, "llama128": 32768}  # the longest prompt each takes


def log(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


def build_llama128(path: Path) -> None:
    """A random one-layer Llama with head_dim 128, saved for kvcache.load."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=4096, hidden_size=1024, intermediate_size=2048, num_hidden_layers=1,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=128, max_position_embeddings=32768)
    LlamaForCausalLM(cfg).save_pretrained(path)


def run_case(model_dir: str | None, storage: str, tokens: int, chunk: int | None, threads: int) -> dict:
    """One prefill in this process: peak memory above the model and seconds."""
    torch.set_num_threads(threads)
    model = kvcache.load(model_dir, dtype=torch.float32)
    ids = torch.randint(3, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(1))
    rss.trim()
    before = rss.status("VmRSS")
    rss.reset_peak()
    start = time.perf_counter()
    with torch.inference_mode():
        cache = kvcache.make_cache(model, f"dense:{storage}", cache_length=tokens)
        step = tokens if chunk is None else chunk
        for s in range(0, tokens, step):
            logits = model(ids[:, s : s + step], cache=cache, last_only=True)
    elapsed = time.perf_counter() - start
    peak = rss.status("VmHWM") - before
    return {"seconds": elapsed, "peak_mib": peak / 2**20, "cache_mib": cache.nbytes() / 2**20,
            "finite": bool(torch.isfinite(logits).all())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 32768])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--storages", nargs="+", default=STORAGES)
    parser.add_argument("--chunk", type=int, default=512, help="the chunked prefill's chunk (besides one chunk)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", help="also write the JSON here")
    parser.add_argument("--case", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        model_dir, storage, tokens, chunk = json.loads(args.case)
        print(json.dumps(run_case(model_dir, storage, tokens, chunk, args.threads)))
        return
    report = {"torch": torch.__version__, "threads": args.threads, "device": "cpu", "results": []}
    with tempfile.TemporaryDirectory() as tmp:
        dirs = {"bundled": None}
        if "llama128" in args.models:
            dirs["llama128"] = str(Path(tmp) / "llama128")
            build_llama128(Path(dirs["llama128"]))
        for model in args.models:
            for tokens in args.tokens:
                if tokens > MODELS[model]:
                    continue
                for chunk in (None, args.chunk):
                    best: dict[str, dict] = {}
                    for _ in range(args.repeats):
                        for storage in args.storages:
                            case = json.dumps([dirs[model], storage, tokens, chunk])
                            out = subprocess.run([sys.executable, __file__, "--case", case, "--threads",
                                                  str(args.threads)], capture_output=True, text=True, check=True)
                            r = json.loads(out.stdout.strip().splitlines()[-1])
                            old = best.get(storage)
                            best[storage] = r if old is None else {
                                **r, "seconds": min(r["seconds"], old["seconds"]),
                                "peak_mib": min(r["peak_mib"], old["peak_mib"])}
                    dense = best["full"]
                    for storage, r in best.items():
                        row = {"model": model, "tokens": tokens, "chunk": chunk, "storage": storage,
                               "seconds": round(r["seconds"], 3), "peak_mib": round(r["peak_mib"], 1),
                               "cache_mib": round(r["cache_mib"], 2), "finite": r["finite"],
                               "time_vs_dense": round(r["seconds"] / dense["seconds"], 3),
                               "peak_vs_dense": round(r["peak_mib"] / dense["peak_mib"], 3)}
                        report["results"].append(row)
                        log(json.dumps(row))
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
