"""How many kept keys a KIVI cache holds per channel (its strong layout) under each policy.

The bundled model reads a random prompt in chunks, then decodes; for each policy the share of
occupied slots whose key is per channel (rather than per token or in the residual), averaged
over the layers, after the prompt and after the decode steps. Prints one JSON object.

A scoring policy's chunk path keeps per channel only the keys that stay in their slots (a key
that moves is re-quantized per token) and the groups sealed again from them and new tokens
(cache/storages/kivi.py, ``storage.in_place``), so the figure says whether the cache places its
survivors in place.

    python benchmarks/kivi_layout.py [--policies h2o:int4,tova:int4,snapkv:int4,h2o:int2]
        [--prompt 2048] [--chunk 256] [--cache-length 1024] [--decode 64]
"""

from __future__ import annotations

import argparse
import json

import torch

import kvcache
from kvcache.kernels import CHANNEL
from kvcache.runtime.threads import set_threads


def channel_share(cache) -> float:
    """Mean over layers of the share of occupied slots whose key is kept per channel."""
    shares = []
    for layer in cache.layers:
        store = layer.storage
        C = store.pos.shape[2] - 1
        occupied = (store.pos[:, :, :C] >= 0).expand(-1, store.k.shape[1], -1)
        channel = (store.k_mode[:, :, :C] == CHANNEL) & occupied
        shares.append(float(channel.sum() / occupied.sum().clamp(min=1)))
    return round(sum(shares) / len(shares), 4)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--policies", default="dense:int4,h2o:int4,tova:int4,snapkv:int4,h2o:int2")
    p.add_argument("--prompt", type=int, default=2048)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--cache-length", type=int, default=1024)
    p.add_argument("--decode", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    set_threads(args.threads)
    model = kvcache.load()
    total = args.prompt + args.decode
    ids = torch.randint(3, model.config.vocab_size, (1, total), generator=torch.Generator().manual_seed(0))
    report = {"prompt": args.prompt, "chunk": args.chunk, "cache_length": args.cache_length,
              "decode_steps": args.decode, "channel_share": {}}
    for name in [n.strip() for n in args.policies.split(",") if n.strip()]:
        scoring = not name.startswith("dense")
        length = args.cache_length if scoring else total
        options = kvcache.cache.budget_options(name, length) if scoring else {}
        cache = kvcache.make_cache(model, name, cache_length=length, options=options)
        with torch.inference_mode():
            for start in range(0, args.prompt, args.chunk):
                model(ids[:, start : start + args.chunk], cache, last_only=True)
            after_prompt = channel_share(cache)
            for t in range(args.prompt, total):
                model(ids[:, t : t + 1], cache, last_only=True)
        report["channel_share"][name] = {"after_prompt": after_prompt, "after_decode": channel_share(cache)}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
