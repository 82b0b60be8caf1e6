"""Prompt reuse: time to first token with and without a prefix store, and the store's bytes.

Two workloads, each for a dense cache and for bounded caches of 2048 slots (h2o, whose snapshots
are reused at multiples of the prefill chunk only, and sink, reused at any stored boundary):

* shared prefix: an 8192-token document, then 16 different 256-token questions about it, one
  request at a time (batch 1). With the store the first request computes everything (cold) and
  every later one restores the document and prefills its question; without it every request
  prefills all 8448 tokens.
* chat replay: a 10-turn conversation about a document: a system message holding a passage of
  about 2000 tokens of held-out text, then user messages of about 100 tokens, each answered
  with 48 greedy tokens. Every turn's prompt is the whole conversation so far, tokenized as one
  text (an answer re-tokenized next to its neighbours may differ from the tokens generated: only
  exact token prefixes are reused). The first turn has nothing to reuse; medians are over turns
  2 to 10. Prefill chunks of 128 tokens (``--chat-chunk``): a turn adds about 150 tokens, and a
  scoring policy reuses a conversation up to the last multiple of the chunk only.

The model is a random Llama (fixed seed) of 15.7M parameters: hidden 384, 6 layers, 6 query and
2 K/V heads, vocabulary 8192 (the bundled tokenizer's), fp32 on CPU. It is sized so that the run
takes a few minutes on 2 cores: a full 8448-token prefill takes 5 to 12 s on one thread.

Timing: one thread (``set_threads(1)``: the machine is shared, and one thread is the
steadiest); runs with and without the store are interleaved, alternating which goes first, and
medians are reported, as is the median over questions of the ratio of the two runs of one question
(each pair runs back to back, so a change of the machine's load during the run cancels out).
TTFT is from the ``generate`` call to the first token's callback. The requests without the store
are the same whatever the question, so the shared-prefix baseline is
measured on every ``--baseline-every``-th question only. Output: JSON on stdout, progress on stderr.

    python benchmarks/prefix.py [--policies dense,h2o,sink] [--questions 16] [--turns 10]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time

import torch

import kvcache
from kvcache.eval.tasks import DEFAULT_TEXTS
from kvcache.runtime.threads import set_threads

PREFIX_TOKENS = 8192
QUESTION_TOKENS = 256
# Prompt tokens per forward pass, and the grid of the scoring policies' snapshots (--prefill-chunk).
CHUNK = 512
ANSWER_TOKENS = 48
USER_TOKENS = 100
DOCUMENT_TOKENS = 2000
# Bounded policies keep 2048 slots (a quarter of the document) with their papers' settings.
BUDGET = 2048


def log(*parts) -> None:
    print(*parts, file=sys.stderr, flush=True)


def build_model() -> kvcache.Transformer:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=384, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=6,
                      num_key_value_heads=2, vocab_size=8192, max_position_embeddings=16384)
    with tempfile.TemporaryDirectory() as d:
        LlamaForCausalLM(cfg).save_pretrained(d)
        return kvcache.load(d)


def timed(model, prompt: list[int], max_new: int, store, policy: str, chunk: int = CHUNK) -> tuple[float, list[int]]:
    """(seconds to the first token, the new tokens) of one greedy request; a bounded policy keeps
    BUDGET slots with its paper's settings."""
    bounded = policy != "dense"
    first: list[float] = []
    start = time.perf_counter()
    tokens = kvcache.generate(model, prompt, max_new_tokens=max_new, prefill_chunk=chunk, prefix_store=store,
                              stop_tokens=(), on_token=lambda row, token: first.append(time.perf_counter()),
                              policy=policy, cache_length=BUDGET if bounded else None,
                              policy_options=kvcache.cache.budget_options(policy, BUDGET) or None if bounded else None)
    return first[0] - start, tokens


def shared_prefix(model, policy: str, questions: int, baseline_every: int) -> dict:
    g = torch.Generator().manual_seed(1)
    document = torch.randint(3, 8192, (PREFIX_TOKENS,), generator=g).tolist()
    prompts = [document + torch.randint(3, 8192, (QUESTION_TOKENS,), generator=g).tolist() for _ in range(questions)]
    store = kvcache.PrefixStore(model, max_bytes=4 << 30)
    cold, _ = timed(model, prompts[0], 4, store, policy)
    log(f"  {policy} shared prefix: cold {cold:.2f} s, store {store.nbytes / 2**20:.1f} MiB")
    with_store, without, paired, reused, same = [], [], [], [], True
    for i, prompt in enumerate(prompts[1:], start=1):
        runs = [store] + ([None] if (i - 1) % baseline_every == 0 else [])
        reused.append(store.reusable(prompt))
        tokens, ttfts = [], {}
        for s in runs if i % 2 else runs[::-1]:
            ttft, new = timed(model, prompt, 4, s, policy)
            ttfts["store" if s is not None else "none"] = ttft
            tokens.append(new)
            log(f"  {policy} question {i}: {'store' if s is not None else 'none'} {ttft:.3f} s")
        with_store.append(ttfts["store"])
        if "none" in ttfts:
            without.append(ttfts["none"])
            paired.append(ttfts["none"] / ttfts["store"])
        same &= all(t == tokens[0] for t in tokens)
    return {
        "prompt_tokens": len(prompts[0]), "questions": questions, "cold_ttft_s": cold,
        "ttft_store_s": with_store, "ttft_no_store_s": without,
        "median_ttft_store_s": statistics.median(with_store), "median_ttft_no_store_s": statistics.median(without),
        "speedup": statistics.median(without) / statistics.median(with_store),
        # Each baseline over the request with the store right before or after it: robust to the
        # load of the shared machine drifting during the run.
        "paired_speedups": paired, "median_paired_speedup": statistics.median(paired),
        "reused_tokens": reused, "store_bytes": store.nbytes, "store_entries": len(store),
        "same_tokens": same,
    }


def passages(counts: list[int]) -> list[str]:
    """Consecutive passages of held-out text of about ``counts[i]`` tokens each, cut at spaces."""
    text = (DEFAULT_TEXTS / "austen__emma.txt").read_text()
    start, out = len(text) // 3, []
    for n in counts:
        end = text.index(" ", start + 4 * n)  # about 4 characters a token
        out.append(" ".join(text[start:end].split()))
        start = end + 1
    return out


def chat(model, tokenizer, policy: str, turns: int, chunk: int) -> dict:
    document, *messages = passages([DOCUMENT_TOKENS] + [USER_TOKENS] * turns)
    system = f"System: You are a careful reader. Answer questions about this text.\n\n{document}\n\n"
    store = kvcache.PrefixStore(model, max_bytes=4 << 30)
    texts = {"store": system, "none": system}
    rows = []
    for turn, message in enumerate(messages):
        row = {"turn": turn + 1}
        order = ("store", "none") if turn % 2 else ("none", "store")
        for name in order:
            texts[name] += f"User: {message}\n\nAssistant:"
            prompt = tokenizer.encode(texts[name])
            s = store if name == "store" else None
            if s is not None:
                row["reused_tokens"] = s.reusable(prompt)
            ttft, tokens = timed(model, prompt, ANSWER_TOKENS, s, policy, chunk)
            texts[name] += tokenizer.decode(tokens) + "\n\n"
            row[f"ttft_{name}_s"] = ttft
            row["prompt_tokens"] = len(prompt)
            row.setdefault("answers", []).append(tokens)
        row["same_answer"] = row["answers"][0] == row["answers"][1]
        del row["answers"]
        log(f"  {policy} chat turn {turn + 1}: {row['prompt_tokens']} tokens, reused {row['reused_tokens']}, "
            f"store {row['ttft_store_s']:.3f} s, none {row['ttft_none_s']:.3f} s")
        rows.append(row)
    later = rows[1:]  # the first turn has nothing to reuse
    return {
        "turns": rows,
        "median_ttft_store_s": statistics.median(r["ttft_store_s"] for r in later),
        "median_ttft_no_store_s": statistics.median(r["ttft_none_s"] for r in later),
        "speedup": statistics.median(r["ttft_none_s"] / r["ttft_store_s"] for r in later),
        "store_bytes": store.nbytes, "store_entries": len(store),
        "same_answers": all(r["same_answer"] for r in rows),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policies", default="dense,h2o,sink", help="comma-separated (default: dense,h2o,sink)")
    parser.add_argument("--questions", type=int, default=16)
    parser.add_argument("--baseline-every", type=int, default=4,
                        help="time the request without the store on every N-th question (default: 4)")
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--chat-chunk", type=int, default=128,
                        help="prefill_chunk of the chat replay, the grid of a scoring policy's reuse (default: 128)")
    parser.add_argument("--skip-shared", action="store_true", help="the chat replay only")
    args = parser.parse_args(argv)
    set_threads(1)
    model = build_model()
    tokenizer = kvcache.load_tokenizer()
    policies = [p for p in args.policies.split(",") if p]
    result = {
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                    "torch": torch.__version__},
        "model": {"parameters": sum(p.numel() for p in model.parameters()), "hidden": 384, "layers": 6,
                  "heads": 6, "kv_heads": 2, "vocab": 8192, "dtype": "float32", "device": "cpu"},
        "prefill_chunk": CHUNK, "chat_prefill_chunk": args.chat_chunk, "bounded_cache_length": BUDGET,
        "shared_prefix": {}, "chat": {},
    }
    started = time.perf_counter()
    for policy in policies:
        if not args.skip_shared:
            log(f"{policy}: shared prefix")
            result["shared_prefix"][policy] = shared_prefix(model, policy, args.questions, args.baseline_every)
        log(f"{policy}: chat replay")
        result["chat"][policy] = chat(model, tokenizer, policy, args.turns, args.chat_chunk)
    result["wall_s"] = time.perf_counter() - started
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
