"""Workers for the data-parallel tests: each runs in its own process, one per rank, on gloo.

A worker computes, for each case, the gradient of ``chunked_loss`` over the global batch in one
process (the reference, on every rank) and the gradient of the same batch split over the ranks
through a sharded model (DDP or FSDP2), and writes rank 0's relative errors to a JSON file.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
from train_util import loss_args, relative_errors, token_ids

import kvcache
from kvcache.train.lora import add_lora
from kvcache.train.shard import full_state_dict, init_distributed, leave_distributed, rank_rows, shard, unwrap


def set_env(rank: int, world: int, port: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def build(ckpt: str, lora: bool) -> torch.nn.Module:
    """The checkpoint, loaded alike on every rank; with LoRA, adapters with nonzero B."""
    torch.manual_seed(0)
    model = kvcache.load(ckpt)
    if lora:
        model = add_lora(model, 2, targets=("q_proj", "v_proj", "down_proj"))
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(0.05 * torch.randn(p.shape, generator=gen))
    return model


def batch(rows: int, T: int, ragged: bool) -> tuple:
    """ids, labels (some ignored, so ranks hold different target counts) and weights, (rows, T);
    ``ragged``: lists of rows of T, T - 7, T - 13 ... tokens instead."""
    ids = token_ids(T, batch=rows, seed=7).cpu()  # gloo ranks run on the CPU whatever the test device
    labels = ids.clone()
    labels[0, 2:9] = -100
    weights = 1.0 + torch.rand(rows, T, generator=torch.Generator().manual_seed(3))
    if ragged:
        lengths = [T - 7 * i % (T - 2) for i in range(rows)]
        return tuple([t[i, :n] for i, n in enumerate(lengths)] for t in (ids, labels, weights))
    return ids, labels, weights


def gradients_of(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in named.items():
        if p.grad is not None:
            g = p.grad
            out[name] = (g.full_tensor() if isinstance(g, DTensor) else g).detach().clone()
    return out


def equivalence(rank: int, world: int, port: int, ckpt: str, cases: list[dict], out: str) -> None:
    """For each case {how, lora, policy, options}: (loss error, max gradient error) to ``out``."""
    set_env(rank, world, port)
    torch.set_num_threads(1)
    init_distributed(timeout=60)
    results = []
    for case in cases:
        ids, labels, weights = batch(case.get("rows", 3), 24, case.get("ragged", False))
        kw = dict(policy=case["policy"], chunk=8, **case.get("options", {}))
        reference = build(ckpt, case["lora"])
        loss = kvcache.chunked_loss(reference, ids, labels, weights=weights, **loss_args(kw))
        loss.backward()
        want = gradients_of(dict(reference.named_parameters()))

        sharded = shard(build(ckpt, case["lora"]), case["how"])
        mine = [rank_rows(t, rank, world) for t in (ids, labels, weights)]
        got_loss = kvcache.chunked_loss(sharded, mine[0], mine[1], weights=mine[2], **loss_args(kw))
        got_loss.backward()
        got = gradients_of(dict(unwrap(sharded).named_parameters()))
        state = full_state_dict(sharded)
        errors = relative_errors(got, want)
        results.append({**case, "loss_error": abs(got_loss.item() - loss.item()) / abs(loss.item()),
                        "grad_error": max(errors.values()), "params": len(errors),
                        "state_equal": all(torch.equal(state[n], t) for n, t in reference.state_dict().items())})
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    leave_distributed(finished=True)


def failing_rank(rank: int, world: int, port: int, ckpt: str, mode: str) -> None:
    """Rank 1 fails in its own way (``mode``: "raise", a ValueError of chunked_loss; "vanish", an
    exit without a word) while rank 0 goes on into the step's first collective."""
    set_env(rank, world, port)
    torch.set_num_threads(1)
    init_distributed(timeout=20)
    sharded = shard(build(ckpt, False), "ddp")
    ids = token_ids(16, batch=1, seed=rank).cpu()
    if rank == 1 and mode == "raise":
        ids = ids[:, :1]  # one token: nothing to predict
    if rank == 1 and mode == "vanish":
        os._exit(0)
    try:
        kvcache.chunked_loss(sharded, ids, chunk=8).backward()
    except Exception:
        if rank == 0 and mode == "raise":
            # Rank 1's own error ends the run; this rank's collective fails only because rank 1
            # left. Exiting at once could let it be reported first on a busy machine.
            time.sleep(20)
        raise
