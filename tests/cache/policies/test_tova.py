"""tova (Token Omission Via Attention): evict the token the newest query attends least, averaged
over all query heads; every head keeps the same tokens."""

from __future__ import annotations

import pytest
import torch
from policy_util import EXACT_ATOL, LayerHarness, ids_for, kept, max_diff

import kvcache
from kvcache.cache.policies.tova import TOVACache

ATOL = EXACT_ATOL[torch.float32]


@pytest.mark.parametrize("Hkv,G", [(2, 2), (1, 4), (4, 1)])
def test_tova_evicts_least_attended_by_newest_query(Hkv, G):
    C = 5
    harness = LayerHarness(TOVACache, C, None, Hkv=Hkv, G=G, seed=2)
    ref_kept: list[int] = []
    evictions = 0
    for T in [3, 1, 1, 1, 1, 4, 1, 1, 1, 7, 1, 1, 2, 1, 1]:
        positions, q, out = harness.chunk(T)
        cands = ref_kept + positions
        for t, p in enumerate(positions):
            visible = [c for c in cands if c <= p]
            for g in range(Hkv * G):
                _, o = harness.attention(g // G, q[g, t], visible)
                assert max_diff(out[g, t], o) <= ATOL
        # Mean over every query head of the newest query's attention.
        weights = torch.stack([harness.attention(g // G, q[g, -1], cands)[0] for g in range(Hkv * G)])
        score = dict(zip(cands, weights.mean(0).tolist()))
        ref_kept = sorted(sorted(cands, key=lambda c: -score[c])[:C])
        if T == 1 and len(cands) > C:
            # A decode step over a full cache evicts exactly the least attended (maybe the new token).
            least = min(cands, key=lambda c: score[c])
            assert sorted(set(cands) - set(ref_kept)) == [least]
            evictions += least != positions[0]
        assert harness.kept() == [ref_kept], f"after {harness.length} tokens"
    assert evictions >= 3  # old tokens were really evicted, not just the newcomer


def test_tova_shares_slots_across_heads(llama):
    cache = kvcache.make_cache(llama, "tova", cache_length=6)
    ids = ids_for(30, seed=3, vocab=llama.config.vocab_size)
    with torch.inference_mode():
        llama(ids[:, :12], cache)
        for p in range(12, 30):
            llama(ids[:, p : p + 1], cache)
    for layer in cache.layers:
        assert layer.storage.pos.shape[1] == 1
        (held,) = kept(layer, 0)
        assert len(held) == 6 and held != list(range(24, 30))  # not simply the most recent
