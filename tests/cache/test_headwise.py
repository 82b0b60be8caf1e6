"""Head-wise budgets: every K/V head its own capacity, and the Ada-KV-style allocation."""

from __future__ import annotations

import pytest
import torch

import kvcache
from kvcache.cache import HeadwiseCache
from tests.conftest import CACHE_ATOL, max_diff, random_ids

ATOL = CACHE_ATOL[torch.float32]


def feed(model, cache, ids, prefill):
    outs = [model(ids[:, :prefill], cache)]
    outs += [model(ids[:, i : i + 1], cache) for i in range(prefill, ids.shape[1])]
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("policy,options", [("h2o", {"recent": 4}), ("window", {}), ("snapkv", {"window": 4})])
def test_budgets_covering_the_sequence_equal_the_forward(llama, policy, options):
    ids = random_ids(30)
    budgets = [[31, 40], [35, 33]]
    with torch.inference_mode():
        cache = kvcache.make_cache(llama, policy, cache_length=8, head_budgets=budgets, options=options)
        assert all(isinstance(layer, HeadwiseCache) for layer in cache.layers)
        assert max_diff(feed(llama, cache, ids, 12), llama(ids)) <= ATOL


def test_each_head_holds_at_most_its_budget_and_memory_follows_the_budgets(llama):
    budgets = [[4, 12], [10, 6]]
    with torch.inference_mode():
        cache = kvcache.make_cache(llama, "h2o", cache_length=8, head_budgets=budgets, options={"recent": 2})
        logits = feed(llama, cache, random_ids(40), 20)
    assert torch.isfinite(logits).all()
    for layer, layer_budgets in zip(cache.layers, budgets):
        assert layer.budgets == layer_budgets
        for head, budget in zip(layer.heads, layer_budgets):
            pos = head.storage.pos[0, 0, :budget]
            assert int((pos >= 0).sum()) == budget  # full after 40 tokens, never more than budget
            assert len(set(pos.tolist())) == budget
    # Each layer's budgets add up to 2 x 8, so the bytes equal a uniform cache of 8 per head:
    # unequal heads cost nothing extra, and a bigger head budget really allocates more.
    uniform = kvcache.make_cache(llama, "h2o", cache_length=8, options={"recent": 2})
    assert cache.nbytes() == uniform.nbytes()
    bigger = kvcache.make_cache(llama, "h2o", cache_length=8, head_budgets=[[12, 12], [12, 12]], options={"recent": 2})
    assert cache.nbytes() < bigger.nbytes()


def test_adaptive_budgets_keep_the_layer_total(llama):
    ids = random_ids(64, seed=3)
    with torch.inference_mode():
        budgets = kvcache.adaptive_head_budgets(llama, ids, 16, window=8, floor=0.25)
    H = llama.config.num_kv_heads
    assert len(budgets) == llama.config.num_layers
    for layer in budgets:
        assert len(layer) == H
        assert sum(layer) == 16 * H
        assert min(layer) >= 4  # the floor share
    with torch.inference_mode():
        cache = kvcache.make_cache(llama, "h2o", cache_length=16, head_budgets=budgets, options={"recent": 2})
        assert torch.isfinite(feed(llama, cache, ids, 40)).all()


def test_bad_head_budgets_are_rejected(llama):
    with pytest.raises(ValueError, match="one list per layer"):
        kvcache.make_cache(llama, "h2o", cache_length=8, head_budgets=[[8, 8]])
    with pytest.raises(ValueError, match="head budgets"):
        kvcache.make_cache(llama, "window", cache_length=8, head_budgets=[[8], [8]])
    with pytest.raises(ValueError, match="head budgets"):
        kvcache.make_cache(llama, "window", cache_length=8, head_budgets=[[8, 0], [8, 8]])
    with pytest.raises(ValueError, match=r"shape \(1, T\)"):
        kvcache.adaptive_head_budgets(llama, random_ids(10, batch=2), 8)
