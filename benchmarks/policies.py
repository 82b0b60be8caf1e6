"""Decode step time and cache bytes of every policy against dense at the same cache_length.

Each policy's cache is filled to ``cache_length`` by one prefill and stays full: every timed
decode step evicts one token. Dense, which cannot evict, is prefilled again before each repeat
with ``cache_length - steps - 1`` tokens, so its last step reads ``cache_length`` keys: it never
reads more keys than the policies (on average ``steps / 2`` fewer), so the comparison does not
flatter them. Policies take turns step by step, so a slow moment of a shared machine lands on
all of them alike; the step time reported is the median over ``steps x repeats`` steps, and the
mean next to it. The ``_reserve64`` variants evict 65 tokens down to ``cache_length - 64`` once
every 65 steps and append in between (so they also hold 32 fewer tokens on average): their mean
is the amortised cost, their median an appending step.
Prints one JSON object.

    python benchmarks/policies.py [--cache-length 1024 4096] [--steps 64] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
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
    # Batched eviction: one eviction (the chunk path) every 65 steps, appends in between.
    "h2o_reserve64": {"recent": 32, "reserve": 64},
    "tova_reserve64": {"reserve": 64},
    "knorm": {},
    "expected_attention": {},
    "knorm_reserve64": {"reserve": 64},
    "expected_attention_reserve64": {"reserve": 64},
}
FLOORS = {"h2o": 1.25, "tova": 1.25, "window": 1.05, "sink": 1.05, "sink_absolute": 1.05}


def policy_of(name: str) -> str:
    """The registered policy a row of POLICIES runs: its name up to a variant suffix."""
    return name.removesuffix("_reserve64").removesuffix("_absolute")


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
    """Median decode step time per policy (see the module docstring)."""
    if steps + 1 >= cache_length:
        raise ValueError(f"steps ({steps}) must be smaller than cache_length - 1 ({cache_length - 1})")
    caches = {name: kvcache.make_cache(model, policy_of(name), cache_length=cache_length, **options)
              for name, options in POLICIES.items()}
    prompt = torch.randint(0, model.config.vocab_size, (1, cache_length))
    token = torch.randint(0, model.config.vocab_size, (1, 1))
    for name, cache in caches.items():
        if name != "dense":
            model(prompt, cache, last_only=True)
    times: dict[str, list[float]] = {name: [] for name in POLICIES}
    for _ in range(repeats):
        dense = caches["dense"]
        dense.reset()
        model(prompt[:, : cache_length - steps - 1], dense, last_only=True)
        for cache in caches.values():
            model(token, cache)  # one untimed step: first-call effects
        for _ in range(steps):
            for name, cache in caches.items():
                start = time.perf_counter()
                model(token, cache)
                times[name].append(time.perf_counter() - start)
    return {
        name: {"step_ms": statistics.median(times[name]) * 1e3,
               "step_ms_mean": statistics.mean(times[name]) * 1e3,
               "step_ms_p10_p90": [q * 1e3 for q in statistics.quantiles(times[name], n=10)[::8]],
               "cache_bytes": cache.nbytes(), "slots": cache.cache_length}
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
