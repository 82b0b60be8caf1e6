"""``kvcache finetune``: its flags, and what it does once they are parsed: load, check, build the rows, train
(full or LoRA), save a Hugging Face checkpoint (or a LoRA adapter) and a loss log.

With ``--shard`` every rank torchrun started runs this: all load and check alike, train their
share of each batch, and rank 0 alone prints and writes (after gathering FSDP2's shards)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from ..cache.registry import make_cache
from ..checkpoints.load import BUNDLED_MODEL, load, load_tokenizer
from ..runtime.threads import for_model as threads_for_model
from ..train.data import token_rows
from ..train.loop import FinetuneConfig, check_rows, describe, finetune
from ..train.lora import DEFAULT_TARGETS, add_lora, is_lora, merge_lora, save_adapter
from ..train.save import read_config, save_checkpoint
from ..train.shard import full_state_dict, init_distributed, leave_distributed
from ..train.step import base_model
from .args import (
    THREADS_HELP,
    add_policy_options,
    apply_threads,
    comma_list,
    device_arg,
    int_at_least,
    number,
)


def add_parser(commands) -> None:
    ft = commands.add_parser(
        "finetune", help="fine-tune on long rows, chunk by chunk through a bounded KV cache",
        description="Fine-tune a model (fully, or LoRA adapters through peft) on rows of --seq-len tokens, each "
                    "fed --chunk tokens at a time through a --policy cache of --cache-length slots, with exact "
                    "gradients through what the cache keeps (kvcache.chunked_loss). Writes a Hugging Face "
                    "checkpoint (or, for LoRA without --merge-lora, a peft adapter), loss.jsonl and training.json.",
    )
    ft.add_argument("--data", nargs="+", required=True, metavar="FILE",
                    help="text files (each a document) or .jsonl files (one document per line, in --field)")
    ft.add_argument("--field", default="text", help="the text field of JSONL records (default: text)")
    ft.add_argument("--seq-len", type=int_at_least(2), default=8192, metavar="N", help="tokens per row (default: 8192)")
    ft.add_argument("--out", required=True, metavar="DIR", help="where the checkpoint and logs go")
    ft.add_argument("--model", metavar="PATH", help="checkpoint directory or GGUF file to start from (default: bundled)")
    ft.add_argument("--device", type=device_arg, default="cpu", help="e.g. cpu, cuda (default: cpu; bf16 autocast on CUDA)")
    ft.add_argument("--threads", type=int_at_least(1), metavar="N", help=THREADS_HELP)
    ft.add_argument("--quiet", action="store_true",
                    help="no progress (a bar on a terminal; redirected, a line every tenth of the steps)")
    cache = ft.add_argument_group("cache")
    cache.add_argument("--policy", default="h2o", help="cache policy[:storage] (default: h2o)")
    cache.add_argument("--cache-length", type=int_at_least(1), default=1024, metavar="N",
                       help="cache slots per layer (default: 1024)")
    cache.add_argument("--chunk", type=int_at_least(1), default=512, metavar="N",
                       help="tokens per model call, at most --cache-length (default: 512)")
    training = ft.add_argument_group("training")
    training.add_argument("--steps", type=int_at_least(1), default=100, metavar="N", help="optimizer steps (default: 100)")
    training.add_argument("--lr", type=number, default=2e-4, metavar="LR", help="peak learning rate (default: 2e-4)")
    training.add_argument("--warmup", type=int_at_least(0), metavar="N",
                          help="warm-up steps, at most --steps (default: 10, or a tenth of --steps if fewer)")
    training.add_argument("--batch-size", type=int_at_least(1), default=1, metavar="N", help="rows per micro-batch (default: 1)")
    training.add_argument("--grad-accum", type=int_at_least(1), default=1, metavar="N",
                          help="micro-batches per optimizer step (default: 1)")
    training.add_argument("--seed", type=int, default=0, metavar="S", help="seed for the row order (default: 0)")
    training.add_argument("--lora-rank", type=int_at_least(0), default=0, metavar="R",
                          help="train rank-R LoRA adapters instead of every weight (needs peft; default: 0, full)")
    training.add_argument("--lora-alpha", type=number, metavar="A", help="LoRA scale numerator (default: the rank)")
    training.add_argument("--lora-targets", type=comma_list(str), metavar="A,B",
                          help="module names that get adapters (default: q_proj,k_proj,v_proj,o_proj)")
    training.add_argument("--merge-lora", action="store_true",
                          help="merge the adapters into the weights and write a full checkpoint")
    training.add_argument("--offload-kv", action="store_true",
                          help="keep the recorded keys and values, the memory that grows with --seq-len, in CPU memory")
    parallel = ft.add_argument_group("data parallelism (launch with torchrun --nproc-per-node N -m kvcache finetune ...)")
    parallel.add_argument("--shard", choices=("ddp", "fsdp"),
                          help="split each --batch-size rows over the ranks: ddp (every rank holds the model) or "
                               "fsdp (FSDP2: each rank holds 1/N of the weights, gradients and optimizer state)")
    parallel.add_argument("--dist-timeout", type=number, default=600.0, metavar="S",
                          help="seconds a rank waits for the others in any collective before failing (default: 600)")
    add_policy_options(ft)


def run(args: argparse.Namespace) -> None:
    apply_threads(args.threads)
    options = {k.removeprefix("opt_"): v for k, v in vars(args).items() if k.startswith("opt_") and v is not None}
    finetune_from_args(args, options)


def finetune_from_args(args, options: dict) -> Path:
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
        out = _finetune(args, options, rank)
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


def _finetune(args, options: dict, rank: int) -> Path:
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
    make_cache(base_model(model), config.policy, cache_length=config.cache_length, batch_size=1, options=options)
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
