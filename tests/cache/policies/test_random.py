"""random keeps the tokens a seeded CPU generator ranks highest, in position order, as kvpress's
RandomPress does; another seed keeps other tokens."""

from __future__ import annotations

import torch
from conftest import DEVICE
from policy_util import kept

import kvcache


def test_a_prompt_keeps_the_top_draws_of_the_seeded_generator(llama):
    T, C = 30, 10
    ids = torch.arange(3, 3 + T, device=DEVICE)[None]
    with torch.inference_mode():
        cache = kvcache.make_cache(llama, "random", cache_length=C, options={"score_seed": 7})
        llama(ids, cache)
    Hkv = cache.layers[0].storage.k.shape[1]
    draws = torch.rand(Hkv, T, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    expected = [sorted(draws[h].topk(C).indices.tolist()) for h in range(Hkv)]
    for layer in cache.layers:  # every layer draws the same sequence
        assert kept(layer, 0) == expected


def test_the_seed_changes_what_is_kept(llama):
    ids = torch.arange(3, 33, device=DEVICE)[None]
    held = []
    for seed in (0, 1):
        with torch.inference_mode():
            cache = kvcache.make_cache(llama, "random", cache_length=10, options={"score_seed": seed})
            llama(ids, cache)
        held.append(kept(cache.layers[0], 0))
    assert held[0] != held[1]
