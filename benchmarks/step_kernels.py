"""Where a decode step's time goes: the kernels of one step, grouped by name, as one JSON object.

model   A geometry of benchmarks/decode.py (random weights; ``--shape 1B``, ``8B``, ``tiny``...)
        prefilled with ``--prompt`` random tokens at ``--batch`` rows, then ``--steps`` decode
        steps profiled for each cache of ``--caches`` (a name of ``kvcache.make_cache``; an
        evicting policy is kept at ``--cache-length`` slots, dense holds the prompt and the
        steps), eager and, with ``--compiled``, the captured step (a CUDA graph on CUDA).
layer   One attention layer's decode step at benchmarks/quantized.py's geometry (32 query heads,
        8 K/V heads, head_dim 128) holding ``--layer-tokens`` tokens a row, over each storage
        of ``--storages``, beside SDPA over contiguous keys and values of the same shape, and
        SDPA over the very slot views the ``full`` storage attends (a strided slice of its
        buffers): what the cache adds to an attention call, apart from what the call costs.
        ``--kernel-configs`` profiles each packed storage once per configuration of the Triton
        decode kernel (slots a block, slots a program, warps, pipeline stages; CUDA only).

For each case: the wall time of a step (median of the profiled steps, the device synchronised
around each), the kernels a step launches, their device time per step, and the
``--top`` kernels by device time (calls and microseconds per step, share). On CUDA the times
are the kernels' own (CUPTI, CUDA-graph replays included), and ``host_top`` lists the host's
operators by their own CPU time; on the CPU, each operator's own CPU time, so a CPU run checks
the script rather than says where a GPU's time goes.

    python benchmarks/step_kernels.py --device cuda --shape 1B --caches dense,tova --compiled
    python benchmarks/step_kernels.py --device cuda --parts layer --storages full,int8,int4
    python benchmarks/step_kernels.py --device cuda --parts layer --storages int8,int4 \
        --kernel-configs 64/512/4/3,32/512/4/2,64/1024/8/3,128/2048/8/2
    python benchmarks/step_kernels.py --shape tiny --prompt 64 --steps 3 --layer-tokens 512   # CPU
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import quantized  # benchmarks/quantized.py: the layer geometry and its caches
import torch
import torch.nn.functional as F
from decode import DTYPES, allow_recompiles, build_models, free_memory, parse_device, sync
from emit import emit
from torch.profiler import ProfilerActivity

import kvcache
from kvcache.cache.registry import check_names, policy_class
from kvcache.generation.compiled import captured_decode
from kvcache.runtime.threads import set_threads

PARTS = ["model", "layer"]


def log(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


def profile(fn, steps: int, device: torch.device, top: int) -> dict:
    """Run ``fn`` once unprofiled (first-call effects), then ``steps`` times under the profiler.

    Returns the step's median wall milliseconds, the kernels (CUDA) or operators (CPU) a step
    runs and their time per step, and the ``top`` of them by time."""
    fn()
    sync(device)
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    walls = []
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            sync(device)
            start = time.perf_counter()
            fn()
            sync(device)
            walls.append(time.perf_counter() - start)
    rows, host = [], []
    for event in prof.key_averages():
        if cuda and event.self_cpu_time_total > 0:
            host.append((event.key, event.count, event.self_cpu_time_total))
        # On CUDA a kernel carries device time of its own and the operators that launched it
        # none; on the CPU every operator's own time, the profiler's wrappers left out.
        us = event.self_device_time_total if cuda else event.self_cpu_time_total
        if us > 0 and not event.key.startswith(("ProfilerStep", "cudaDeviceSynchronize")):
            rows.append((event.key, event.count, us))
    total = sum(us for _, _, us in rows)
    rows.sort(key=lambda r: -r[2])
    report = {
        "step_ms": round(1e3 * statistics.median(walls), 4),
        "timed": "kernels on the device" if cuda else "operators on the CPU",
        "per_step": {"calls": round(sum(c for _, c, _ in rows) / steps, 1), "us": round(total / steps, 1)},
        "top": [{"name": name[:160], "calls": round(count / steps, 2), "us": round(us / steps, 2),
                 "share": round(us / total, 4) if total else 0.0} for name, count, us in rows[:top]],
    }
    if cuda:
        # What the host spent per step, by operator: launches, and any planning a backend does
        # for a shape it has not seen (a step whose wall time far exceeds its kernels' shows it).
        host.sort(key=lambda r: -r[2])
        report["host_top"] = [{"name": name[:160], "calls": round(count / steps, 2), "us": round(us / steps, 2)}
                              for name, count, us in host[:top]]
    return report


def model_cases(args, device: torch.device, dtype: torch.dtype) -> dict:
    """Each cache's decode step, eager and (``--compiled``) captured, over one model."""
    out: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        hf, model = build_models(args.shape, Path(tmp), device, dtype)
        del hf  # kvcache's model shares its tensors or loaded them: the transformers wrapper is not timed
        g = torch.Generator().manual_seed(0)
        vocab = model.config.vocab_size
        prompt = torch.randint(3, vocab, (args.batch, args.prompt), generator=g).to(device)
        token = torch.randint(3, vocab, (args.batch, 1), generator=g).to(device)
        for name in args.caches.split(","):
            modes = ["eager", "compiled"] if args.compiled else ["eager"]
            for mode in modes:
                # Room for the warm-up and profiled steps, and the capture's own first step.
                need = args.prompt + args.steps + 4
                evicts = policy_class(name).evicts
                length = (args.cache_length or args.prompt // 2) if evicts else need
                cache = kvcache.make_cache(model, name, cache_length=length, batch_size=args.batch)
                with torch.inference_mode():
                    model(prompt, cache)
                    if mode == "compiled":
                        step = captured_decode(model, cache).step
                        step(token)  # the capture
                    else:
                        def step(tokens, cache=cache):
                            return model.decode(tokens, cache)
                    log(f"model: {name} {mode}")
                    timed = profile(lambda: step(token), args.steps, device, args.top)  # noqa: F821 (both branches define it)
                    out[f"{name} {mode}"] = {"cache_length": length, **timed}
                del cache, step
                free_memory(device)
    return {"shape": args.shape, "batch": args.batch, "prompt_tokens": args.prompt, "dtype": str(dtype).removeprefix("torch."),
            "cases": out}


def kernel_configs(value: str | None, error) -> list[tuple[int, int, int, int, str | None]]:
    """``--kernel-configs``: BLOCK/SPLIT/WARPS/STAGES[/PRECISION], comma-separated; PRECISION is
    the dots' input precision (ieee or tf32; default: the kernel's choice for the query's dtype)."""
    if not value:
        return []
    configs = []
    for item in value.split(","):
        parts = item.split("/")
        numbers, precision = parts[:4], (parts[4] if len(parts) == 5 else None)
        if len(parts) not in (4, 5) or not all(p.isdigit() and int(p) > 0 for p in numbers):
            error(f"--kernel-configs: {item!r} is not BLOCK/SPLIT/WARPS/STAGES[/PRECISION] (four positive integers)")
        if precision not in (None, "ieee", "tf32"):
            error(f"--kernel-configs: {item!r}: PRECISION is ieee or tf32")
        block, split, warps, stages = map(int, numbers)
        if block < 16 or block & (block - 1) or split % block or warps & (warps - 1):
            error(f"--kernel-configs: {item!r}: BLOCK a power of two >= 16, SPLIT a multiple of it, WARPS a power of two")
        configs.append((block, split, warps, stages, precision))
    return configs


def configured(configs: list, device: torch.device):
    """(label, apply) for each Triton kernel configuration; one unlabelled entry without any."""
    if not configs or device.type != "cuda":
        return [("", lambda: None)]
    from kvcache.kernels import triton_decode

    def setter(block, split, warps, stages, precision):
        def apply():
            triton_decode.BLOCK_S, triton_decode.SLOTS_PER_SPLIT = block, split
            triton_decode.NUM_WARPS, triton_decode.NUM_STAGES = warps, stages
            triton_decode.DOT_PRECISION = precision
        return apply

    return [(" kernel " + "/".join(str(x) for x in config if x is not None), setter(*config)) for config in configs]


def layer_cases(args, device: torch.device, dtype: torch.dtype) -> dict:
    """One layer's decode step over each storage, SDPA over the full storage's slot views, and
    SDPA over contiguous tensors of the same shape."""
    B, n, HQ, HKV, D = args.batch, args.layer_tokens, quantized.HQ, quantized.HKV, quantized.D
    out: dict = {}
    variants = configured(args.configs, device)
    g = torch.Generator(device).manual_seed(1)
    q = torch.randn(B, HQ, 1, D, generator=g, device=device, dtype=dtype)
    k1 = torch.randn(B, HKV, 1, D, generator=g, device=device, dtype=dtype)
    v1 = torch.randn_like(k1)
    with torch.inference_mode():
        for storage in args.storages.split(","):
            cache, layer = quantized.layer(storage, n, dtype, device, B)

            def step(cache=cache, layer=layer):
                s = cache.begin(torch.zeros(B, 1, dtype=torch.long, device=device), None)
                layer.attend(q, k1, v1, s)
                cache.commit(s)

            for label, apply in variants if layer.storage.packed else [("", lambda: None)]:
                apply()
                log(f"layer: {storage}{label}")
                out[storage + label] = profile(step, args.steps, device, args.top)
            if storage == "full":
                # The slots a decode step attends after the profiled ones: a strided slice of the
                # buffers, of one span, and of a span one slot longer at each call, as in decode
                # steps (an attention backend that plans per shape plans at every step then).
                span = int(cache.lengths.max())
                ks, vs, _ = layer.storage.view(span)
                qh = q.reshape(B, HKV, HQ // HKV, D)
                out["sdpa over the full storage's slots"] = profile(lambda: F.scaled_dot_product_attention(qh, ks, vs),
                                                                    args.steps, device, args.top)
                spans = iter(range(span - args.steps - 1, span + 1))

                def growing():
                    kg, vg, _ = layer.storage.view(next(spans))  # noqa: F821 (the loop's layer)
                    return F.scaled_dot_product_attention(qh, kg, vg)

                out["sdpa over the full storage's slots, one more each call"] = profile(growing, args.steps, device, args.top)
                kc, vc = ks.contiguous(), vs.contiguous()
                out["sdpa over contiguous keys and values"] = profile(lambda: F.scaled_dot_product_attention(qh, kc, vc),
                                                                      args.steps, device, args.top)
                del ks, vs, kc, vc
            del cache, layer, step
            free_memory(device)
    return {"tokens": n, "batch": B, "geometry": {"q_heads": HQ, "kv_heads": HKV, "head_dim": D},
            "dtype": str(dtype).removeprefix("torch."), "cases": out}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    p.add_argument("--dtype", choices=list(DTYPES), default=None, help="default: bfloat16 on CUDA, float32 on the CPU")
    p.add_argument("--shape", default="1B", help="a model of benchmarks/decode.py (default 1B)")
    p.add_argument("--batch", type=int, default=1, help="rows (default 1)")
    p.add_argument("--prompt", type=int, default=1024, help="prompt tokens before the profiled steps (default 1024)")
    p.add_argument("--caches", default="dense", help="comma-separated cache names (default dense)")
    p.add_argument("--cache-length", type=int, default=None,
                   help="slots of an evicting cache (default: half the prompt); dense holds every token")
    p.add_argument("--compiled", action="store_true", help="also the captured decode step of each cache")
    p.add_argument("--layer-tokens", type=int, default=32768, help="tokens a row in the layer part (default 32768)")
    p.add_argument("--storages", default="full,int8,int4", help="storages of the layer part (default full,int8,int4)")
    p.add_argument("--kernel-configs", default=None, metavar="B/S/W/ST[/P],...",
                   help="Triton decode kernel configurations to profile each packed storage with (CUDA): "
                        "slots a block/slots a program/warps/stages[/dot precision, ieee or tf32], "
                        "e.g. 64/512/4/3,32/512/4/2/ieee")
    p.add_argument("--steps", type=int, default=5, help="profiled steps per case (default 5)")
    p.add_argument("--top", type=int, default=15, help="kernels listed per case (default 15)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--out", default=None, help="also write the JSON here")
    return p


def run(args, error) -> dict:
    parts = args.parts.split(",")
    if unknown := sorted(set(parts) - set(PARTS)):
        error(f"--parts: unknown {unknown}; choose from {PARTS}")
    if args.steps < 1 or args.batch < 1 or args.prompt < 2 or args.layer_tokens < 1:
        error("--steps and --batch must be >= 1, --prompt >= 2 and --layer-tokens >= 1")
    args.configs = kernel_configs(args.kernel_configs, error)
    # The layer part's cache has 64 slots beyond its tokens, and each packed storage runs steps + 1
    # steps under every kernel configuration, all on the same cache.
    if (args.steps + 1) * max(1, len(args.configs)) > 64:
        error(f"--steps {args.steps} with {len(args.configs)} --kernel-configs: (steps + 1) x configurations "
              "must be at most 64 (the layer's spare slots)")
    try:
        check_names(args.caches.split(","), "--caches")
    except ValueError as e:
        error(str(e))
    device = parse_device(args.device, error)
    dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    if args.threads:
        set_threads(args.threads)
    allow_recompiles()
    report: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                    "torch": torch.__version__, "steps": args.steps}
    if "model" in parts:
        report["model"] = model_cases(args, device, dtype)
    if "layer" in parts:
        report["layer"] = layer_cases(args, device, dtype)
    return report


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    emit(run(args, p.error), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
