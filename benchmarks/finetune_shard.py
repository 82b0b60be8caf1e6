"""Per-rank memory of data-parallel fine-tuning: DDP against FSDP2 (``fully_shard``), N ranks
on the CPU (gloo), one optimizer step of ``chunked_loss`` through an h2o cache on a random-weight
Llama model of 125M parameters. Prints one JSON object. Run by ``benchmarks/finetune.py --shard``.

    python benchmarks/finetune.py --shard             # N = 2
    python benchmarks/finetune_shard.py --ranks 2     # the same

What is measured, per rank, in a torchrun process of its own:

- ``state_mb``: the bytes of what the rank holds of the parameters, their gradients and AdamW's
  state (two moments and a step count per parameter), counted from the tensors themselves after
  the optimizer step, gradients not yet cleared: DDP holds all of it on every rank, FSDP2 a 1/N
  shard of each. This is the issue's measure.
- ``peak_rss_mb``: the rank's peak resident set size over the whole run (model built, step taken)
  minus its size before the model existed: everything, DDP's gradient buckets, FSDP2's gathered
  layer and its communication buffers, activations and recorded keys and values included. As in
  benchmarks/finetune.py, ``MALLOC_MMAP_THRESHOLD_=65536`` makes the resident set follow live
  tensor memory.

FSDP2 builds the model on the meta device, shards it, then allocates each rank's shard and
initialises it (as FSDP2 is meant to be used: no rank ever holds the whole model); DDP builds it
whole on every rank.
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

from kvcache.runtime.threads import set_threads

# A Llama layout (Hugging Face config.json fields) of about 125M parameters: 12 layers, hidden 768,
# 12 query and 4 K/V heads, untied output head, vocabulary 32000.
LLAMA_125M = {
    "model_type": "llama", "vocab_size": 32000, "hidden_size": 768, "intermediate_size": 2048,
    "num_hidden_layers": 12, "num_attention_heads": 12, "num_key_value_heads": 4, "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "max_position_embeddings": 4096, "tie_word_embeddings": False,
}


def rank_main(cfg: dict) -> None:
    """One rank: build, shard, one step, measure; writes ``{out}/{how}_{rank}.json``."""
    import resource

    import torch
    from torch.distributed.tensor import DTensor, distribute_tensor

    import kvcache
    from kvcache.model.config import ModelConfig
    from kvcache.model.transformer import Transformer
    from kvcache.train.shard import init_distributed, rank_rows, shard

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    def nbytes(tensors) -> int:
        local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors if t is not None]
        return sum(t.numel() * t.element_size() for t in local)

    set_threads(cfg["threads"])
    rank, world = init_distributed(timeout=1800)
    base = rss()
    how = cfg["how"]
    config = ModelConfig.from_hf(LLAMA_125M)
    with torch.device("meta" if how == "fsdp" else "cpu"):
        model = Transformer(config)
    wrapped = shard(model, how)
    if how == "fsdp":
        wrapped.to_empty(device="cpu")
    # The same weights under both: each parameter drawn whole, in order, from one generator, and
    # under FSDP2 this rank's shard of it kept (one parameter whole at a time, 98 MB at most).
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in wrapped.parameters():
            full = torch.ones(p.shape) if p.dim() == 1 else torch.empty(p.shape).normal_(0.0, 0.02, generator=generator)
            if isinstance(p, DTensor):
                p.to_local().copy_(distribute_tensor(full, p.device_mesh, p.placements).to_local())
            else:
                p.copy_(full)
            del full
    model.reset_rope()
    params = [p for p in wrapped.parameters()]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    ids = torch.randint(3, config.vocab_size, (world, cfg["tokens"]), generator=torch.Generator().manual_seed(1))
    start = time.perf_counter()
    loss = kvcache.chunked_loss(wrapped, rank_rows(ids, rank, world), policy="h2o", cache_length=cfg["cache_length"],
                                chunk=cfg["chunk"], options={"recent": cfg["cache_length"] // 2})
    loss.backward()
    optimizer.step()
    seconds = time.perf_counter() - start
    state = {
        "params_mb": nbytes(params) / 2**20,
        "grads_mb": nbytes(p.grad for p in params) / 2**20,
        "optimizer_mb": nbytes(t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)) / 2**20,
    }
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    result = {"rank": rank, **{k: round(v, 1) for k, v in state.items()},
              "state_mb": round(sum(state.values()), 1), "peak_rss_mb": round((peak - base) / 2**20, 1),
              "step_s": round(seconds, 2), "loss": round(loss.item(), 4),
              "parameters": sum(p.numel() for p in params)}
    Path(cfg["out"], f"{how}_{rank}.json").write_text(json.dumps(result))
    torch.distributed.destroy_process_group()


def launch(how: str, args, out: str) -> list[dict]:
    cfg = {"how": how, "threads": args.threads, "tokens": args.tokens, "chunk": args.chunk,
           "cache_length": args.cache_length, "out": out}
    print(f"{how} on {args.ranks} ranks ...", file=sys.stderr, flush=True)
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": str(args.threads)}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.ranks),
               "--master-port", str(args.port), __file__, "--rank-main", json.dumps(cfg)]
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{how} failed:\n{done.stderr[-3000:]}")
    return [json.loads(Path(out, f"{how}_{r}.json").read_text()) for r in range(args.ranks)]


def measure(args) -> dict:
    load_before = os.getloadavg()
    start = time.time()
    with tempfile.TemporaryDirectory() as out:
        ranks = {how: launch(how, args, out) for how in ("ddp", "fsdp")}
    worst = {how: {key: max(r[key] for r in rows) for key in ("state_mb", "peak_rss_mb")} for how, rows in ranks.items()}
    return {
        "model": "random-weight Llama, 12 layers, hidden 768, 12/4 heads, vocabulary 32000, float32",
        "parameters": ranks["ddp"][0]["parameters"], "ranks": args.ranks, "backend": "gloo", "device": "cpu",
        "step": f"one AdamW step of chunked_loss, {args.ranks} rows of {args.tokens} tokens (one a rank), "
                f"chunks of {args.chunk}, h2o cache of {args.cache_length}",
        "threads_per_rank": args.threads, "torch": __import__("torch").__version__,
        "per_rank": ranks, "worst_rank": worst,
        "fsdp_vs_ddp": {key: round(worst["fsdp"][key] / worst["ddp"][key], 3) for key in ("state_mb", "peak_rss_mb")},
        "bar": "FSDP per-rank state <= 0.6x DDP's",
        # The same weights and rows: the losses agree (to float rounding), so both ran the same step.
        "loss": {how: rows[0]["loss"] for how, rows in ranks.items()},
        "loadavg_before": [round(x, 2) for x in load_before], "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "seconds": round(time.time() - start, 1),
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--tokens", type=int, default=128, help="tokens per row")
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--cache-length", type=int, default=64)
    p.add_argument("--threads", type=int, default=1, help="threads per rank")
    p.add_argument("--port", type=int, default=29517)
    p.add_argument("--rank-main", help=argparse.SUPPRESS)
    return p


if __name__ == "__main__":
    parsed = parser().parse_args()
    if parsed.rank_main:
        rank_main(json.loads(parsed.rank_main))
    else:
        print(json.dumps(measure(parsed), indent=2))
