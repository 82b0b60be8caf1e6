"""Which of a policy's options decide its RULER score: the same samples with options changed.

Each variant is the policy at one ratio with some of its options overridden (over those its
paper sets at the budget, as ``kvcache eval`` makes the cache); every variant runs the same
RULER samples through kvpress's query-agnostic protocol (the context compressed, then the
question), and its answers are scored as ``kvcache eval`` scores them.

    python benchmarks/option_ablation.py --model ~/.cache/kvcache/models/SmolLM2-135M-Instruct \\
        --policy expected_attention --ratio 0.5 --variants '{}' '{"covariance": false}' \\
        [--tasks niah_single_1,niah_single_2] [--samples 2] [--length 4096] [--threads 1]

Prints one JSON object (every sample's prediction, each variant's score per task and on
average); progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from kvcache import load, load_tokenizer
from kvcache.eval import ruler
from kvcache.eval.cell import answer, make_cell_cache, saturated
from kvcache.eval.metrics import score
from kvcache.eval.sample import encode
from kvcache.runtime.threads import set_threads


@torch.inference_mode()
def run(model, tokenizer, policy: str, ratio: float, options: dict, sample) -> dict:
    enc = encode(tokenizer, sample)
    first = len(enc.context)
    cache = make_cell_cache(model, policy, ratio, first, len(enc) + sample.max_new_tokens, options)
    start = time.perf_counter()
    logits = model(torch.tensor([enc.ids[:first]]), cache, last_only=True)[:, 0]
    new = answer(model, cache, logits, enc.ids[first:], sample.max_new_tokens,
                 finished=lambda tokens: saturated(tokenizer, sample, tokens))
    prediction = tokenizer.decode(new)
    return {"task": sample.task, "index": sample.index, "prediction": prediction,
            "score": score(sample.metric, prediction, sample.answers), "seconds": round(time.perf_counter() - start, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="checkpoint directory or GGUF file")
    ap.add_argument("--policy", required=True)
    ap.add_argument("--ratio", type=float, default=0.5, help="fraction of the context removed")
    ap.add_argument("--variants", nargs="+", type=json.loads, default=[{}],
                    help="JSON objects of options, one a variant ({} = the defaults)")
    ap.add_argument("--tasks", type=lambda s: s.split(","), default=["niah_single_1", "niah_single_2"])
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None, help="also write the JSON here")
    a = ap.parse_args()
    set_threads(a.threads)
    model, tokenizer = load(a.model), load_tokenizer(a.model)
    rows = []
    for task in a.tasks:
        for sample in ruler.samples(task, tokenizer, a.length, a.samples):
            for options in a.variants:
                row = {"options": options, **run(model, tokenizer, a.policy, a.ratio, options, sample)}
                print(json.dumps(row), file=sys.stderr, flush=True)
                rows.append(row)
    summary = []
    for options in a.variants:
        mine = [r for r in rows if r["options"] == options]
        by_task = {t: sum(r["score"] for r in mine if r["task"] == t) / a.samples for t in a.tasks}
        summary.append({"options": options, "by_task": by_task, "average": sum(by_task.values()) / len(by_task)})
    report = {"model": a.model, "policy": a.policy, "ratio": a.ratio, "length": a.length, "samples": a.samples,
              "threads": a.threads, "torch": torch.__version__, "summary": summary, "rows": rows}
    text = json.dumps(report, indent=1)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
