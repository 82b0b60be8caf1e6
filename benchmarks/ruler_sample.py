"""Where the time of one RULER sample goes, and what the sweep's sharing saves.

One sample of a RULER task through each policy, timed part by part: building the sample (the
haystack and the tokenizer's search for its size), encoding it, the first chunk's prefill, the
question and answer prefix, and each decoded token. Then the same policies as a sweep runs them
(``kvcache.eval.cell.run_cells``: one recorded prefill replayed into each policy that attends
the chunk as dense does, answers that stop once they score 100), against each policy on its
own (``run_cell``), with the seconds per sample per policy of both. With ``--answers``, the
answers alone: the sample's cells (each policy at each of ``--ratios``) prefilled, then their
answers decoded one cell at a time (``answer``) and, from the same caches, as the rows of one
batch (``answers``, as ``kvcache eval --batch`` does), every answer to its full length.

    python benchmarks/ruler_sample.py --model ~/.cache/kvcache/models/SmolLM2-135M-Instruct \
        [--task niah_single_1] [--length 4096] [--policies dense,snapkv,knorm,tova] [--ratio 0.5] \
        [--threads 2 1] [--sweep-threads 1] [--parts-only | --sweep-only | --answers --ratios 0.25,0.5,0.75]

``--threads``: the thread counts the parts are timed at, in turn (2 was torch's choice for this
model on 2 cores); ``--sweep-threads``: the one the sweep comparison runs at.

Prints one JSON object; progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from kvcache import load, load_tokenizer
from kvcache.eval import ruler
from kvcache.eval.cell import Bench, Cell, answer, answers, first_chunk, make_cell_cache, prefill, run_cell, run_cells
from kvcache.eval.sample import encode
from kvcache.eval.shared import SharedPrefill
from kvcache.runtime.threads import set_threads


def log(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


def seconds(fn):
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


@torch.inference_mode()
def parts(model, tokenizer, task: str, length: int, policy: str, ratio: float) -> dict:
    """One sample through ``policy`` on its own, each part timed (no early stop)."""
    build, sample = seconds(lambda: ruler.make(task, tokenizer, length))
    enc_s, enc = seconds(lambda: encode(tokenizer, sample))
    first, total = len(enc.context), len(enc) + sample.max_new_tokens
    cache = make_cell_cache(model, policy, ratio, first, total)
    ids = torch.tensor([enc.context])
    prefill, logits = seconds(lambda: model(ids, cache, last_only=True)[:, 0])
    rest = enc.question + enc.prefix
    question, logits = seconds(lambda: model(torch.tensor([rest]), cache, last_only=True)[:, 0])
    decode, new = seconds(lambda: answer(model, cache, logits, [], sample.max_new_tokens))
    return {"policy": policy, "ratio": ratio, "build_s": build, "encode_s": enc_s, "context_tokens": first,
            "prefill_s": prefill, "question_tokens": len(rest), "question_s": question, "generated": len(new),
            "decode_s": decode, "decode_s_per_token": decode / len(new),
            "total_s": build + enc_s + prefill + question + decode}


def sweep(model, tokenizer, task: str, length: int, policies: list[str], ratio: float) -> dict:
    """The policies' cells of one sample, run together and each on its own."""
    cells = [Cell(p, 0.0 if p == "dense" else ratio, task, length, "query_agnostic", 1) for p in policies]
    bench = Bench.make("ruler")
    together_s, together = seconds(lambda: run_cells(model, tokenizer, cells, bench))
    log(f"together: {together_s:.1f} s")
    alone_s, alone = seconds(lambda: [run_cell(model, tokenizer, c, bench) for c in cells])
    log(f"alone: {alone_s:.1f} s")
    same = all(a["score"] == b["score"] for a, b in zip(together, alone))
    return {"policies": policies, "ratio": ratio, "alone_s_per_policy": alone_s / len(cells),
            "together_s_per_policy": together_s / len(cells), "speedup": alone_s / together_s,
            "same_scores": same, "prefill": {c.policy: r["samples"][0]["prefill"] for c, r in zip(cells, together)},
            "generated": {c.policy: r["samples"][0]["generated"] for c, r in zip(cells, together)}}


@torch.inference_mode()
def batched(model, tokenizer, task: str, length: int, policies: list[str], ratios: list[float]) -> dict:
    """The answers of one sample's cells, one cell at a time and as one batch, from the same caches."""
    sample = ruler.make(task, tokenizer, length)
    enc = encode(tokenizer, sample)
    first, total = first_chunk(enc, "query_agnostic"), len(enc) + sample.max_new_tokens
    shared = SharedPrefill()
    cells = [(p, 0.0) if p == "dense" else (p, r) for p in policies for r in ([0.0] if p == "dense" else ratios)]
    filled = [prefill(model, tokenizer, enc, first, total, p, r, shared=shared) for p, r in cells]
    log(f"{len(cells)} caches prefilled")
    snapshots = [f.cache.snapshot() for f in filled]
    rest, never = enc.ids[first:], (lambda tokens: False)
    alone_s, alone = seconds(lambda: [answer(model, f.cache, f.logits, rest, sample.max_new_tokens) for f in filled])
    log(f"one at a time: {alone_s:.1f} s")
    for f, snap in zip(filled, snapshots):
        f.cache.restore(snap)
    logits = torch.cat([f.logits for f in filled])
    together_s, (together, _) = seconds(lambda: answers(model, [f.cache for f in filled], logits, rest,
                                                        sample.max_new_tokens, [never] * len(filled)))
    log(f"one batch: {together_s:.1f} s")
    tokens = sum(len(t) for t in alone)
    return {"cells": [f"{p} {r:g}" for p, r in cells], "question_tokens": len(rest), "generated": tokens,
            "one_at_a_time_s": alone_s, "one_batch_s": together_s, "speedup": alone_s / together_s,
            "one_at_a_time_tok_s": tokens / alone_s, "one_batch_tok_s": tokens / together_s,
            "same_tokens": sum(a == b for a, b in zip(alone, together))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--task", default="niah_single_1")
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--policies", default="dense,snapkv,knorm,tova")
    ap.add_argument("--ratio", type=float, default=0.5)
    ap.add_argument("--threads", type=int, nargs="+", default=[2, 1], help="thread counts of the parts (each in turn)")
    ap.add_argument("--sweep-threads", type=int, default=1, help="thread count of the sweep comparison")
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--parts-only", action="store_true")
    which.add_argument("--sweep-only", action="store_true")
    which.add_argument("--answers", action="store_true", help="the answers alone, one cell at a time and batched")
    ap.add_argument("--ratios", default="0.25,0.5,0.75", help="with --answers: the ratios of every policy but dense")
    args = ap.parse_args()
    tokenizer, model = load_tokenizer(args.model), load(args.model)
    policies = args.policies.split(",")
    report: dict = {"task": args.task, "length": args.length, "torch": torch.__version__}
    if args.answers:
        set_threads(args.sweep_threads)
        report["answers"] = {"threads": args.sweep_threads, **batched(
            model, tokenizer, args.task, args.length, policies, [float(r) for r in args.ratios.split(",")])}
        print(json.dumps(report, indent=1))
        return
    if not args.sweep_only:
        report["parts"] = []
        for threads in args.threads:
            set_threads(threads)
            found = {"threads": threads, **parts(model, tokenizer, args.task, args.length, policies[-1], args.ratio)}
            log(json.dumps(found))
            report["parts"].append(found)
    if not args.parts_only:
        set_threads(args.sweep_threads)
        report["sweep"] = {"threads": args.sweep_threads,
                           **sweep(model, tokenizer, args.task, args.length, policies, args.ratio)}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
