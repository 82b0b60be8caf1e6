"""The cache container: chunk validation, and the registry behind ``make_cache``."""

from __future__ import annotations

import pytest
import torch

import kvcache
from conftest import random_ids


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
        out_b = llama(ids, b, n_tokens=torch.tensor([5, 2], dtype=torch.int32))
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
