"""Scoring policies over KIVI storage keep its strong layout: survivors stay in their slots, so
their keys keep their per-channel codes, and the groups they fill with new tokens are sealed
again per channel (storage.in_place). In rank order, a chunked prompt would leave most keys per
token (25%, 0% and 3% per channel for h2o, tova and snapkv at 4 bits)."""

from __future__ import annotations

import pytest
import torch
from conftest import random_ids

import kvcache
from kvcache.cache.registry import budget_options
from kvcache.kernels import CHANNEL


def channel_share(cache) -> float:
    """Share of occupied slots, over layers and heads, whose key is kept per channel."""
    channel = occupied = 0
    for layer in cache.layers:
        store = layer.storage
        C = store.pos.shape[2] - 1
        held = (store.pos[:, :, :C] >= 0).expand(-1, store.k.shape[1], -1)
        channel += int(((store.k_mode[:, :, :C] == CHANNEL) & held).sum())
        occupied += int(held.sum())
    return channel / occupied


@pytest.mark.parametrize("name", ["h2o:kivi4", "tova:kivi4", "snapkv:kivi4", "h2o:kivi2"])
def test_a_chunked_prompt_keeps_keys_per_channel(llama, name):
    # KIVI named outright: "int4" on a cache this small holds full precision (fewer bytes).
    C = 64
    cache = kvcache.make_cache(llama, name, cache_length=C, options=budget_options(name.split(":")[0], C))
    ids = random_ids(192, seed=5)
    with torch.inference_mode():
        for start in range(0, 192, 32):
            llama(ids[:, start : start + 32], cache)
    assert channel_share(cache) >= 0.9
