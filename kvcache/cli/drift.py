"""``kvcache drift``: how far cached, chunked, batched and reused-prefix logits drift from their
references (docs/exactness.md)."""

from __future__ import annotations

import argparse
import json

from .args import (
    THREADS_HELP,
    apply_threads,
    comma_list,
    device_arg,
    int_at_least,
)


def add_parser(commands) -> None:
    from ..eval.drift import DTYPES, Setup

    setup = Setup()
    dr = commands.add_parser(
        "drift", help="how far cached, chunked, batched and reused-prefix logits drift from their references",
        description="For one model, per dtype: the largest logit difference and the top-1 agreement between "
                    "cached and uncached, chunked and one-pass, batched-with-padding and alone, and reused-prefix "
                    "and fresh runs (default and aligned), for kvcache and, when installed, transformers on the "
                    "same weights. See docs/exactness.md.",
    )
    dr.add_argument("--model", metavar="PATH", help="Hugging Face-format checkpoint directory or GGUF file (default: bundled)")
    dr.add_argument("--dtype", type=comma_list(str), default=list(DTYPES), metavar="A,B",
                    help=f"comma-separated, from {', '.join(DTYPES)} (default: all)")
    dr.add_argument("--device", type=device_arg, default="cpu", help="e.g. cpu, cuda (default: cpu)")
    dr.add_argument("--tokens", type=int_at_least(8), default=setup.tokens, metavar="N",
                    help=f"prompt length (default: {setup.tokens})")
    dr.add_argument("--chunk", type=int_at_least(1), default=setup.chunk, metavar="N",
                    help=f"chunk size, and the grid of aligned reuse (default: {setup.chunk})")
    dr.add_argument("--prefix", type=int_at_least(1), default=setup.prefix, metavar="N",
                    help=f"reused prefix, in tokens (default: {setup.prefix})")
    dr.add_argument("--no-transformers", action="store_true", help="kvcache's figures only")
    dr.add_argument("--json", action="store_true", help="print the report as JSON")
    dr.add_argument("--threads", type=int_at_least(1), metavar="N", help=THREADS_HELP)


def run(args: argparse.Namespace) -> None:
    from ..eval.drift import DTYPES, Setup, report, table

    apply_threads(args.threads)
    unknown = [d for d in args.dtype if d not in DTYPES]
    if unknown or not args.dtype:
        raise ValueError(f"--dtype takes a comma-separated list from {', '.join(DTYPES)}, got {','.join(args.dtype)}")
    if not args.prefix < args.tokens:
        raise ValueError(f"--prefix ({args.prefix}) must be shorter than --tokens ({args.tokens})")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass
    data = report(args.model, args.dtype, args.device, Setup(args.tokens, args.chunk, args.prefix),
                  with_transformers=not args.no_transformers)
    print(json.dumps(data, indent=2) if args.json else table(data), end="\n" if args.json else "")
