"""Extend the bundled reference model's context from 2k to 8k tokens by fine-tuning it through a
bounded KV cache: the recipe behind docs/finetune.md.

    python training/finetune_long.py --out data/finetune_long

Steps: (1) the bundled weights with RoPE's base raised (``--rope-theta``; no training), (2)
evaluation of the bundled model and of that base, (3) fine-tuning on ``--seq-len``-token rows of
text, passkey/lookup tasks and repeats, each row fed ``--chunk`` tokens at a time through a
``--policy`` cache of ``--cache-length`` slots (``kvcache.train.finetune``, exact gradients through
the cache), (4) evaluation of the result with a dense cache, as the model card measures it:
held-out perplexity over 2048-token windows and teacher-forced passkey accuracy at several lengths.
Writes base/ and model/ (Hugging Face checkpoints), loss.jsonl, results.json and loss.png to --out.
Needs the training corpus (training/corpus.py) for filler text.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import kvcache
from kvcache.cache.registry import budget_options
from kvcache.checkpoints.load import BUNDLED_MODEL
from kvcache.eval.tasks import TaskMaker, read_texts
from kvcache.train.loop import FinetuneConfig, describe, finetune
from kvcache.train.save import read_config, save_checkpoint


def held_out_ppl(model, texts: torch.Tensor, length: int = 2048, n: int = 16) -> float:
    """Perplexity over ``n`` evenly spaced ``length``-token windows of the held-out texts (the
    model card's measure, as training/train.py computes it)."""
    starts = torch.linspace(0, len(texts) - length - 2, n).long()
    windows = torch.stack([texts[s : s + length + 1] for s in starts])
    total = 0.0
    with torch.no_grad():
        for i in range(0, n, 4):
            logits = model(windows[i : i + 4, :-1])
            total += F.cross_entropy(logits.flatten(0, 1).float(), windows[i : i + 4, 1:].flatten(), reduction="sum").item()
    return math.exp(total / (n * length))


def passkey_accuracy(model, filler: torch.Tensor, tokenizer, length: int, n: int) -> float:
    """Dense, teacher-forced: a key counts when every answer token is the argmax. Depths spread
    evenly over 0-100%; the prompts are those of training/train.py's evaluation (seed 1234)."""
    tasks = TaskMaker(filler, tokenizer, seed=1234)
    hits = 0
    for i in range(n):
        prompt, answer = tasks.passkey(length, depth=i / max(1, n - 1))
        seq = torch.tensor([prompt + answer])
        with torch.no_grad():
            pred = model(seq[:, :-1]).argmax(-1)
        a, b = len(prompt), len(prompt) + len(answer)
        hits += bool((pred[0, a - 1 : b - 1] == seq[0, a:b]).all())
    return hits / n


def evaluate(model, texts, filler, tokenizer, lengths: list[int], prompts: int) -> dict:
    start = time.time()
    result = {"heldout_ppl_2048": round(held_out_ppl(model, texts), 2)}
    for length in lengths:
        result[f"passkey_{length}"] = round(passkey_accuracy(model, filler, tokenizer, length, prompts), 4)
    result["seconds"] = round(time.time() - start, 1)
    print(result, file=sys.stderr, flush=True)
    return result


def make_base(source: Path, out: Path, theta: float, max_positions: int) -> Path:
    """The source weights with RoPE's base set to ``theta`` (no training)."""
    config = read_config(source)
    config["rope_theta"] = theta
    config["max_position_embeddings"] = max(max_positions, config.get("max_position_embeddings", 0))
    model = kvcache.load(source)
    return save_checkpoint(model, out, config, source=source)


def plot(records: list[dict], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    k = 10
    steps = [r["step"] for r in records]
    loss = [r["loss"] for r in records]
    smooth = [sum(loss[max(0, i - k + 1) : i + 1]) / len(loss[max(0, i - k + 1) : i + 1]) for i in range(len(loss))]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, loss, alpha=0.3, label="per step")
    ax.plot(steps, smooth, label=f"mean of {k} steps")
    ax.set(xlabel="step (one row)", ylabel="cross-entropy (nats/token, answers weighted)",
           title="fine-tuning loss through the bounded cache")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", default="data/corpus")
    parser.add_argument("--source", default=str(BUNDLED_MODEL), help="checkpoint to start from")
    parser.add_argument("--out", default="data/finetune_long")
    parser.add_argument("--rope-theta", type=float, default=60000.0, help="RoPE base of the extended model")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--policy", default="h2o")
    parser.add_argument("--cache-length", type=int, default=1024)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--steps", type=int, default=400, help="optimizer steps, one row each")
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--retrieval-share", type=float, default=0.3, help="passkey and lookup rows")
    parser.add_argument("--repeat-share", type=float, default=0.1, help="rows that repeat a span")
    parser.add_argument("--answer-weight", type=float, default=2.0, help="loss weight of task answers and copies")
    parser.add_argument("--minutes", type=float, default=None, help="wall-clock cap on the fine-tuning")
    parser.add_argument("--eval-lengths", default="2048,4096,8192")
    parser.add_argument("--eval-prompts", type=int, default=24)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    source = Path(args.source)
    tokenizer = kvcache.load_tokenizer(source)
    texts = read_texts(Path(args.corpus) / "test", tokenizer)
    filler = read_texts(Path(args.corpus) / "train", tokenizer)
    lengths = [int(x) for x in args.eval_lengths.split(",")]
    results = {"args": vars(args)}

    bundled = kvcache.load(source, dtype=torch.float32)
    results["source"] = evaluate(bundled, texts, filler, tokenizer, lengths, args.eval_prompts)
    base_dir = make_base(source, out / "base", args.rope_theta, args.seq_len)
    model = kvcache.load(base_dir, dtype=torch.float32)
    results["base"] = evaluate(model, texts, filler, tokenizer, lengths, args.eval_prompts)

    tasks = TaskMaker(filler, tokenizer, seed=args.seed)

    def batches(index: int):
        ids, weights = tasks.batch(1, args.seq_len - 1, args.retrieval_share, args.repeat_share)
        return ids, torch.where(weights > 1, args.answer_weight, weights)

    # The policy's own settings at this budget (h2o: half the slots for the most recent tokens).
    options = budget_options(args.policy, args.cache_length)
    config = FinetuneConfig(policy=args.policy, cache_length=args.cache_length, chunk=args.chunk,
                            policy_options=options, steps=args.steps,
                            lr=args.lr, warmup=args.warmup, seed=args.seed, max_minutes=args.minutes)
    (out / "loss.jsonl").unlink(missing_ok=True)
    records = finetune(model, torch.empty(0, args.seq_len, dtype=torch.long), config, batches=batches,
                       log=out / "loss.jsonl")
    save_checkpoint(model, out / "model", read_config(base_dir), source=base_dir, dtype=torch.float16)
    tuned = kvcache.load(out / "model", dtype=torch.float32)
    results["finetuned"] = evaluate(tuned, texts, filler, tokenizer, lengths, args.eval_prompts)
    results["training"] = {"config": describe(config), "steps": len(records),
                           "seconds": records[-1]["seconds"] if records else 0,
                           "tokens": records[-1]["tokens"] if records else 0}
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    plot(records, out / "loss.png")


if __name__ == "__main__":
    main()
