"""Soak: a long stream through bounded caches, and a prefix store bounded small under steady use.

1. ``--tokens`` tokens (default 1,000,000) streamed through each of ``--policies`` (default sink,
   h2o and sink:int4, a quantized storage) at ``--cache-length`` slots: chunks of ``--chunk``
   tokens, each followed by ``--decode`` one-token steps, all through one cache. The process's
   resident memory (RSS, after returning freed heap to the system) is sampled every 2% of the
   stream; the figure is the largest sample after warm-up (the first 10%) relative to the first
   sample after it. Every logit of every call is checked to be finite.
2. ``--requests`` generate calls with a prefix store of ``--store-bytes`` bytes (far below what
   the prompts need, so every call evicts): prompts are a shared preamble plus one of a few
   topics plus a random question, so some prefixes are reused and most are new. The store's
   bytes are checked after every call against its bound.

The model is a random Llama (fixed seed): hidden 64, 2 layers, 4 query and 2 K/V heads, vocabulary
256, fp32 on CPU, one thread. Output: JSON on stdout, progress on stderr.

    python benchmarks/soak.py [--tokens 1000000] [--policies sink,h2o,sink:int4] [--requests 300]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import platform
import sys
import time

import torch

import kvcache
from kvcache.model.config import ModelConfig
from kvcache.model.transformer import Transformer
from kvcache.runtime.threads import set_threads

VOCAB = 256


def log(*parts) -> None:
    print(*parts, file=sys.stderr, flush=True)


def rss() -> int:
    """Resident set size of this process now, in bytes, after returning freed heap to the OS."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def tiny_model(max_positions: int) -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, max_position_embeddings=max_positions)
    return Transformer(cfg).eval()


@torch.inference_mode()
def stream(model, policy: str, tokens: int, cache_length: int, chunk: int, decode: int) -> dict:
    cache = kvcache.make_cache(model, policy, cache_length=cache_length)
    gen = torch.Generator().manual_seed(1)
    fed, calls, finite = 0, 0, True
    samples: list[tuple[int, int]] = []
    every = max(1, tokens // 50)
    next_sample = 0
    start = time.perf_counter()
    while fed < tokens:
        n = min(chunk, tokens - fed)
        finite &= bool(torch.isfinite(model(torch.randint(3, VOCAB, (1, n), generator=gen), cache)).all())
        fed += n
        calls += 1
        for _ in range(min(decode, tokens - fed)):
            finite &= bool(torch.isfinite(model(torch.randint(3, VOCAB, (1, 1), generator=gen), cache)).all())
            fed += 1
            calls += 1
        if fed >= next_sample:
            samples.append((fed, rss()))
            next_sample += every
            if len(samples) % 10 == 0:
                log(f"{policy}: {fed} tokens, rss {samples[-1][1] / 2**20:.1f} MiB")
    seconds = time.perf_counter() - start
    after = [r for t, r in samples if t >= tokens // 10]
    base = after[0]
    return {
        "policy": policy, "tokens": fed, "calls": calls, "seconds": round(seconds, 1),
        "tokens_per_s": round(fed / seconds), "cache_nbytes": cache.nbytes(), "all_logits_finite": finite,
        "rss_mib_after_warmup": round(base / 2**20, 2), "rss_mib_max_after_warmup": round(max(after) / 2**20, 2),
        "rss_mib_end": round(after[-1] / 2**20, 2),
        "rss_growth_after_warmup_pct": round(100 * (max(after) - base) / base, 3),
        "rss_samples": len(samples), "lengths": cache.lengths.tolist(),
    }


def store_soak(model, requests: int, store_bytes: int, policy: str) -> dict:
    store = kvcache.PrefixStore(model, max_bytes=store_bytes)
    gen = torch.Generator().manual_seed(2)
    preamble = torch.randint(3, VOCAB, (64,), generator=gen).tolist()
    topics = [torch.randint(3, VOCAB, (48,), generator=gen).tolist() for _ in range(8)]
    peak, entries, reused = 0, [], 0
    start = time.perf_counter()
    for _i in range(requests):
        topic = topics[int(torch.randint(0, len(topics), (1,), generator=gen))]
        prompt = preamble + topic + torch.randint(3, VOCAB, (int(torch.randint(8, 40, (1,), generator=gen)),),
                                                  generator=gen).tolist()
        reused += store.reusable(prompt) if store.binding is not None else 0
        kvcache.generate(model, prompt, max_new_tokens=16, policy=policy, cache_length=256, prefill_chunk=32,
                         prefix_store=store)
        assert store.nbytes <= store.max_bytes, (store.nbytes, store.max_bytes)
        peak = max(peak, store.nbytes)
        entries.append(len(store))
    return {"policy": policy, "requests": requests, "max_bytes": store_bytes, "peak_store_bytes": peak,
            "never_above_bound": peak <= store_bytes, "entries_min": min(entries), "entries_max": max(entries),
            "tokens_reused": reused, "seconds": round(time.perf_counter() - start, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1_000_000)
    parser.add_argument("--policies", default="sink,h2o,sink:int4")
    parser.add_argument("--cache-length", type=int, default=256)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--decode", type=int, default=8)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--store-bytes", type=int, default=200_000)
    parser.add_argument("--store-policy", default="dense")
    args = parser.parse_args()
    set_threads(1)
    model = tiny_model(max_positions=args.tokens + 1)
    out = {"machine": platform.machine(), "torch": torch.__version__, "threads": 1,
           "model": "random Llama, hidden 64, 2 layers, 4/2 heads, vocab 256, fp32", "streams": [], "store": None}
    for policy in args.policies.split(","):
        out["streams"].append(stream(model, policy, args.tokens, args.cache_length, args.chunk, args.decode))
        log(json.dumps(out["streams"][-1]))
    if args.requests:
        out["store"] = store_soak(model, args.requests, args.store_bytes, args.store_policy)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
