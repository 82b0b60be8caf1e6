"""A call the model or the cache rejects leaves the cache exactly as it was.

Each test feeds a cache and a twin the same prompt, makes a call that must be rejected on the
first cache, and then checks that the next valid call gives the twin's logits bit for bit and that
``lengths`` did not move: nothing was written before the check.
"""

from __future__ import annotations

import copy
import dataclasses
import re

import pytest
import torch
from conftest import DEVICE, VOCAB, random_ids

import kvcache

# Every registered policy at full precision, and a few at quantized storages.
POLICIES = sorted(kvcache.policies()) + ["dense:int8", "window:int8", "h2o:int8", "snapkv:kivi4"]
PROMPT_TOKENS = [8, 5]  # ragged, and past the evicting caches' budget


def _other(llama: kvcache.Transformer, seed: int = 0, **changes) -> kvcache.Transformer:
    """A random model like ``llama`` (on its device) but for ``changes`` to its config."""
    torch.manual_seed(seed)
    return kvcache.Transformer(dataclasses.replace(llama.config, **changes)).eval().to(DEVICE)


@pytest.fixture(scope="module")
def mismatched(llama):
    """Models a cache made for ``llama`` must refuse, with the words the error must use."""
    return {
        "more layers": (_other(llama, num_layers=3), r"layers 2 \(cache\) vs 3 \(model\)"),
        # Fewer layers would otherwise run without error and leave the last layer behind.
        "fewer layers": (_other(llama, num_layers=1), r"layers 2 \(cache\) vs 1 \(model\)"),
        "kv heads": (_other(llama, num_kv_heads=4), r"K/V heads 2 \(cache\) vs 4 \(model\)"),
        "head size": (_other(llama, head_dim=8), r"head_dim 16 \(cache\) vs 8 \(model\)"),
        "dtype": (copy.deepcopy(llama).to(torch.bfloat16), r"dtype torch.float32 \(cache\) vs torch.bfloat16"),
        "device": (copy.deepcopy(llama).to("meta"), rf"device {re.escape(str(DEVICE))} \(cache\) vs meta \(model\)"),
    }


def _fed_pair(llama, policy: str) -> tuple[kvcache.KVCache, kvcache.KVCache, torch.Tensor]:
    """Two caches for ``llama`` holding the same ragged prompt, and the ids of a next chunk."""
    cache_length = 32 if policy.startswith("dense") else 6
    caches = [kvcache.make_cache(llama, policy, cache_length=cache_length, batch_size=2) for _ in range(2)]
    prompt = random_ids(max(PROMPT_TOKENS), batch=2, seed=11)
    with torch.inference_mode():
        for cache in caches:
            llama(prompt, cache, n_tokens=PROMPT_TOKENS)
    return caches[0], caches[1], random_ids(3, batch=2, seed=12)


def _assert_untouched(llama, cache, twin, following, lengths):
    assert torch.equal(cache.lengths, lengths)
    with torch.inference_mode():
        for T in (3, 1):  # a chunk, then a decode step
            assert torch.equal(llama(following[:, :T], cache), llama(following[:, :T], twin))
    assert torch.equal(cache.lengths, twin.lengths)


@pytest.mark.parametrize("T", [1, 3], ids=["decode", "chunk"])
@pytest.mark.parametrize("which", ["more layers", "fewer layers", "kv heads", "head size", "dtype", "device"])
@pytest.mark.parametrize("policy", POLICIES)
def test_cache_for_another_model_rejected_before_any_write(llama, mismatched, policy, which, T):
    cache, twin, following = _fed_pair(llama, policy)
    lengths = cache.lengths.clone()
    other, says = mismatched[which]
    with torch.inference_mode(), pytest.raises(ValueError, match=says) as err:
        other(following[:, :T], cache)
    assert "kvcache.make_cache(model" in str(err.value)
    _assert_untouched(llama, cache, twin, following, lengths)


def test_every_difference_is_named(llama):
    cache = kvcache.make_cache(llama, cache_length=8)
    other = _other(llama, num_layers=3, num_kv_heads=4, head_dim=8).to(torch.float64)
    with pytest.raises(ValueError) as err:
        other(random_ids(2), cache)
    for words in ("layers 2", "K/V heads 2", "head_dim 16", "dtype torch.float32"):
        assert words in str(err.value)
    assert f"device {DEVICE}" not in str(err.value)


@pytest.mark.parametrize("bad", [VOCAB, 8192, -1])
def test_token_ids_outside_vocabulary_rejected(llama, bad):
    ids = torch.tensor([[5, bad, 7]], device=DEVICE)
    with pytest.raises(ValueError, match=rf"outside \[0, {VOCAB}\).*\[{bad}\]"):
        llama(ids)


def test_token_ids_outside_vocabulary_in_padding_rejected(llama):
    """Padding goes through the embedding too, so it must be a valid id (generate pads with 0)."""
    cache = kvcache.make_cache(llama, cache_length=8, batch_size=2)
    ids = torch.tensor([[5, 6], [7, VOCAB]], device=DEVICE)
    with pytest.raises(ValueError, match=str(VOCAB)):
        llama(ids, cache, n_tokens=[2, 1])
    assert cache.lengths.tolist() == [0, 0]


@pytest.mark.parametrize("policy", POLICIES)
def test_token_ids_outside_vocabulary_leave_cache_untouched(llama, policy):
    cache, twin, following = _fed_pair(llama, policy)
    lengths = cache.lengths.clone()
    bad = following.clone()
    bad[1, 0] = VOCAB + 3
    with torch.inference_mode(), pytest.raises(ValueError, match=str(VOCAB + 3)):
        llama(bad, cache)
    _assert_untouched(llama, cache, twin, following, lengths)
