"""keydiff keeps the keys least similar to the mean unit key: checked against the keys a dense
cache holds for the same tokens."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE
from policy_util import kept

import kvcache

VOCAB = 128


def dense_keys(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """(B, Hkv, T, D) keys per layer from a dense cache fed ``ids`` in one chunk."""
    cache = kvcache.make_cache(model, "dense", cache_length=ids.shape[1], batch_size=ids.shape[0])
    model(ids, cache)
    return [layer.storage.k[:, :, : ids.shape[1]].float() for layer in cache.layers]


@pytest.mark.parametrize("recent,sinks", [(0, 0), (2, 3)])
def test_a_prompt_keeps_the_keys_furthest_from_the_anchor(llama, recent, sinks):
    T, C = 40, 12
    g = torch.Generator().manual_seed(5)
    ids = torch.stack([3 + torch.randperm(VOCAB - 3, generator=g).to(DEVICE)[:T] for _ in range(2)])
    with torch.inference_mode():
        keys = dense_keys(llama, ids)
        cache = kvcache.make_cache(llama, "keydiff", cache_length=C, batch_size=2, options={"recent": recent, "sinks": sinks})
        llama(ids, cache)
    protected = set(range(T - recent, T)) | set(range(sinks))
    for layer, k in zip(cache.layers, keys):
        anchor = F.normalize(k, dim=-1).mean(2, keepdim=True)
        score = -F.cosine_similarity(k, anchor, dim=-1)  # (B, Hkv, T)
        for b in range(2):
            expected = []
            for h in range(k.shape[1]):
                rest = [int(p) for p in score[b, h].argsort(descending=True) if int(p) not in protected]
                expected.append(sorted(protected | set(rest[: C - len(protected)])))
            assert kept(layer, b) == expected
