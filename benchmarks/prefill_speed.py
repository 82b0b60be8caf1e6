"""Prefill against transformers, in one run: the time to the first token and the peak memory of
a prompt's prefill, for kvcache's default chunking, kvcache in one chunk, and transformers (one
pass through SDPA), on the same random Llama weights.

Each case runs in a fresh process (one thread by default): build or load the model, note the
resident set, reset its high-water mark, then time ``generate`` of one new token from
``--tokens`` random ids (kvcache: ``kvcache.generate``; transformers: ``model.generate``, greedy)
and report the wall time and the high-water mark above what the process held before. Engines
take turns case by case, so a slow moment of a shared machine lands on all of them alike; the
best of ``--repeats`` is reported, with kvcache's ratio to transformers (tokens per second, so
above 1 is faster) and, for each scoring policy (``--policies``, with ``cache_length`` a quarter
of the prompt), its time against dense's.

Shapes: ``smollm2`` (SmolLM2-135M's geometry: 30 layers, 576 channels, 9 query and 3 K/V heads),
``5M`` (4 layers, 256 channels, 4 and 2 heads: the shape of benchmarks/decode.py).

    python benchmarks/prefill_speed.py [--cases smollm2@1k,5M@4k,5M@16k] [--policies snapkv,tova]
                                       [--chunk 512] [--repeats 2] [--threads 1] [--out FILE]

``--chunk``: kvcache's chunk (default: ``generate``'s, ``DEFAULT_PREFILL_CHUNK``), to compare sizes.

Prints one JSON object; progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from emit import emit, machine

SHAPES = {
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, vocab_size=49152, rope_theta=100000.0),
    "5M": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=4096),
}
LENGTHS = {"1k": 1024, "4k": 4096, "16k": 16384, "32k": 32768}
DEFAULT_CASES = "smollm2@1k,5M@4k,5M@16k"
SCORING = "snapkv,tova,h2o,expected_attention,knorm,keydiff"


def log(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


def build(shape: str, directory: Path) -> None:
    """A random Llama of ``shape`` saved into ``directory`` (seeded: every case loads the same)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=40000, tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(directory)


def run_case(args) -> dict:
    """One prefill in this process: ``args.engine`` over ``args.model``; the figures as a dict."""
    import rss
    import torch

    import kvcache
    from kvcache.runtime.threads import set_threads

    set_threads(args.threads)
    ids = torch.randint(3, 4000, (1, args.tokens), generator=torch.Generator().manual_seed(1))
    if args.engine == "transformers":
        from transformers import LlamaForCausalLM

        model = LlamaForCausalLM.from_pretrained(args.model, attn_implementation="sdpa").eval()

        def prefill():
            model.generate(ids, max_new_tokens=1, do_sample=False, pad_token_id=0)
    else:
        model = kvcache.load(args.model)
        chunk = None if args.engine == "kvcache-one-chunk" else args.chunk
        length = args.tokens + 1 if args.policy == "dense" else args.tokens // 4

        def prefill():
            kvcache.generate(model, ids[0].tolist(), max_new_tokens=1, policy=args.policy, cache_length=length,
                             prefill_chunk=chunk, stop_tokens=())
    rss.trim()
    before = rss.status("VmRSS")
    rss.reset_peak()
    start = time.perf_counter()
    with torch.inference_mode():
        prefill()
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "tok_s": args.tokens / seconds, "peak_above_model_bytes": rss.status("VmHWM") - before}


def case(model_dir: Path, engine: str, policy: str, tokens: int, threads: int, chunk: int) -> dict:
    """``run_case`` in a fresh process, so that each peak is its own."""
    out = subprocess.run(
        [sys.executable, __file__, "--case", "--model", str(model_dir), "--engine", engine, "--policy", policy,
         "--tokens", str(tokens), "--threads", str(threads), "--chunk", str(chunk)],
        capture_output=True, text=True, check=False, env={**os.environ, "TRANSFORMERS_VERBOSITY": "error"})
    if out.returncode != 0:
        raise SystemExit(f"{engine} {policy} at {tokens} tokens failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def best(runs: list[dict]) -> dict:
    fastest = min(runs, key=lambda r: r["seconds"])
    return {**fastest, "runs_s": [round(r["seconds"], 3) for r in runs],
            "peak_above_model_bytes": max(r["peak_above_model_bytes"] for r in runs)}


def measure(shape: str, tokens: int, policies: list[str], repeats: int, threads: int, chunk: int, root: Path) -> dict:
    model_dir = root / shape
    if not model_dir.exists():
        build(shape, model_dir)
    engines = [("transformers", "dense"), ("kvcache", "dense"), ("kvcache-one-chunk", "dense")]
    engines += [("kvcache", p) for p in policies]
    runs: dict[tuple[str, str], list[dict]] = {e: [] for e in engines}
    for r in range(repeats):
        for engine, policy in engines:
            res = case(model_dir, engine, policy, tokens, threads, chunk)
            runs[(engine, policy)].append(res)
            log(f"  {shape}@{tokens} {engine} {policy}: run {r + 1}/{repeats}: {res['tok_s']:.0f} tok/s "
                f"({res['seconds']:.2f} s), peak +{res['peak_above_model_bytes'] / 2**20:.0f} MiB")
    found = {f"{engine}:{policy}": best(r) for (engine, policy), r in runs.items()}
    hf, dense, one = found["transformers:dense"], found["kvcache:dense"], found["kvcache-one-chunk:dense"]
    return {
        "shape": shape, "tokens": tokens, "chunk": chunk, "engines": found,
        "dense_over_transformers": dense["tok_s"] / hf["tok_s"],
        "one_chunk_over_transformers": one["tok_s"] / hf["tok_s"],
        "dense_peak_over_transformers": dense["peak_above_model_bytes"] / hf["peak_above_model_bytes"],
        "policy_time_over_dense": {p: found[f"kvcache:{p}"]["seconds"] / dense["seconds"] for p in policies},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default=DEFAULT_CASES, help=f"shape@length, comma-separated (default: {DEFAULT_CASES})")
    p.add_argument("--policies", default=SCORING, help=f"scoring policies at a quarter of the prompt (default: {SCORING}; "
                                                       "'' for none)")
    p.add_argument("--chunk", type=int, default=None, help="kvcache's prefill chunk (default: generate's)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", help="also write the JSON here")
    # One case in this process (the driver's subprocesses).
    p.add_argument("--case", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--engine", help=argparse.SUPPRESS)
    p.add_argument("--policy", default="dense", help=argparse.SUPPRESS)
    p.add_argument("--tokens", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.chunk is None:
        from kvcache.generation.generate import DEFAULT_PREFILL_CHUNK

        args.chunk = DEFAULT_PREFILL_CHUNK
    elif args.chunk < 1:
        raise SystemExit(f"--chunk must be a positive number of tokens, got {args.chunk}")
    if args.case:
        print(json.dumps(run_case(args)))
        return
    cases = []
    for item in filter(None, (c.strip() for c in args.cases.split(","))):
        shape, _, length = item.partition("@")
        if shape not in SHAPES or length not in LENGTHS:
            raise SystemExit(f"--cases: {item!r} is not shape@length with shape in {sorted(SHAPES)} and length in "
                             f"{sorted(LENGTHS)}")
        cases.append((shape, LENGTHS[length]))
    policies = [q for q in (s.strip() for s in args.policies.split(",")) if q]
    load = list(os.getloadavg())
    with tempfile.TemporaryDirectory() as root:
        results = [measure(shape, tokens, policies, args.repeats, args.threads, args.chunk, Path(root))
                   for shape, tokens in cases]
    emit({"benchmark": "prefill_speed", "threads": args.threads, "repeats": args.repeats, "machine": machine(load),
          "results": results}, args.out)


if __name__ == "__main__":
    main()
