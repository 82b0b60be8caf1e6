"""h2o (Heavy-Hitter Oracle): per row and K/V head, the ``recent`` newest tokens, the first
``sinks`` and the tokens with the most accumulated attention."""

from __future__ import annotations

import pytest
import torch
from policy_util import (
    EXACT_ATOL,
    LayerHarness,
    build_tiny,
    ids_for,
    kept,
    max_diff,
    stream,
    torch_threads,
)

import kvcache
from kvcache.cache.policies.h2o import H2OCache, H2OOptions

ATOL = EXACT_ATOL[torch.float32]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Two layers, peaked attention (the conftest llama attends almost uniformly, so plain H2O
    keeps the oldest tokens in every head)."""
    return build_tiny(tmp_path_factory.mktemp("h2o_tiny"), layers=2, max_positions=200_000, seed=5)


def _protected(L, recent, sinks):
    return set(range(max(0, L - recent), L)) | set(range(min(L, sinks)))


@pytest.mark.parametrize("normalize", [False, True])
def test_h2o_keeps_recent_and_sinks_and_heads_differ(tiny, normalize):
    C, recent, sinks = 8, 2, 1
    ids = ids_for(60, seed=9, vocab=tiny.config.vocab_size)
    cache = kvcache.make_cache(tiny, "h2o", cache_length=C, options={"recent": recent, "sinks": sinks, "normalize": normalize})
    schedule = [20] + [1] * 25 + [7] + [1] * 8
    done = 0
    with torch.inference_mode():
        for n in schedule:
            tiny(ids[:, done : done + n], cache)
            done += n
            for layer in cache.layers:
                assert layer.storage.pos.shape[1] == tiny.config.num_kv_heads  # slots per head
                for held in kept(layer, 0):
                    assert len(held) == min(C, done)
                    assert _protected(done, recent, sinks) <= set(held), held
    per_layer = [kept(layer, 0) for layer in cache.layers]
    # Heads choose their own heavy hitters: somewhere two heads of a layer keep different tokens.
    assert any(len({tuple(h) for h in heads}) > 1 for heads in per_layer), per_layer


def _reference_h2o(harness, schedule, C, opts: H2OOptions):
    """Replay ``schedule`` (chunk sizes) through the harness and through a plain-Python H2O."""
    score = [dict() for _ in range(harness.Hkv)]
    seen = [dict() for _ in range(harness.Hkv)]
    ref_kept = [[] for _ in range(harness.Hkv)]
    for T in schedule:
        positions, q, out = harness.chunk(T)
        newest = positions[-1]
        for h in range(harness.Hkv):
            cands = ref_kept[h] + positions
            for p in positions:
                score[h][p], seen[h][p] = 0.0, 0.0
            for t, p in enumerate(positions):
                visible = [c for c in cands if c <= p]
                for g in range(h * harness.G, (h + 1) * harness.G):
                    w, o = harness.attention(h, q[g, t], visible)
                    assert max_diff(out[g, t], o) <= ATOL, f"head {g} query {p}: attention output"
                    for c, wc in zip(visible, w.tolist()):
                        vnorm = float(harness.tokens[h][c][1].norm()) if opts.value_norm else 1.0
                        score[h][c] += wc * vnorm
                for c in visible:
                    seen[h][c] += 1
            prio = {c: score[h][c] / max(seen[h][c], 1.0) if opts.normalize else score[h][c] for c in cands}
            protected = [c for c in cands if c > newest - opts.recent or c < opts.sinks]
            others = sorted((c for c in cands if c not in protected), key=lambda c: -prio[c])
            ref_kept[h] = sorted(protected + others[: C - len(protected)])
        assert harness.kept() == ref_kept, f"after {harness.length} tokens"
    return ref_kept


@pytest.mark.parametrize("opts", [
    H2OOptions(recent=2, sinks=1),
    H2OOptions(recent=1, sinks=0, normalize=True),
    H2OOptions(recent=0, sinks=2, value_norm=True),
    H2OOptions(recent=3, sinks=0, normalize=True, value_norm=True),
], ids=repr)
def test_h2o_matches_reference_scores(opts):
    """Kept sets, per head, equal a direct computation of the accumulated attention (summed over
    every query that saw the token and the query heads of its group), chunks and decode steps mixed."""
    C = 6
    harness = LayerHarness(H2OCache, C, opts, seed=1)
    schedule = [4, 1, 1, 1, 5, 1, 1, 3, 1, 1, 1, 9, 1, 1, 2, 1, 1]
    ref = _reference_h2o(harness, schedule, C, opts)
    assert ref[0] != ref[1], "the two heads should disagree at least at the end"


def test_h2o_streams_100k_tokens_in_flat_memory(tiny):
    total, budget = 100_000, 64
    model = tiny
    ids = ids_for(total, seed=6, vocab=model.config.vocab_size)
    cache = kvcache.make_cache(model, "h2o", cache_length=budget, options={"recent": 16, "sinks": 4})
    nbytes = cache.nbytes()

    def check(cache, fed):
        assert cache.nbytes() == nbytes
        for layer in cache.layers:
            for held in kept(layer, 0):
                assert len(held) == budget and _protected(fed, 16, 4) <= set(held)

    with torch_threads(1), torch.inference_mode():
        run = stream(model, cache, ids, chunk=512, decode_every=3, on_step=check)
    assert run["fed"] == total and cache.lengths.tolist() == [total]
    assert run["finite"]
    for layer in cache.layers:
        assert torch.isfinite(layer.stats["score"]).all()
    growth = run["rss_end"] - run["rss_checkpoint"]
    assert growth < 8 * 2**20, f"RSS grew by {growth / 2**20:.1f} MiB between 10k and 100k tokens"
