"""snapkv: an overflowing chunk keeps, per K/V head, its observation window (last ``window``
tokens) plus the tokens that window voted for most (votes pooled over neighbouring positions);
decode steps then evict by ``fallback``."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE
from policy_util import EXACT_ATOL, LayerHarness, build_tiny, ids_for, kept, max_diff

import kvcache
from kvcache.cache.policies.snapkv import SnapKVCache, SnapKVOptions

ATOL = EXACT_ATOL[torch.float32]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny(tmp_path_factory.mktemp("snapkv_tiny"), layers=2, seed=7)


def test_snapkv_keeps_observation_window_then_evicts_oldest(tiny):
    C, window = 16, 4
    ids = ids_for(60, seed=11, vocab=tiny.config.vocab_size)
    cache = kvcache.make_cache(tiny, "snapkv", cache_length=C, options={"window": window, "kernel": 3})
    with torch.inference_mode():
        tiny(ids[:, :40], cache)
        heads = [kept(layer, 0) for layer in cache.layers]
        for layer_heads in heads:
            for held in layer_heads:
                assert len(held) == C and set(range(40 - window, 40)) <= set(held)
                assert held != list(range(40 - C, 40))  # votes, not recency
        assert any(len({tuple(h) for h in hs}) > 1 for hs in heads), "each head votes for itself"
        for p in range(40, 60):  # fallback "window": the oldest kept token goes
            before = [kept(layer, 0) for layer in cache.layers]
            tiny(ids[:, p : p + 1], cache)
            for layer, old in zip(cache.layers, before):
                assert kept(layer, 0) == [sorted(h[1:] + [p]) for h in old]


def _pooled_votes(harness, q, cands, window_queries, kernel):
    """Per head: votes of the window queries (summed over them and the G heads of the group),
    avg-pooled over neighbours in position order with zero padding."""
    pooled = []
    for h in range(harness.Hkv):
        votes = torch.zeros(len(cands), device=DEVICE)
        for t, p in window_queries:
            visible = [c for c in cands if c <= p]
            for g in range(h * harness.G, (h + 1) * harness.G):
                w, _ = harness.attention(h, q[g, t], visible)
                votes[: len(visible)] += w  # cands are sorted, so the visible ones come first
        padded = torch.cat([torch.zeros(kernel // 2, device=DEVICE), votes, torch.zeros(kernel // 2, device=DEVICE)])
        pooled.append({c: float(padded[i : i + kernel].sum()) / kernel for i, c in enumerate(cands)})
    return pooled


@pytest.mark.parametrize("fallback", ["window", "tova"])
def test_snapkv_matches_reference_votes_and_fallback(fallback):
    C, W, K = 8, 3, 3
    opts = SnapKVOptions(window=W, kernel=K, pooling="avg", fallback=fallback)
    harness = LayerHarness(SnapKVCache, C, opts, seed=4)
    ref = [[] for _ in range(harness.Hkv)]
    for T in [20, 1, 1, 10, 1, 1, 1, 5]:
        positions, q, out = harness.chunk(T)
        for h in range(harness.Hkv):
            for t, p in enumerate(positions):
                visible = [c for c in sorted(ref[h] + positions) if c <= p]
                for g in range(h * harness.G, (h + 1) * harness.G):
                    assert max_diff(out[g, t], harness.attention(h, q[g, t], visible)[1]) <= ATOL
        if T > 1:
            # Every overflowing chunk is compressed by its own observation window.
            window_queries = list(enumerate(positions))[-W:]
            for h in range(harness.Hkv):
                cands = sorted(ref[h] + positions)
                pooled = _pooled_votes(harness, q, cands, window_queries, K)[h]
                protected = positions[-W:]
                others = sorted((c for c in cands if c not in protected), key=lambda c: -pooled[c])
                ref[h] = sorted(protected + others[: C - W])
        else:
            (p,) = positions
            for h in range(harness.Hkv):
                cands = ref[h] + [p]
                if fallback == "window":
                    victim = min(cands)
                else:  # least attended by the newest query, summed over the group's heads
                    w = sum(harness.attention(h, q[g, 0], cands)[0] for g in range(h * harness.G, (h + 1) * harness.G))
                    victim = cands[int(w.argmin())]
                ref[h] = sorted(c for c in cands if c != victim)
        assert harness.kept() == ref, f"after {harness.length} tokens"
    assert ref[0] != ref[1]
