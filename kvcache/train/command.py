"""What ``kvcache finetune`` does once its flags are parsed: load, check, build the rows, train
(full or LoRA), save a Hugging Face checkpoint (or a LoRA adapter) and a loss log.

With ``--shard`` every rank torchrun started runs this: all load and check alike, train their
share of each batch, and rank 0 alone prints and writes (after gathering FSDP2's shards)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from ..cache.registry import make_cache
from ..checkpoint import BUNDLED_MODEL, load, load_tokenizer
from ..threads import for_model as threads_for_model
from .data import token_rows
from .loop import FinetuneConfig, check_rows, describe, finetune
from .lora import DEFAULT_TARGETS, add_lora, is_lora, merge_lora, save_adapter
from .save import read_config, save_checkpoint
from .shard import full_state_dict, init_distributed, leave_distributed
from .step import base_model


def run(args, options: dict) -> Path:
    """Fine-tune as the parsed flags ``args`` say; ``options`` are the policy options given.
    Returns the output directory. Raises ValueError (before any training) on bad settings; under
    ``--shard``, prefixed with the rank that raised it."""
    rank = 0
    if args.shard:
        try:
            rank, _ = init_distributed(args.device, timeout=args.dist_timeout)
        except RuntimeError as e:
            raise ValueError(str(e)) from None
    finished = False
    try:
        out = _run(args, options, rank)
        finished = True
        return out
    except ValueError as e:
        raise ValueError(f"rank {rank}: {e}" if args.shard else str(e)) from None
    finally:
        if args.shard:
            leave_distributed(finished)


def _say(rank: int, message: str) -> None:
    if rank == 0:
        print(message, file=sys.stderr)


def _run(args, options: dict, rank: int) -> Path:
    config = FinetuneConfig(policy=args.policy, cache_length=args.cache_length, chunk=args.chunk,
                            policy_options=options, steps=args.steps, lr=args.lr, warmup=args.warmup,
                            batch_size=args.batch_size, grad_accum=args.grad_accum, seed=args.seed,
                            shard=args.shard, offload_kv=args.offload_kv)
    check_rows(args.seq_len, config)
    if args.lora_rank == 0 and args.merge_lora:
        raise ValueError("--merge-lora needs --lora-rank: without LoRA the whole model is trained and saved")
    source = Path(args.model) if args.model else BUNDLED_MODEL

    def build():
        """The model to train, alike on every rank (the same seed gives the same adapters)."""
        torch.manual_seed(args.seed)
        model = load(source, dtype=torch.float32, device=args.device)
        if not args.lora_rank:
            return model
        targets = tuple(args.lora_targets) if args.lora_targets else DEFAULT_TARGETS
        return add_lora(model, args.lora_rank, alpha=args.lora_alpha, targets=targets)

    model = build()
    threads_for_model(model)
    # Options are checked (names, types, fit in the budget) before the data is read.
    make_cache(base_model(model), config.policy, cache_length=config.cache_length, batch_size=1, **options)
    tokenizer = load_tokenizer(source)
    rows = token_rows(args.data, tokenizer, args.seq_len, field=args.field)
    _say(rank, f"{rows.shape[0]} rows of {args.seq_len} tokens from {', '.join(args.data)}")
    out = Path(args.out)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "loss.jsonl").unlink(missing_ok=True)
    # A progress bar on a terminal; redirected, a plain line every tenth of the run instead of
    # the bar's frames.
    tty = sys.stderr.isatty()
    every = max(1, config.steps // 10)

    def report(step: int, record: dict) -> None:
        if step % every == 0 or step == config.steps:
            _say(rank, f"step {step}/{config.steps}: loss {record['loss']:.4f}, lr {record['lr']:.3g}, "
                       f"{record['tokens_per_s']:.0f} tok/s")

    records = finetune(model, rows, config, log=out / "loss.jsonl", progress=not args.quiet and tty,
                       on_step=report if not args.quiet and not tty else None)
    if args.shard == "fsdp":
        # The weights are sharded over the ranks: gather them (every rank takes part), then rank
        # 0 writes them from an unsharded copy of the same model.
        state = full_state_dict(model)
        if rank == 0:
            model = build()
            model.load_state_dict(state)
    if rank != 0:
        return out
    if is_lora(model) and not args.merge_lora:
        save_adapter(model, out)
        what = "LoRA adapter (peft format; --merge-lora writes a full checkpoint)"
    else:
        save_checkpoint(merge_lora(model), out, read_config(source), source=source)
        what = "checkpoint"
    (out / "training.json").write_text(json.dumps({
        "source": str(source), "data": list(map(str, args.data)), "rows": rows.shape[0], "seq_len": args.seq_len,
        "lora_rank": args.lora_rank, "config": describe(config), "final": records[-1] if records else None,
        "ranks": torch.distributed.get_world_size() if args.shard else 1,
    }, indent=2) + "\n")
    _say(rank, f"wrote the {what} to {out}")
    return out
