#!/usr/bin/env python3
"""Train the reference model's byte-level BPE tokenizer on the training split of the corpus.

Reads CORPUS/train/*.txt (from ``training/corpus.py``) and writes OUT/tokenizer.json,
OUT/tokenizer_config.json and OUT/stats.json. The special tokens come first (ids 0, 1, 2):
``<|bos|>``, ``<|eos|>``, ``<|pad|>``. Encoding with special tokens prepends ``<|bos|>`` (as Llama's
tokenizer does); ``<|eos|>`` is for the training code to append at the end of each document.
Compression (UTF-8 bytes per token) is measured on CORPUS/test, which training never sees.

    python training/tokenizer.py --corpus data/corpus --out data/tokenizer [--vocab-size 8192]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>"]
BOS, EOS, PAD = SPECIAL_TOKENS


def build(files: list[Path], vocab_size: int, min_frequency: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train([str(f) for f in files], trainer)
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(
            single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B:1", special_tokens=[(BOS, bos_id)]
        ),
    ])
    return tokenizer


def bytes_per_token(tokenizer, files: list[Path]) -> tuple[float, int, int]:
    n_bytes = n_tokens = 0
    for f in files:
        text = f.read_text(encoding="utf-8")
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        if tokenizer.decode(ids, skip_special_tokens=False) != text:
            raise SystemExit(f"{f}: decode(encode(text)) != text")
        n_bytes += len(text.encode("utf-8"))
        n_tokens += len(ids)
    return (n_bytes / n_tokens if n_tokens else float("nan")), n_bytes, n_tokens


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", type=Path, default=Path("data/corpus"), help="output of corpus.py")
    parser.add_argument("--out", type=Path, default=Path("data/tokenizer"))
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--min-frequency", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2, help="worker threads for the tokenizers library")
    args = parser.parse_args(argv)

    # Must be set before the tokenizers library starts its thread pool.
    os.environ["RAYON_NUM_THREADS"] = os.environ["RAYON_RS_NUM_CPUS"] = str(args.threads)

    train = sorted((args.corpus / "train").glob("*.txt"))
    test = sorted((args.corpus / "test").glob("*.txt"))
    if not train:
        raise SystemExit(f"no training files in {args.corpus / 'train'}: run training/corpus.py first")

    start = time.perf_counter()
    tokenizer = build(train, args.vocab_size, args.min_frequency)
    took = time.perf_counter() - start

    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(args.out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
    }
    (args.out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")

    stats = {"vocab_size": tokenizer.get_vocab_size(), "train_seconds": round(took, 1),
             "special_tokens": {t: tokenizer.token_to_id(t) for t in SPECIAL_TOKENS}}
    for name, files in (("train", train), ("test", test)):
        if files:
            bpt, n_bytes, n_tokens = bytes_per_token(tokenizer, files)
            stats[name] = {"documents": len(files), "bytes": n_bytes, "tokens": n_tokens,
                           "bytes_per_token": round(bpt, 3)}
    (args.out / "stats.json").write_text(json.dumps(stats, indent=2) + "\n")

    print(f"trained in {took:.1f}s on {len(train)} files: vocab {stats['vocab_size']}, "
          f"special tokens {stats['special_tokens']}")
    for name in ("train", "test"):
        if name in stats:
            s = stats[name]
            print(f"{name}: {s['documents']} documents, {s['bytes'] / 1e6:.2f} MB, {s['tokens']} tokens, "
                  f"{s['bytes_per_token']:.3f} bytes/token")
    print(f"wrote {args.out / 'tokenizer.json'} and {args.out / 'tokenizer_config.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
