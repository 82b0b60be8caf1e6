"""Decode benchmark: kvcache vs transformers ``generate`` on identical random Llama weights, with a roofline.

For each shape a random ``LlamaForCausalLM`` is built from a ``LlamaConfig`` (fixed seed), saved with
``save_pretrained`` to a temporary directory and loaded back with ``kvcache.load``, so both engines run
the very same fp32 weights. Both generate greedily, batch 1, with EOS disabled, so each produces
exactly ``--new-tokens`` tokens; the greedy tokens are compared and reported.

How time is measured (the same way for both engines):
    * t0 is taken just before the ``generate`` call; every new token is timestamped as the engine hands
      it to the host (kvcache: the ``on_token`` callback; transformers: a ``streamer`` whose ``put`` is
      called once with the prompt, then once per new token).
    * prefill = first token stamp - t0 (time to first token: prompt forward + first greedy pick,
      including each engine's per-call setup); prefill tok/s = prompt tokens / prefill.
    * decode = last token stamp - first token stamp, covering N - 1 one-token forward steps;
      decode tok/s = (N - 1) / decode.
    * each engine is warmed up once per shape (a short prompt, a few tokens), then timed ``--repeats``
      times, the engines taking turns; the best prefill and the best decode are reported, every run is
      listed under ``runs``. The 1-minute load average before and after each shape is recorded: on a
      2-core machine another busy process stalls torch's 2-thread parallel regions badly.

Roofline (same process, same run): read bandwidth is the best of several ``x.sum()`` over a ~1 GiB fp32
tensor. A decoded token must read every weight once (all matrices, norms, lm_head; one embedding row)
plus the K and V of every cached token in every layer (at the mean context length of the decode), so
roofline tok/s = bandwidth / (weight bytes + KV bytes per token). Two practical ceilings are measured
with plain torch ops on the model's own weights: ``linear`` (one ``F.linear`` matvec per weight matrix
per token, nothing else) and ``linear+sdpa`` (that plus one SDPA per layer over a K/V of the mean
context length, grouped heads folded into the query axis).

Usage:
    python benchmarks/decode.py [--shapes 5M@512,5M@16k,200M@512] [--new-tokens 64] [--out FILE]

Prints one JSON object on stdout; progress goes to stderr. CPU timings are noisy on a shared machine:
compare runs, not single numbers. On a small, oversubscribed machine every torch OpenMP parallel
region (SDPA in particular) can stall for a scheduler time slice; ``--threads 1`` (or
``OMP_WAIT_POLICY=PASSIVE``) gives steadier numbers there, at the cost of parallel speed-up.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import kvcache

# name -> (model key, prompt tokens)
SHAPES: dict[str, tuple[str, int]] = {
    "5M@512": ("5M", 512),
    "5M@16k": ("5M", 16384),
    "200M@512": ("200M", 512),
}

MODELS: dict[str, dict] = {
    "5M": dict(
        hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=4096,
    ),
    "200M": dict(
        hidden_size=1024, intermediate_size=2816, num_hidden_layers=12, num_attention_heads=16,
        num_key_value_heads=8, vocab_size=32000,
    ),
}

# Minimum kvcache / transformers decode tok/s ratio per shape (from the issue).
FLOORS: dict[str, float] = {"5M@512": 5.0, "5M@16k": 10.0, "200M@512": 1.0}

MAX_POSITIONS = 32768
SEED = 0


def log(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------------
# Models


def build_models(key: str, workdir: Path):
    """A random HF Llama and the kvcache model loaded from its ``save_pretrained`` output."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        **MODELS[key],
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        torch_dtype="float32",
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(SEED)
    hf = LlamaForCausalLM(cfg).to(torch.float32).eval()
    # Make sure generate never stops early or rewrites logits.
    hf.generation_config.eos_token_id = None
    hf.generation_config.bos_token_id = None
    hf.generation_config.pad_token_id = 0
    path = workdir / key
    hf.save_pretrained(path)
    kv = kvcache.load(path)
    return hf, kv


def weight_bytes_per_token(kv_model: torch.nn.Module) -> int:
    """Bytes of weights one decode step reads: everything but the embedding table, plus one row of it."""
    emb = kv_model.embed_tokens.weight
    total = 0
    seen: set[int] = set()
    for name, p in kv_model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if p is emb and kv_model.lm_head.weight is not emb:
            total += emb.shape[1] * emb.element_size()
        else:
            total += p.numel() * p.element_size()
    return total


def kv_bytes_per_token(kv_model: torch.nn.Module, context: float) -> float:
    cfg = kv_model.config
    elt = kv_model.embed_tokens.weight.element_size()
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * elt * context


# ----------------------------------------------------------------------------------------------------
# Engines


def run_kvcache(model, prompt: list[int], n: int) -> dict:
    stamps: list[float] = []

    def on_token(row: int, token: int) -> None:
        stamps.append(time.perf_counter())

    t0 = time.perf_counter()
    tokens = kvcache.generate(model, prompt, max_new_tokens=n, stop_tokens=(), on_token=on_token)
    return timing(t0, stamps, tokens, len(prompt))


# Captured engines keep one cache (kvcache) or one compiled static-cache model per prompt shape;
# the first call for a shape captures (untimed, its seconds recorded as compile_s).
_CAPTURED: dict[tuple, object] = {}
COMPILE_S: dict[tuple, float] = {}


def run_kvcache_compiled(model, prompt: list[int], n: int) -> dict:
    """kvcache with ``compile=True`` over a cache kept per shape, so every timed run replays the capture."""
    key = ("kvcache", id(model), len(prompt), n)
    if key not in _CAPTURED:
        cache = kvcache.make_cache(model, "dense", cache_length=len(prompt) + n)
        start = time.perf_counter()
        kvcache.generate(model, prompt, max_new_tokens=n, stop_tokens=(), cache=cache, compile=True)
        COMPILE_S[key] = time.perf_counter() - start
        _CAPTURED[key] = cache
    stamps: list[float] = []
    t0 = time.perf_counter()
    tokens = kvcache.generate(model, prompt, max_new_tokens=n, stop_tokens=(), cache=_CAPTURED[key], compile=True,
                              on_token=lambda row, token: stamps.append(time.perf_counter()))
    return {**timing(t0, stamps, tokens, len(prompt)), "compile_s": COMPILE_S[key]}


def run_transformers_compiled(model, prompt: list[int], n: int) -> dict:
    """transformers' static cache with ``torch.compile(model.forward)`` (fullgraph); the first
    call per shape compiles."""
    key = ("transformers", id(model), len(prompt), n)
    if key not in COMPILE_S:
        start = time.perf_counter()
        run_transformers(model, prompt, n)
        COMPILE_S[key] = time.perf_counter() - start
    return {**run_transformers(model, prompt, n), "compile_s": COMPILE_S[key]}


def compiled_transformers(path: Path):
    """A second transformers model of the same weights, static cache and compiled forward."""
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.bos_token_id = None
    hf.generation_config.pad_token_id = 0
    hf.generation_config.cache_implementation = "static"
    hf.forward = torch.compile(hf.forward, fullgraph=True)
    return hf


class _StampStreamer:
    """transformers streamer that timestamps each ``put`` (the first one is the prompt)."""

    def __init__(self) -> None:
        self.stamps: list[float] = []
        self.calls = 0

    def put(self, value) -> None:
        self.calls += 1
        if self.calls > 1:
            self.stamps.append(time.perf_counter())

    def end(self) -> None:
        pass


def run_transformers(model, prompt: list[int], n: int) -> dict:
    ids = torch.tensor([prompt], dtype=torch.long)
    mask = torch.ones_like(ids)
    streamer = _StampStreamer()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=n,
            min_new_tokens=0,
            do_sample=False,
            num_beams=1,
            use_cache=True,
            eos_token_id=None,
            pad_token_id=0,
            streamer=streamer,
        )
    tokens = out[0, len(prompt):].tolist()
    return timing(t0, streamer.stamps, tokens, len(prompt))


def timing(t0: float, stamps: list[float], tokens: list[int], prompt_len: int) -> dict:
    n = len(tokens)
    if len(stamps) != n:
        raise RuntimeError(f"expected {n} token timestamps, got {len(stamps)}")
    prefill_s = stamps[0] - t0
    decode_s = stamps[-1] - stamps[0]
    return {
        "tokens": tokens,
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "decode_steps": n - 1,
        "prefill_tok_s": prompt_len / prefill_s,
        "decode_tok_s": (n - 1) / decode_s if n > 1 and decode_s > 0 else None,
        "decode_ms_per_token": 1e3 * decode_s / (n - 1) if n > 1 else None,
    }


def summarize(runs: list[dict]) -> dict:
    best_prefill = min(runs, key=lambda r: r["prefill_s"])
    best_decode = min(runs, key=lambda r: r["decode_s"])
    return {
        "prefill_tok_s": best_prefill["prefill_tok_s"],
        "decode_tok_s": best_decode["decode_tok_s"],
        "decode_ms_per_token": best_decode["decode_ms_per_token"],
        "new_tokens": len(runs[0]["tokens"]),
        "runs": [
            {k: (round(v, 6) if isinstance(v, float) else v) for k, v in r.items() if k != "tokens"} for r in runs
        ],
        "tokens": runs[0]["tokens"],
    }


def bench_engines(engines: dict, prompt: list[int], repeats: int) -> dict:
    """Warm each engine up once, then time them in turn (interleaved, so load spikes hit both alike)."""
    warm_prompt = prompt[: min(len(prompt), 128)]
    for name, (fn, model, n) in engines.items():
        log(f"  {name}: warm-up ({len(warm_prompt)} prompt tokens, 4 new)")
        fn(model, warm_prompt, 4)
    runs: dict[str, list[dict]] = {name: [] for name in engines}
    for r in range(repeats):
        for name, (fn, model, n) in engines.items():
            res = fn(model, prompt, n)
            log(
                f"  {name}: run {r + 1}/{repeats}: prefill {res['prefill_tok_s']:.1f} tok/s ({res['prefill_s']:.3f} s), "
                f"decode {res['decode_tok_s']:.1f} tok/s ({res['decode_ms_per_token']:.2f} ms/token)"
            )
            runs[name].append(res)
    return {name: summarize(rs) for name, rs in runs.items()}


# ----------------------------------------------------------------------------------------------------
# Bandwidth and ceilings


def best_time(fn, repeats: int, inner: int = 1) -> float:
    best = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - t) / inner)
    return best


def read_bandwidth(nbytes: int, repeats: int = 7) -> float:
    """Bytes/s of ``x.sum()`` over an fp32 tensor of ``nbytes`` (best of ``repeats``)."""
    x = torch.ones(nbytes // 4, dtype=torch.float32)
    x.sum()
    inner = max(1, int(2**28 // nbytes))  # repeat small tensors so each sample is not timer-noise
    t = best_time(lambda: x.sum(), repeats, inner)
    del x
    return nbytes / t


def linear_ceiling(kv_model, context: int | None, repeats: int = 5) -> float:
    """Seconds per token of plain torch ops over the model's weights (and, with ``context``, its K/V)."""
    cfg = kv_model.config
    mats = []
    for layer in kv_model.layers:
        a, m = layer.self_attn, layer.mlp
        mats += [a.q_proj.weight, a.k_proj.weight, a.v_proj.weight, a.o_proj.weight,
                 m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight]
    mats.append(kv_model.lm_head.weight)
    xs = {W.shape[1]: torch.randn(1, 1, W.shape[1]) for W in mats}
    kvs = []
    if context is not None:
        G, D, H = cfg.num_heads // cfg.num_kv_heads, cfg.head_dim, cfg.num_kv_heads
        for _ in kv_model.layers:
            kvs.append((torch.randn(1, H, G, D), torch.randn(1, H, context, D), torch.randn(1, H, context, D)))

    def step() -> None:
        for W in mats:
            F.linear(xs[W.shape[1]], W)
        for q, k, v in kvs:
            F.scaled_dot_product_attention(q, k, v)

    with torch.inference_mode():
        step()
        per_step = best_time(step, 1)
        inner = max(1, int(0.2 / max(per_step, 1e-6)))
        return best_time(step, repeats, inner)


# ----------------------------------------------------------------------------------------------------


def bench_shape(name: str, hf, kv, bandwidth: float, args) -> dict:
    model_key, prompt_len = SHAPES[name]
    n = args.new_tokens
    n_hf = min(n, args.hf_new_tokens) if args.hf_new_tokens else n
    g = torch.Generator().manual_seed(SEED + prompt_len)
    prompt = torch.randint(0, kv.config.vocab_size, (prompt_len,), generator=g).tolist()
    log(f"[{name}] prompt {prompt_len} tokens, {n} new tokens (transformers: {n_hf})")

    load_before = os.getloadavg()
    engines = {"kvcache": (run_kvcache, kv, n), "transformers": (run_transformers, hf, n_hf)}
    if args.compiled:
        engines["kvcache_compiled"] = (run_kvcache_compiled, kv, n)
        engines["transformers_static_compiled"] = (run_transformers_compiled, compiled_transformers(args.path_of[model_key]), n_hf)
    res = bench_engines(engines, prompt, args.repeats)
    k_res, h_res = res["kvcache"], res["transformers"]
    compiled = {}
    if args.compiled:
        kc, hc = res["kvcache_compiled"], res["transformers_static_compiled"]
        for engine in (kc, hc):
            engine["compile_s"] = engine["runs"][0]["compile_s"]
            engine.pop("tokens")
        compiled = {
            "kvcache_compiled": kc, "transformers_static_compiled": hc,
            "decode_ratio_compiled_kvcache_over_transformers": kc["decode_tok_s"] / hc["decode_tok_s"],
            "decode_ratio_kvcache_compiled_over_eager": kc["decode_tok_s"] / k_res["decode_tok_s"],
        }
        log(f"  => compiled decode kvcache {kc['decode_tok_s']:.1f} tok/s (compile {kc['compile_s']:.1f} s), "
            f"transformers static {hc['decode_tok_s']:.1f} tok/s (compile {hc['compile_s']:.1f} s)")
    load_after = os.getloadavg()

    kt, ht = k_res.pop("tokens"), h_res.pop("tokens")
    common = min(len(kt), len(ht))
    agree = 0
    while agree < common and kt[agree] == ht[agree]:
        agree += 1

    wbytes = weight_bytes_per_token(kv)
    mean_ctx = prompt_len + n / 2
    kvbytes = kv_bytes_per_token(kv, mean_ctx)
    per_token = wbytes + kvbytes
    roofline = bandwidth / per_token
    log(f"  ceilings: torch F.linear / F.linear+SDPA over the weights (context {int(mean_ctx)})")
    lin_s = linear_ceiling(kv, None)
    lin_sdpa_s = linear_ceiling(kv, int(mean_ctx))
    ws_bw = read_bandwidth(int(per_token) // 4 * 4) if args.working_set_bandwidth else None

    kd, hd = k_res["decode_tok_s"], h_res["decode_tok_s"]
    ratio = kd / hd
    floor = FLOORS.get(name)
    params = sum(p.numel() for p in kv.parameters())
    out = {
        "model": {"key": model_key, "params": params, **MODELS[model_key],
                  "dtype": "float32", "hf_attn_implementation": hf.config._attn_implementation},
        "prompt_tokens": prompt_len,
        "batch_size": 1,
        "loadavg_1min_before_after": [round(load_before[0], 2), round(load_after[0], 2)],
        "kvcache": k_res,
        "transformers": h_res,
        "greedy_tokens_agree": agree == common,
        "greedy_agree_prefix": agree,
        "greedy_compared": common,
        "prefill_ratio_kvcache_over_transformers": k_res["prefill_tok_s"] / h_res["prefill_tok_s"],
        "decode_ratio_kvcache_over_transformers": ratio,
        **compiled,
        "floor_decode_ratio": floor,
        "floor_pass": None if floor is None else ratio >= floor,
        "roofline": {
            "weight_bytes_per_token": wbytes,
            "kv_bytes_per_token": kvbytes,
            "kv_context_assumed": mean_ctx,
            "bytes_per_token": per_token,
            "bandwidth_GBps": bandwidth / 1e9,
            "roofline_tok_s": roofline,
            "kvcache_fraction_of_roofline": kd / roofline,
            "transformers_fraction_of_roofline": hd / roofline,
            "working_set_bandwidth_GBps": None if ws_bw is None else ws_bw / 1e9,
            "working_set_roofline_tok_s": None if ws_bw is None else ws_bw / per_token,
        },
        "ceilings": {
            "linear_tok_s": 1 / lin_s,
            "kvcache_fraction_of_linear": kd / (1 / lin_s),
            "linear_sdpa_tok_s": 1 / lin_sdpa_s,
            "kvcache_fraction_of_linear_sdpa": kd / (1 / lin_sdpa_s),
        },
    }
    log(
        f"  => decode kvcache {kd:.1f} tok/s, transformers {hd:.1f} tok/s, ratio {ratio:.2f}x "
        f"(floor {floor}), roofline {roofline:.1f} tok/s ({100 * kd / roofline:.1f}%), "
        f"F.linear ceiling {1 / lin_s:.1f} tok/s, greedy agree {agree}/{common}"
    )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated subset of {', '.join(SHAPES)}")
    p.add_argument("--new-tokens", type=int, default=64, help="new tokens per generate call (>= 2)")
    p.add_argument("--hf-new-tokens", type=int, default=None,
                   help="cap transformers' new tokens (e.g. to shorten slow long-context runs; >= 16 advised)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per engine and shape (best is reported)")
    p.add_argument("--bandwidth-mib", type=int, default=1024, help="size of the bandwidth-probe tensor")
    p.add_argument("--working-set-bandwidth", action=argparse.BooleanOptionalAction, default=True,
                   help="also measure x.sum() bandwidth over a tensor the size of one token's reads")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--compiled", action="store_true",
                   help="also time kvcache with compile=True and transformers' static cache with a compiled forward")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = p.parse_args(argv)

    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        p.error(f"unknown shapes {unknown}; choose from {', '.join(SHAPES)}")
    if args.new_tokens < 2:
        p.error("--new-tokens must be >= 2 (decode time is measured between the first and last token)")
    if args.hf_new_tokens is not None and args.hf_new_tokens < 2:
        p.error("--hf-new-tokens must be >= 2")
    if args.threads:
        torch.set_num_threads(args.threads)

    import transformers
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()

    log(f"read bandwidth: x.sum() over {args.bandwidth_mib} MiB fp32, best of 7")
    bandwidth = read_bandwidth(args.bandwidth_mib * 2**20)
    log(f"  {bandwidth / 1e9:.2f} GB/s")

    result: dict = {
        "benchmark": "decode",
        "meta": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "kvcache": kvcache.__version__,
            "python": platform.python_version(),
            "machine": platform.machine(),
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "omp_env": {k: v for k, v in os.environ.items() if k.startswith(("OMP_", "KMP_", "GOMP_", "MKL_"))},
            "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
            "new_tokens": args.new_tokens,
            "hf_new_tokens": args.hf_new_tokens or args.new_tokens,
            "repeats": args.repeats,
            "timing": (
                "prefill = time from the generate call to the first new token (prompt forward + greedy pick); "
                "decode = first to last new token, i.e. N-1 one-token steps; best of `repeats` after one warm-up"
            ),
            "bandwidth_method": f"best of 7 x.sum() over {args.bandwidth_mib} MiB fp32",
            "roofline": "bandwidth / (weight bytes + K/V bytes at mean decode context) per token",
        },
        "bandwidth_GBps": bandwidth / 1e9,
        "shapes": {},
    }

    models: dict[str, tuple] = {}
    args.path_of = {}
    with tempfile.TemporaryDirectory(prefix="kvcache-bench-") as tmp:
        for name in shapes:
            key = SHAPES[name][0]
            if key not in models:
                log(f"building random Llama {key}")
                models[key] = build_models(key, Path(tmp))
                args.path_of[key] = Path(tmp) / key
            hf, kv = models[key]
            result["shapes"][name] = bench_shape(name, hf, kv, bandwidth, args)

    floors = [s["floor_pass"] for s in result["shapes"].values() if s["floor_pass"] is not None]
    result["all_floors_pass"] = all(floors) if floors else None
    result["all_greedy_agree"] = all(s["greedy_tokens_agree"] for s in result["shapes"].values())
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
