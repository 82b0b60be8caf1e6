"""knorm keeps the keys with the smallest L2 norm: checked against the norms of the keys a dense
cache holds for the same tokens."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE, atol
from policy_util import ids_for, kept

import kvcache

VOCAB = 128


def distinct_ids(T: int, batch: int = 1, seed: int = 0) -> torch.Tensor:
    """(batch, T) ids without repeats in a row: a repeated token has a key of the same norm, and
    which of two equal norms goes first is a tie-break, not what these tests check."""
    g = torch.Generator().manual_seed(seed)
    return torch.stack([3 + torch.randperm(VOCAB - 3, generator=g).to(DEVICE)[:T] for _ in range(batch)])


def dense_key_norms(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """(B, Hkv, T) key norms per layer, from a dense cache fed ``ids`` (B, T) in one chunk."""
    cache = kvcache.make_cache(model, "dense", cache_length=ids.shape[1], batch_size=ids.shape[0])
    model(ids, cache)
    return [layer.storage.k[:, :, : ids.shape[1]].norm(dim=-1) for layer in cache.layers]


def smallest(norms: torch.Tensor, n: int, protected: set[int]) -> list[int]:
    """Positions of the protected tokens plus the ``n - len(protected)`` smallest norms of the rest."""
    order = [int(p) for p in norms.argsort() if int(p) not in protected]
    return sorted(protected | set(order[: n - len(protected)]))


@pytest.mark.parametrize("recent,sinks", [(0, 0), (3, 0), (2, 2)])
def test_a_prompt_keeps_the_smallest_key_norms(llama, recent, sinks):
    """A prompt fed in one chunk is attended in full before eviction, so every layer's keys are
    the dense cache's keys; each row and head keeps the C smallest norms (plus what is protected)."""
    T, C = 40, 12
    ids = distinct_ids(T, batch=2, seed=11)
    with torch.inference_mode():
        norms = dense_key_norms(llama, ids)
        cache = kvcache.make_cache(llama, "knorm", cache_length=C, batch_size=2, options={"recent": recent, "sinks": sinks})
        llama(ids, cache)
    protected = set(range(T - recent, T)) | set(range(sinks))
    for layer, layer_norms in zip(cache.layers, norms):
        for b in range(2):
            assert kept(layer, b) == [smallest(layer_norms[b, h], C, protected) for h in range(layer_norms.shape[1])]


def test_decoding_evicts_the_largest_norm_seen(llama):
    """Token by token, the first layer (whose keys depend on the token alone, whatever was
    evicted) always holds the C smallest-norm keys of everything seen."""
    T, C = 30, 8
    ids = distinct_ids(T, seed=12)
    with torch.inference_mode():
        norms = dense_key_norms(llama, ids)[0][0]  # (Hkv, T)
        cache = kvcache.make_cache(llama, "knorm", cache_length=C)
        for t in range(T):
            llama(ids[:, t : t + 1], cache)
            held = kept(cache.layers[0], 0)
            for h, positions in enumerate(held):
                assert positions == smallest(norms[h, : t + 1], min(C, t + 1), set()), f"after token {t}, head {h}"


def test_budget_covering_the_sequence_equals_the_forward(llama):
    ids = ids_for(24, seed=13, vocab=VOCAB)
    with torch.inference_mode():
        cache = kvcache.make_cache(llama, "knorm", cache_length=24)
        got = torch.cat([llama(ids[:, i : i + 5], cache) for i in range(0, 24, 5)], dim=1)
        assert (got - llama(ids)).abs().max().item() <= atol("cache")


def test_protected_tokens_must_leave_room(llama):
    with pytest.raises(ValueError, match=r"recent \+ sinks \(8\) must be smaller than cache_length \(8\)"):
        kvcache.make_cache(llama, "knorm", cache_length=8, options={"recent": 6, "sinks": 2})
