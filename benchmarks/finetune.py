"""Peak memory and step time of one training step (forward and backward, no optimizer) over long
sequences: full backprop against ``chunked_loss`` through a dense cache and through sink and h2o
caches of 1024 slots. Prints one JSON object.

    python benchmarks/finetune.py                       # 4k, 8k, 16k tokens; the bundled model
    python benchmarks/finetune.py --lengths 4096 --steps 1
    python benchmarks/finetune.py --shard               # DDP vs FSDP2 per-rank memory (finetune_shard.py)

Model: the bundled reference model (5.1M parameters, 4 layers, hidden 256, 8 query / 2 K/V heads,
vocabulary 8192), in float32 on the CPU, one row per step.

Method: every configuration runs in a fresh subprocess, so that its peak resident set size
(``ru_maxrss``) belongs to it alone. The subprocess loads the model, runs one warm-up step on a
1024-token row (a smaller peak than any measured step), records its resident set size, then runs
``--steps`` steps on a row of the measured length. ``peak_mb`` is the peak resident set size
during those steps minus the resident size before them: the memory the step itself needed
(activations, logits, attention scratch, recorded keys and values, gradients; the parameters and
their gradient buffers of the warm-up are already counted in the baseline). The subprocess runs
with ``MALLOC_MMAP_THRESHOLD_=65536``, so every tensor above 64 KiB is mapped on its own and
returned to the system when freed, and the resident set follows live tensor memory (with glibc's
default, a threshold that grows after large frees, freed tensors stay resident in the heap and a
chunked step looked twice as large). ``step_s`` is the median step time. The machine's other work
makes times noisy (the JSON records the load average before and after).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CHILD = r"""
import json, resource, sys, time
import torch
import torch.nn.functional as F
import kvcache
from kvcache.runtime.threads import set_threads
from kvcache.cache.registry import budget_options

cfg = json.loads(sys.argv[1])
set_threads(cfg["threads"])
model = kvcache.load(dtype=torch.float32)
model.train()
V = model.config.vocab_size

def step(T, seed):
    ids = torch.randint(3, V, (1, T), generator=torch.Generator().manual_seed(seed))
    if cfg["mode"] == "full":
        logits = model(ids)
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    else:
        policy = cfg["policy"]
        C = T if policy == "dense" else cfg["cache_length"]
        options = {} if policy == "dense" else budget_options(policy, C)
        loss = kvcache.chunked_loss(model, ids, policy=policy, cache_length=C, chunk=min(cfg["chunk"], T),
                                    offload_kv=cfg.get("offload", False), **options)
    loss.backward()
    model.zero_grad(set_to_none=False)  # keep the gradient buffers: they are not the step's memory

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096

step(1024, 0)
base = rss()
times = []
for i in range(cfg["steps"]):
    t = time.perf_counter()
    step(cfg["length"], i + 1)
    times.append(time.perf_counter() - t)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
# What --offload-kv keeps in CPU memory: the recorded keys and values (float32) and their
# float32 gradient buffers, 2 x 2 x layers x K/V heads x head_dim numbers a token.
c = model.config
offloaded = 2 * 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4 * cfg["length"]
print(json.dumps({"base_mb": base / 2**20, "peak_mb": (peak - base) / 2**20, "times": times,
                  "offloaded_mb": offloaded / 2**20}))
"""

CONFIGS = {
    "full_backprop": {"mode": "full"},
    "chunked_dense": {"mode": "chunked", "policy": "dense"},
    "chunked_sink": {"mode": "chunked", "policy": "sink"},
    "chunked_h2o": {"mode": "chunked", "policy": "h2o"},
    # --offload-kv: the recorded keys and values and their gradient buffers in CPU memory. On a
    # CPU-only machine that is where they were anyway: the peak cannot move, only the code path
    # is timed; ``offloaded_mb`` is how much would leave an accelerator.
    "chunked_h2o_offload": {"mode": "chunked", "policy": "h2o", "offload": True},
}


def run(name: str, length: int, args) -> dict:
    cfg = {**CONFIGS[name], "length": length, "steps": args.steps, "threads": args.threads,
           "cache_length": args.cache_length, "chunk": args.chunk}
    print(f"{name} at {length} tokens ...", file=sys.stderr, flush=True)
    # A fixed mmap threshold: glibc otherwise raises it after large frees, and the tensors that then
    # come from the heap are not returned to the system, which inflates the resident set.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(cfg)], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{name} at {length} failed:\n{done.stderr[-2000:]}")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    extra = {"offloaded_mb": round(out["offloaded_mb"], 1)} if cfg.get("offload") else {}
    return {**extra, "peak_mb": round(out["peak_mb"], 1), "base_mb": round(out["base_mb"], 1),
            "step_s": round(statistics.median(out["times"]), 3), "times_s": [round(t, 3) for t in out["times"]]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="4096,8192,16384")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--cache-length", type=int, default=1024, help="slots of the sink and h2o caches")
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--steps", type=int, default=2, help="measured steps per configuration")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--shard", action="store_true",
                        help="instead: per-rank memory of DDP against FSDP2 on 2 gloo ranks (finetune_shard.py)")
    args = parser.parse_args()
    if args.shard:
        import finetune_shard

        print(json.dumps(finetune_shard.measure(finetune_shard.parser().parse_args([])), indent=2))
        return
    lengths = [int(x) for x in args.lengths.split(",")]
    names = args.configs.split(",")
    load_before = os.getloadavg()
    start = time.time()
    results = {name: {str(T): run(name, T, args) for T in lengths} for name in names}
    ratios = {}
    if "full_backprop" in results:
        for name in names:
            if name == "full_backprop":
                continue
            ratios[name] = {str(T): {
                "peak_vs_full": round(results[name][str(T)]["peak_mb"] / results["full_backprop"][str(T)]["peak_mb"], 3),
                "step_time_vs_full": round(results[name][str(T)]["step_s"] / results["full_backprop"][str(T)]["step_s"], 3),
            } for T in lengths}
    print(json.dumps({
        "model": "bundled reference model (5.1M parameters, float32)", "device": "cpu", "threads": args.threads,
        "cache_length": args.cache_length, "chunk": args.chunk, "steps": args.steps, "torch": __import__("torch").__version__,
        "loadavg_before": [round(x, 2) for x in load_before], "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "seconds": round(time.time() - start, 1), "results": results, "ratios": ratios,
    }, indent=2))


if __name__ == "__main__":
    main()
