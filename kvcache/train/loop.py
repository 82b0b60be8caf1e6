"""The fine-tuning loop: AdamW over rows of token ids, each row's loss computed chunk by chunk
through a bounded cache (``chunked_loss``), with gradient accumulation, a warm-up and cosine
learning-rate schedule, gradient clipping, bf16 autocast on CUDA and a progress bar with the
loss and tokens per second."""

from __future__ import annotations

import json
import math
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from ..errors import KVCacheWarning
from .chunked import chunked_loss
from .shard import SHARDINGS, grad_norm, rank_rows, shard

# Warm-up steps when a config does not say (capped at a tenth of its steps).
DEFAULT_WARMUP = 10


@dataclass
class FinetuneConfig:
    """What ``finetune`` does. Sizes are in tokens."""

    policy: str = "h2o"
    cache_length: int = 1024
    chunk: int = 512
    policy_options: dict = field(default_factory=dict)
    steps: int = 100
    lr: float = 2e-4
    # Linear warm-up steps (``lr_at``). None: ``DEFAULT_WARMUP``, or a tenth of ``steps`` when that
    # is fewer. More than ``steps`` is cut to ``steps`` with a warning (the rate would never reach ``lr``).
    warmup: int | None = None
    batch_size: int = 1          # rows per micro-batch (one chunked_loss call)
    grad_accum: int = 1          # micro-batches per optimizer step
    weight_decay: float = 0.0
    clip: float = 1.0
    seed: int = 0
    log_every: int = 1
    # Stop after the step that passes this wall-clock budget (the schedule still spans ``steps``).
    max_minutes: float | None = None
    # Data parallelism over an initialised process group (shard.init_distributed): "ddp" or
    # "fsdp". ``batch_size`` is then the global micro-batch, split over the ranks.
    shard: str | None = None
    # Keep the recorded keys and values (the memory that grows with the row) in CPU memory.
    offload_kv: bool = False

    def __post_init__(self) -> None:
        for name in ("cache_length", "chunk", "steps", "batch_size", "grad_accum"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.chunk > self.cache_length:
            raise ValueError(
                f"chunk ({self.chunk}) is larger than the cache (cache_length={self.cache_length}): a chunk's "
                "activations would then exceed what the cache bounds; use a chunk of at most the cache length"
            )
        if self.shard is not None and self.shard not in SHARDINGS:
            raise ValueError(f"shard must be one of {', '.join(SHARDINGS)} (or None), got {self.shard!r}")
        if self.lr <= 0 or (self.warmup is not None and self.warmup < 0):
            raise ValueError(f"lr must be positive and warmup >= 0, got lr={self.lr}, warmup={self.warmup}")
        if self.warmup is None:
            self.warmup = min(DEFAULT_WARMUP, self.steps // 10)
        elif self.warmup > self.steps:
            warnings.warn(
                f"warmup ({self.warmup} steps) is longer than the run ({self.steps} steps): the learning rate would "
                f"end at {self.lr * self.steps / self.warmup:.3g}, never reaching lr={self.lr:g}; warming up over the "
                f"{self.steps} steps instead (pass a smaller warmup, or more steps)", KVCacheWarning, stacklevel=3)
            self.warmup = self.steps


def lr_at(step: int, config: FinetuneConfig) -> float:
    """Linear warm-up, then cosine decay to a tenth of ``lr`` at the last step."""
    if step < config.warmup:
        return config.lr * (step + 1) / config.warmup
    progress = min(1.0, (step - config.warmup) / max(1, config.steps - config.warmup))
    return config.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def check_rows(seq_len: int, config: FinetuneConfig) -> None:
    """Raise ValueError if rows of ``seq_len`` tokens do not suit ``config``."""
    if seq_len < config.chunk:
        raise ValueError(
            f"the sequence ({seq_len} tokens) is shorter than one chunk ({config.chunk}): nothing would go "
            "through the cache; use a longer --seq-len or a smaller --chunk"
        )


def finetune(
    model: torch.nn.Module,
    rows: torch.Tensor | list[torch.Tensor],
    config: FinetuneConfig,
    *,
    weights: torch.Tensor | list[torch.Tensor] | None = None,
    batches: Callable[[int], tuple[torch.Tensor, torch.Tensor | None]] | None = None,
    log: str | Path | None = None,
    on_step: Callable[[int, dict], None] | None = None,
    progress: bool = True,
) -> list[dict]:
    """Train ``model`` in place (a ``kvcache.Transformer``, or one wrapped by ``add_lora``).

    rows:    (N, T) token ids; each micro-batch takes ``batch_size`` rows in a shuffled order
             that is drawn anew every pass over the data. Or a list of N 1-D rows of different
             lengths (ragged; ``weights`` then a list alike), each trained as it would be alone.
    weights: (N, T) optional per-token loss weights (see ``chunked_loss``).
    batches: instead of rows, a function of the micro-batch index returning (ids (B, T), weights
             or None): rows generated on the fly (``rows`` then only gives T).
    log:     a JSONL file that receives one record per ``log_every`` steps.
    on_step: called after every optimizer step with (step, record).
    Returns the records. On CUDA the forward runs under bf16 autocast with float32 weights.

    With ``config.shard``, every rank of the initialised process group calls this with the same
    model, rows and config: each draws the same global micro-batch and trains on its share, the
    gradients are those of the global batch, and only rank 0 shows progress and writes ``log``
    (its records are the global batch's). Under "fsdp" the model is left sharded in place:
    ``shard.full_state_dict`` gathers it.
    """
    ragged = isinstance(rows, (list, tuple))
    check_rows(max(len(r) for r in rows) if ragged else rows.shape[1], config)
    rank, world = 0, 1
    if config.shard is not None:
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        rank_rows(torch.empty(config.batch_size), rank, world)  # every rank gets a row
        model = shard(model, config.shard)
    progress, log = progress and rank == 0, log if rank == 0 else None
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("no parameter of the model requires grad: nothing to train")
    optimizer = _optimizer(params, config)
    next_batch = batches if batches is not None else _shuffled_batches(rows, weights, config)
    run = _Run(model, config, next_batch, ragged, params[0].device, rank, world)
    records, sink = [], None if log is None else open(log, "a")
    model.train()
    bar = tqdm(total=config.steps, disable=not progress, unit="step", dynamic_ncols=True)
    start, tokens = time.time(), 0
    try:
        for step in range(config.steps):
            lr = lr_at(step, config)
            for group in optimizer.param_groups:
                group["lr"] = lr
            total, read = _accumulate(run, step)
            tokens += read
            norm = grad_norm(params, config.clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            elapsed = time.time() - start
            record = {"step": step + 1, "loss": round(total, 4), "lr": round(lr, 8), "grad_norm": round(norm, 4),
                      "tokens": tokens, "seconds": round(elapsed, 1), "tokens_per_s": round(tokens / elapsed, 1)}
            records.append(record)
            bar.set_postfix(loss=f"{total:.4f}", tok_s=f"{tokens / elapsed:.0f}")
            bar.update()
            if sink is not None and (step + 1) % config.log_every == 0:
                sink.write(json.dumps(record) + "\n")
                sink.flush()
            if on_step is not None:
                on_step(step + 1, record)
            if config.max_minutes is not None and elapsed > 60 * config.max_minutes:
                break
    finally:
        bar.close()
        if sink is not None:
            sink.close()
    model.eval()
    return records


@dataclass
class _Run:
    """What every optimizer step of one ``finetune`` call reads.

    model:      the model as trained (sharded in place under ``config.shard``).
    next_batch: micro-batch index -> (ids (B, T), weights (B, T) or None), a list of rows each
                when ``ragged``; B is the global micro-batch, of which this rank trains its share.
    device:     where the trainable parameters live, and so the rows go.
    rank, world: this process's rank and the number of ranks (0 and 1 without ``config.shard``).
    """

    model: torch.nn.Module
    config: FinetuneConfig
    next_batch: Callable[[int], tuple[torch.Tensor, torch.Tensor | None]]
    ragged: bool
    device: torch.device
    rank: int
    world: int


def _accumulate(run: _Run, step: int) -> tuple[float, int]:
    """One optimizer step's micro-batches, backward through each: (mean loss, tokens read)."""
    config = run.config
    total, read = 0.0, 0
    for micro in range(config.grad_accum):
        ids, w = run.next_batch(step * config.grad_accum + micro)
        read += sum(len(r) for r in ids) if run.ragged else ids.numel()
        ids, w = _own_share(run, ids, w)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=run.device.type == "cuda"):
            loss = chunked_loss(run.model, ids, weights=w, policy=config.policy, cache_length=config.cache_length,
                                chunk=config.chunk, offload_kv=config.offload_kv, options=config.policy_options)
        (loss / config.grad_accum).backward()
        total += loss.item() / config.grad_accum
    return total, read


def _own_share(run: _Run, ids: torch.Tensor | list[torch.Tensor], w: torch.Tensor | list[torch.Tensor] | None):
    """This rank's rows of a global micro-batch (all of them without sharding) and their weights,
    on the model's device: ids (b, T) and weights (b, T) or None, lists of b rows when ragged."""
    if run.config.shard is not None:
        ids, w = rank_rows(ids, run.rank, run.world), None if w is None else rank_rows(w, run.rank, run.world)
    ids = [r.to(run.device) for r in ids] if run.ragged else ids.to(run.device)
    if w is not None:
        w = [r.to(run.device) for r in w] if run.ragged else w.to(run.device)
    return ids, w


def _optimizer(params: list[torch.nn.Parameter], config: FinetuneConfig) -> torch.optim.Optimizer:
    """AdamW with ``config.weight_decay`` on the matrices and none on vectors (norms, biases)."""
    decay = [p for p in params if p.dim() >= 2]
    other = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": config.weight_decay},
                              {"params": other, "weight_decay": 0.0}],
                             lr=config.lr, betas=(0.9, 0.95), fused=params[0].device.type == "cuda")


def _shuffled_batches(rows, weights, config: FinetuneConfig):
    """The micro-batch source over ``rows`` (and ``weights``): ``config.batch_size`` rows at a time
    in a shuffled order (seeded by ``config.seed``), drawn anew every pass over the data; the
    micro-batch index it is called with does not matter."""
    ragged = isinstance(rows, (list, tuple))
    generator = torch.Generator().manual_seed(config.seed)
    order = torch.randperm(len(rows), generator=generator)
    cursor = 0

    def next_batch(index: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        nonlocal order, cursor
        if cursor + config.batch_size > len(order):
            order, cursor = torch.randperm(len(rows), generator=generator), 0
        pick = order[cursor : cursor + config.batch_size]
        cursor += config.batch_size
        if ragged:
            return [rows[i] for i in pick], None if weights is None else [weights[i] for i in pick]
        return rows[pick], None if weights is None else weights[pick]

    return next_batch


def describe(config: FinetuneConfig) -> dict:
    """The config as a JSON-ready dict (for training.json)."""
    return asdict(config)
