"""Bytes of one layer's cache against its K/V payload: the keys and values alone at fp16
(2 bytes x K and V x K/V heads x head_dim x slots), per storage and policy, at the stored
positions' width and, in the same run, at the int64 positions slots used to hold.

Layers are built on the meta device (nothing is allocated): a policy's layer cache for one row
of ``--slots`` slots, with each policy's options for that budget. ``storage_vs_payload`` counts
the storage's buffers (codes, scales, zero points, KIVI's per-channel scales and residual,
positions); ``cache_vs_payload`` adds what the policy keeps besides (h2o's float32 score per slot
and head). ``int64_positions_vs_payload`` is the storage with 8-byte positions, as before.

Policies: dense (positions below its cache_length: int16 at 4096 and 32768 slots), window
(positions shared by the heads of a row, int32) and h2o (one position per K/V head, int32).

    python benchmarks/kv_bytes.py [--head-dims 64 128] [--kv-heads 2 8] [--slots 4096 32768]

Prints one JSON object: every row, and ``floors`` (int4 <= 0.30, int2 <= 0.20 of the payload
at 4096 slots) for each head_dim and K/V head count.
"""

from __future__ import annotations

import argparse

import torch
from emit import emit

from kvcache.cache.base import CacheSpec
from kvcache.cache.registry import budget_options, layer_cache, policy_class

STORAGES = ["full", "int8", "int4", "int2", "kivi4", "kivi2", "token4", "token2"]
POLICIES = ["dense", "window", "h2o"]
FLOORS = {"int4": 0.30, "int2": 0.20}


def layer(policy: str, storage: str, head_dim: int, kv_heads: int, slots: int):
    spec = CacheSpec(batch_size=1, num_kv_heads=kv_heads, head_dim=head_dim, cache_length=slots,
                     dtype=torch.float16, device=torch.device("meta"), storage=storage)
    cache = layer_cache(policy_class(policy), spec, budget_options(policy, slots))
    cache.grow(slots)  # every slot of a dense layer, which allocates them as it fills
    return cache


def storage_bytes(storage) -> tuple[int, int]:
    """(bytes of the buffers, bytes with the positions at int64)."""
    total = sum(t.numel() * t.element_size() for t in storage.buffers().values())
    return total, total + storage.pos.numel() * (8 - storage.pos.element_size())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--kv-heads", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--slots", type=int, nargs="+", default=[4096, 32768])
    parser.add_argument("--storages", nargs="+", default=STORAGES)
    parser.add_argument("--policies", nargs="+", default=POLICIES)
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()
    rows, floors = [], []
    for head_dim in args.head_dims:
        for kv_heads in args.kv_heads:
            for slots in args.slots:
                payload = 2 * 2 * kv_heads * head_dim * slots
                for policy in args.policies:
                    for storage in args.storages:
                        cache = layer(policy, storage, head_dim, kv_heads, slots)
                        now, before = storage_bytes(cache.storage)
                        row = {"head_dim": head_dim, "kv_heads": kv_heads, "slots": slots, "policy": policy,
                               "storage": storage, "positions": str(cache.storage.pos.dtype).removeprefix("torch."),
                               "payload_bytes": payload, "storage_bytes": now,
                               "storage_vs_payload": round(now / payload, 4),
                               "int64_positions_vs_payload": round(before / payload, 4),
                               "cache_vs_payload": round(cache.nbytes() / payload, 4)}
                        rows.append(row)
                        if slots == 4096 and storage in FLOORS:
                            floors.append({k: row[k] for k in ("head_dim", "kv_heads", "policy", "storage",
                                                               "storage_vs_payload", "int64_positions_vs_payload")}
                                          | {"floor": FLOORS[storage], "met": now / payload <= FLOORS[storage]})
    report = {"torch": torch.__version__, "dtype": "float16", "rows": rows, "floors": floors}
    emit(report, args.out, indent=1)


if __name__ == "__main__":
    main()
