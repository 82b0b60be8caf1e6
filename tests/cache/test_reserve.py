"""``reserve``: an overflowing cache keeps cache_length - reserve tokens, then grows without evicting.

With cache_length = kept + reserve, a prompt is compressed to exactly the tokens a cache of
``kept`` slots keeps, and the next ``reserve`` tokens are appended: kvpress's "compress the
context, then let the cache grow". The property tests (test_policies.py, ":reserve" cases) check
capacity, causality and the budget-covers-the-sequence exactness under random ragged schedules.
"""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE
from policy_util import EXACT_ATOL, feed, ids_for, kept, max_diff

import kvcache
from kvcache.kernels import attention

ATOL = EXACT_ATOL[torch.float32]
VOCAB = 128  # the conftest llama
CASES = [("h2o", dict(recent=2, sinks=1)), ("tova", {}),
         ("snapkv", dict(window=3, fallback="tova")), ("snapkv", dict(window=3, fallback="window")),
         ("h2o:int8", dict(recent=2))]


@pytest.mark.parametrize("policy,options", CASES, ids=lambda x: str(x))
def test_compress_once_then_grow(llama, policy, options):
    """A 20-token prompt into 6 + 5 slots keeps what 6 slots keep; 5 more tokens evict nothing;
    the 6th evicts back down to 6."""
    kept_n, R = 6, 5
    ids = ids_for(30, batch=2, seed=11, vocab=VOCAB)
    rows = [ids[0], ids[1, :29]]
    with torch.inference_mode():
        grow = kvcache.make_cache(llama, policy, cache_length=kept_n + R, batch_size=2, reserve=R, options=options)
        fixed = kvcache.make_cache(llama, policy, cache_length=kept_n, batch_size=2, options=options)
        # A ragged prompt (20 and 19 tokens): each row is compressed on its own.
        a = feed(llama, grow, rows, [[20, 19]])
        b = feed(llama, fixed, rows, [[20, 19]])
        for r in range(2):
            assert max_diff(a[r], b[r]) <= ATOL
        for layer, ref in zip(grow.layers, fixed.layers):
            for r in range(2):
                assert kept(layer, r) == kept(ref, r)
                assert int(layer.held[r]) == kept_n
        before = [[kept(layer, r) for r in range(2)] for layer in grow.layers]
        # A 3-token chunk and two decode steps fill the reserve: every token stays.
        llama(torch.stack([rows[0][20:23], rows[1][19:22]]), grow)
        llama(torch.stack([rows[0][23:24], rows[1][22:23]]), grow)
        llama(torch.stack([rows[0][24:25], rows[1][23:24]]), grow)
        for i, layer in enumerate(grow.layers):
            for r, start in enumerate((20, 19)):
                new = list(range(start, start + 5))
                assert kept(layer, r) == [sorted(h + new) for h in before[i][r]]
        # One token more: the cache overflows and keeps kept_n again.
        llama(torch.tensor([[int(rows[0][25])], [int(rows[1][24])]], device=DEVICE), grow)
        for layer in grow.layers:
            for r in range(2):
                assert [len(h) for h in kept(layer, r)] == [kept_n] * len(kept(layer, r))
                assert int(layer.held[r]) == kept_n


def test_appending_policies_skip_the_weights_until_they_evict(llama, monkeypatch):
    """TOVA and SnapKV rank by scores the evicting step computes: while the cache has room they
    attend like dense (no explicit weights). H2O's running sums need every step."""
    calls = []

    def counting(original):
        def call(*args, **kwargs):
            calls.append(args[0].shape[2])
            return original(*args, **kwargs)
        return call

    # The two kernels that compute attention weights.
    for name in ("masked_with_weights", "after_prefix_with_weights"):
        monkeypatch.setattr(attention, name, counting(getattr(attention, name)))
    ids = ids_for(12, seed=3, vocab=VOCAB)
    with torch.inference_mode():
        for policy, options, expect_weights in [("tova", {}, False), ("snapkv", dict(window=2), False),
                                                ("h2o", dict(recent=2), True)]:
            calls.clear()
            cache = kvcache.make_cache(llama, policy, cache_length=10, options=options)
            llama(ids[:, :8], cache)
            llama(ids[:, 8:9], cache)
            assert bool(calls) == expect_weights, policy
            calls.clear()
            llama(ids[:, 9:12], cache)  # 12 > 10: this chunk evicts, and scores
            assert calls, policy


def test_reserve_is_validated(llama):
    with pytest.raises(ValueError, match="reserve does not apply to the dense policy"):
        kvcache.make_cache(llama, "dense", cache_length=8, reserve=2)
    for ring in ("window", "sink"):
        with pytest.raises(ValueError, match=f"reserve does not apply to the {ring} policy"):
            kvcache.make_cache(llama, ring, cache_length=8, reserve=2)
    for policy, options in [("tova", {}), ("h2o", {}), ("snapkv", {})]:
        # Reported as what it is, not as the policy's own window or recent tokens not fitting.
        with pytest.raises(ValueError, match=r"reserve must lie in \[0, cache_length\)"):
            kvcache.make_cache(llama, policy, cache_length=8, reserve=8, options=options)
    for bad in (-1, True, 2.0):
        with pytest.raises(ValueError, match="reserve must be a non-negative int"):
            kvcache.make_cache(llama, "tova", cache_length=8, reserve=bad)
    with pytest.raises(ValueError, match=r"must be smaller than cache_length \(8\) - reserve \(4\)"):
        kvcache.make_cache(llama, "h2o", cache_length=8, reserve=4, options={"recent": 4})
    with pytest.raises(ValueError, match=r"must be smaller than cache_length \(8\) - reserve \(5\)"):
        kvcache.make_cache(llama, "snapkv", cache_length=8, reserve=5, options={"window": 3})
    # Per-layer budgets: every layer must be larger than the reserve.
    with pytest.raises(ValueError, match="reserve must lie in"):
        kvcache.make_cache(llama, "tova", cache_length=8, allocation=[8, 3], reserve=4)


def test_reset_empties_the_held_slots(llama):
    ids = ids_for(16, seed=4, vocab=VOCAB)
    with torch.inference_mode():
        cache = kvcache.make_cache(llama, "tova", cache_length=8, reserve=3)
        first = llama(ids, cache)
        cache.reset()
        assert all(int(layer.held[0]) == 0 for layer in cache.layers)
        assert max_diff(llama(ids, cache), first) == 0.0
