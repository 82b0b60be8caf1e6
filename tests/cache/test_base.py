"""The cache container: chunk validation, and the registry behind ``make_cache``."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import DEVICE, random_ids

import kvcache


@pytest.fixture
def cache(llama):
    return kvcache.make_cache(llama, cache_length=16, batch_size=2)


def _fed(llama, cache):
    with torch.inference_mode():
        llama(random_ids(3, batch=2), cache, n_tokens=[3, 1])
    return cache


def test_batch_size_mismatch_rejected(llama, cache):
    _fed(llama, cache)
    for B in (1, 3):
        with pytest.raises(ValueError, match="batch_size=2"):
            llama(random_ids(4, batch=B), cache)
    assert cache.lengths.tolist() == [3, 1]


@pytest.mark.parametrize(
    "n_tokens",
    [[4], [4, 4, 4], [[4, 4]], torch.tensor([[1], [2]])],
    ids=["short", "long", "nested", "2d-tensor"],
)
def test_n_tokens_wrong_shape_rejected(llama, cache, n_tokens):
    _fed(llama, cache)
    with pytest.raises(ValueError, match="n_tokens must have shape"):
        llama(random_ids(4, batch=2), cache, n_tokens=n_tokens)
    assert cache.lengths.tolist() == [3, 1]


@pytest.mark.parametrize("n_tokens", [[5, 1], [-1, 2], [0, 7]])
def test_n_tokens_out_of_range_rejected(llama, cache, n_tokens):
    _fed(llama, cache)
    with pytest.raises(ValueError, match=r"n_tokens must lie in \[0, 4\]"):
        llama(random_ids(4, batch=2), cache, n_tokens=n_tokens)
    assert cache.lengths.tolist() == [3, 1]


def test_n_tokens_as_tensor_or_list(llama):
    ids = random_ids(5, batch=2, seed=3)
    with torch.inference_mode():
        a = kvcache.make_cache(llama, cache_length=5, batch_size=2)
        b = kvcache.make_cache(llama, cache_length=5, batch_size=2)
        out_a = llama(ids, a, n_tokens=[5, 2])
        out_b = llama(ids, b, n_tokens=torch.tensor([5, 2], dtype=torch.int32, device=DEVICE))
    assert a.lengths.tolist() == b.lengths.tolist() == [5, 2]
    assert torch.equal(out_a[0], out_b[0]) and torch.equal(out_a[1, :2], out_b[1, :2])


def test_make_cache_unknown_policy_lists_available(llama):
    with pytest.raises(ValueError, match="dense") as err:
        kvcache.make_cache(llama, "no-such-policy", cache_length=8)
    assert "no-such-policy" in str(err.value)


@pytest.mark.parametrize("kwargs", [{"cache_length": 0}, {"cache_length": -3}, {"cache_length": 4, "batch_size": 0}])
def test_make_cache_bad_geometry(llama, kwargs):
    with pytest.raises(ValueError):
        kvcache.make_cache(llama, "dense", **kwargs)


def test_policies_lists_dense():
    pol = kvcache.policies()
    assert "dense" in pol
    assert isinstance(pol["dense"], str) and pol["dense"]


def test_register_rejects_duplicate_name():
    from kvcache.cache import register
    from kvcache.cache.policies.dense import DenseCache

    class Another(DenseCache):
        name = "dense"

    with pytest.raises(ValueError, match="already registered"):
        register(Another)
    assert kvcache.policies()["dense"] == DenseCache.description


def test_fresh_cache_state(llama, cache):
    assert cache.lengths.tolist() == [0, 0]
    assert cache.lengths.dtype == torch.long
    for layer in cache.layers:
        assert bool((layer.storage.pos == -1).all())


# --- max_tokens --------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["dense", "dense:int8", "dense:int4"])
def test_max_tokens_of_a_cache_that_keeps_every_token(llama, policy):
    """max_tokens is exactly what a row can take: one token more raises CapacityError."""
    cache = kvcache.make_cache(llama, policy, cache_length=7, batch_size=2)
    assert cache.max_tokens == 7
    with torch.inference_mode():
        llama(random_ids(7, batch=2), cache, n_tokens=[7, 4])
        with pytest.raises(kvcache.CapacityError):
            llama(random_ids(1, batch=2), cache)
        llama(random_ids(3, batch=2), cache, n_tokens=[0, 3])
    assert cache.lengths.tolist() == [7, 7]


@pytest.mark.parametrize("policy", ["window", "sink", "h2o", "tova", "snapkv", "window:int8"])
def test_max_tokens_of_an_evicting_cache_is_none(llama, policy):
    cache = kvcache.make_cache(llama, policy, cache_length=6)
    assert cache.max_tokens is None
    with torch.inference_mode():
        llama(random_ids(20), cache)  # more than cache_length, without complaint
    assert cache.lengths.tolist() == [20]


def test_max_tokens_with_head_budgets_is_none(llama):
    cache = kvcache.make_cache(llama, "h2o", cache_length=6, head_budgets=[[4, 8], [6, 6]])
    assert cache.max_tokens is None


# --- the container's geometry --------------------------------------------------------------------


def test_layers_must_share_the_containers_geometry(llama):
    from kvcache.cache import KVCache
    from kvcache.cache.policies.dense import DenseCache

    spec = kvcache.make_cache(llama, cache_length=4).spec
    other = dataclasses.replace(spec, dtype=torch.float64)
    with pytest.raises(ValueError, match="layer 1 was made with dtype=torch.float64"):
        KVCache([DenseCache(spec), DenseCache(other)], spec, "dense")
    with pytest.raises(ValueError, match="got none"):
        KVCache([], spec, "dense")
    # Layers may differ in cache_length (pyramid allocation), not in geometry.
    KVCache([DenseCache(spec), DenseCache(dataclasses.replace(spec, cache_length=9))], spec, "dense")
