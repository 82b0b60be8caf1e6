"""Decode step time and cache bytes of every policy against dense at the same cache_length.

Each policy's cache is filled to ``cache_length`` by a prefill, then timed over decode steps in
which it evicts one token per step (dense gets ``cache_length + steps + 1`` slots so it can hold
them; it reads the same number of keys). Prints one JSON object.

    python benchmarks/policies.py [--cache-length 1024 4096] [--steps 64] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time

import torch

import kvcache

POLICIES = {
    "dense": {},
    "window": {},
    "sink": {"sinks": 4},
    "sink_absolute": {"sinks": 4, "positions": "absolute"},
    "h2o": {"recent": 32},
    "tova": {},
    "snapkv": {"window": 32},
}
FLOORS = {"h2o": 1.25, "tova": 1.25, "window": 1.05, "sink": 1.05, "sink_absolute": 1.05}


def build_model(hidden: int, layers: int, heads: int, kv_heads: int, vocab: int, max_pos: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=hidden, intermediate_size=hidden * 8 // 3, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
        max_position_embeddings=max_pos,
    )
    with tempfile.TemporaryDirectory() as d:
        LlamaForCausalLM(cfg).save_pretrained(d)
        return kvcache.load(d)


@torch.inference_mode()
def time_policies(model, cache_length: int, steps: int, repeats: int) -> dict:
    """Best decode step time per policy. Policies take turns within each repeat, so a slow
    moment of the machine does not land on one policy only."""
    caches = {}
    for name, options in POLICIES.items():
        policy = name.split("_")[0]
        length = cache_length + steps + 1 if policy == "dense" else cache_length
        caches[name] = kvcache.make_cache(model, policy, cache_length=length, **options)
    prompt = torch.randint(0, model.config.vocab_size, (1, cache_length))
    token = torch.randint(0, model.config.vocab_size, (1, 1))
    best = {name: float("inf") for name in POLICIES}
    for _ in range(repeats):
        for name, cache in caches.items():
            cache.reset()
            model(prompt, cache, last_only=True)
            model(token, cache)  # one untimed step: first-call effects
            start = time.perf_counter()
            for _ in range(steps):
                model(token, cache)
            best[name] = min(best[name], (time.perf_counter() - start) / steps)
    return {
        name: {"step_ms": best[name] * 1e3, "cache_bytes": cache.nbytes(), "slots": cache.cache_length}
        for name, cache in caches.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache-length", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    model = build_model(hidden=256, layers=4, heads=4, kv_heads=2, vocab=4096, max_pos=65536)
    report = {
        "model": "llama hidden 256, 4 layers, 4 heads, 2 KV heads, vocab 4096, fp32, batch 1",
        "threads": torch.get_num_threads(),
        "results": {},
    }
    for C in args.cache_length:
        print(f"cache_length={C}", file=sys.stderr)
        rows = time_policies(model, C, args.steps, args.repeats)
        dense = rows["dense"]["step_ms"]
        for name, row in rows.items():
            row["vs_dense"] = row["step_ms"] / dense
            if name in FLOORS:
                row["floor"] = FLOORS[name]
                row["meets_floor"] = row["vs_dense"] <= FLOORS[name]
        report["results"][str(C)] = rows
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
