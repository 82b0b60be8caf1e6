"""sink (StreamingLLM): the first ``sinks`` tokens plus the most recent ones.

The scenario of transformers issue 35350: a prompt longer than the budget, then many decode steps.
With renumbered positions every query sees its keys at assigned positions 0..n-1 and itself at
n-1, never a key "from the future"; for a one-layer model that is exactly the plain forward of the
kept tokens (sinks, then the recent window) re-embedded at 0..n-1. Absolute positions are not.
"""

from __future__ import annotations

import pytest
import torch
from policy_util import (
    EXACT_ATOL,
    AttentionRecorder,
    build_tiny,
    expected_sink_positions,
    ids_for,
    kept,
    max_diff,
    stream,
    torch_threads,
    visible_sets,
)

import kvcache

ATOL = EXACT_ATOL[torch.float32]
C, SINKS, PREFILL, DECODE = 16, 4, 40, 50


@pytest.fixture(scope="module")
def one_layer(tmp_path_factory):
    """A one-layer model: attention sees token embeddings, so renumbering is checkable exactly."""
    return build_tiny(tmp_path_factory.mktemp("sink_one_layer"), layers=1, max_positions=200_000)


def _issue_35350(model, positions):
    """Prefill PREFILL > C tokens in one chunk, then DECODE one-token steps. Returns the ids, the
    cache and, per query position p, (logits, [the attention call of each layer, query index])."""
    ids = ids_for(PREFILL + DECODE, seed=3, vocab=model.config.vocab_size)
    cache = kvcache.make_cache(model, "sink", cache_length=C, options={"sinks": SINKS, "positions": positions})
    recorder = AttentionRecorder(cache)
    steps = {}
    with torch.inference_mode(), recorder.patch():
        out = model(ids[:, :PREFILL], cache)
        for p in range(PREFILL):
            steps[p] = (out[0, p], [(call, p) for call in recorder.calls])
        recorder.clear()
        for p in range(PREFILL, PREFILL + DECODE):
            out = model(ids[:, p : p + 1], cache)
            steps[p] = (out[0, 0], [(call, 0) for call in recorder.calls])
            recorder.clear()
            assert kept(cache.layers[0], 0) == [expected_sink_positions(p + 1, C, SINKS)]
    return ids, cache, steps


def _assigned(layer, call, t):
    """(assigned query position, sorted assigned positions of the keys visible to query t)."""
    aq, ak = layer.assigned_positions(call["q_pos"], call["k_pos"])  # (B, T), (B, 1, T, S)
    keys = ak[0, 0, t][call["vis"][0, 0, t]]
    return int(aq[0, t]), sorted(keys.tolist())


@pytest.mark.parametrize("which", ["one_layer", "llama"])
def test_renumbered_positions_are_contiguous_and_causal(request, which):
    model = request.getfixturevalue(which)
    _, cache, steps = _issue_35350(model, "renumbered")
    assert len(steps) == PREFILL + DECODE
    for p, (_, calls) in steps.items():
        assert len(calls) == len(cache.layers)
        n = min(C, p + 1)
        for layer, (call, t) in zip(cache.layers, calls):
            assert int(call["q_pos"][0, t]) == p
            assert visible_sets(call, 0, t) == [expected_sink_positions(p + 1, C, SINKS)]
            q, keys = _assigned(layer, call, t)
            assert all(k <= q for k in keys), f"query {p}: a visible key is assigned after the query"
            assert keys == list(range(n)), f"query {p}: assigned key positions {keys}"
            assert q == n - 1


def test_renumbered_equals_forward_of_kept_tokens(one_layer):
    """Exact for one layer: the logits at every step equal the plain forward of the kept tokens."""
    ids, _, steps = _issue_35350(one_layer, "renumbered")
    with torch.inference_mode():
        for p, (logits, _) in steps.items():
            kept_ids = ids[:, expected_sink_positions(p + 1, C, SINKS)]
            diff = max_diff(logits, one_layer(kept_ids)[0, -1])
            assert diff <= ATOL, f"query {p}: {diff:.3g}"


@pytest.mark.parametrize("storage", ["full", "int8"])
def test_renumbered_decode_then_chunk_then_decode(one_layer, storage):
    """Decode steps over full rows, a chunk after them, and the decode steps after that score
    the sinks as stored (exact forward of the kept tokens at
    full precision; for int8, the same logits as feeding every token one at a time)."""
    schedule = [PREFILL] + [1] * 12 + [5] + [1] * 6 + [3, 1, 1]
    ids = ids_for(sum(schedule), seed=5, vocab=one_layer.config.vocab_size)
    name = "sink" if storage == "full" else f"sink:{storage}"

    def run(schedule):
        cache = kvcache.make_cache(one_layer, name, cache_length=C, options={"sinks": SINKS})
        logits, fed = [], 0
        for n in schedule:
            logits.append(one_layer(ids[:, fed : fed + n], cache)[0])
            fed += n
        return torch.cat(logits)

    with torch.inference_mode():
        got = run(schedule)
        if storage == "full":
            for p in range(len(got)):
                want = one_layer(ids[:, expected_sink_positions(p + 1, C, SINKS)])[0, -1]
                assert max_diff(got[p], want) <= ATOL, f"query {p}"
        else:
            assert max_diff(got, run([1] * len(got))) <= 1e-5


def test_decode_steps_score_renumbered_sinks_without_touching_their_slots(one_layer):
    """Renumbered sinks are scored with a rotated query: after decode steps over full rows the
    sink slots hold, bit for bit, the keys the prompt stored, and taking the state changes nothing."""
    ids = ids_for(PREFILL + 8, seed=7, vocab=one_layer.config.vocab_size)
    cache = kvcache.make_cache(one_layer, "sink", cache_length=C, options={"sinks": SINKS})
    with torch.inference_mode():
        one_layer(ids[:, :PREFILL], cache)
        stored = cache.layers[0].storage.k[:, :, :SINKS].clone()
        for p in range(PREFILL, PREFILL + 8):
            one_layer(ids[:, p : p + 1], cache)
            assert torch.equal(cache.layers[0].storage.k[:, :, :SINKS], stored), f"step at {p}"
        before = {name: t.clone() for name, t in cache.layers[0].state().items()}
        after = cache.layers[0].state()
        assert all(torch.equal(after[name], t) for name, t in before.items())


def test_absolute_is_not_the_forward_of_kept_tokens(one_layer):
    """The same comparison discriminates: absolute positions agree only until the window fills."""
    ids, cache, steps = _issue_35350(one_layer, "absolute")
    with torch.inference_mode():
        for p, (logits, calls) in steps.items():
            kept_ids = ids[:, expected_sink_positions(p + 1, C, SINKS)]
            diff = max_diff(logits, one_layer(kept_ids)[0, -1])
            q, keys = _assigned(cache.layers[0], calls[0][0], calls[0][1])
            assert all(k <= q for k in keys)  # causal all the same
            if p < C:
                assert diff <= ATOL
                assert keys == list(range(p + 1))
            else:
                assert diff > 1e-2, f"query {p}: absolute sinks agree with renumbered ({diff:.3g})"
                assert q - keys[0] == p > C - 1  # the sink distance grows without bound


def test_sink_streams_100k_tokens_in_flat_memory(one_layer):
    """100k tokens in 512-token chunks plus decode steps: constant cache size, flat process memory,
    finite logits, always the sinks plus the recent window, and still the kept-token forward."""
    total, budget = 100_000, 64
    ids = ids_for(total, seed=4, vocab=one_layer.config.vocab_size)
    cache = kvcache.make_cache(one_layer, "sink", cache_length=budget, options={"sinks": SINKS})
    nbytes = cache.nbytes()

    def check(cache, fed):
        assert cache.nbytes() == nbytes
        assert kept(cache.layers[0], 0) == [expected_sink_positions(fed, budget, SINKS)]

    with torch_threads(1), torch.inference_mode():
        run = stream(one_layer, cache, ids, chunk=512, decode_every=3, on_step=check)
        assert run["fed"] == total and cache.lengths.tolist() == [total]
        assert run["finite"]
        growth = run["rss_end"] - run["rss_checkpoint"]
        assert growth < 8 * 2**20, f"RSS grew by {growth / 2**20:.1f} MiB between 10k and 100k tokens"
        # Renumbering still holds at position 1e5. Not to 1e-5: keys are stored rotated at their true
        # positions, and fp32 RoPE angles near 1e5 carry ~1e-2 rad of rounding (measured 6.5e-4 here).
        reference = one_layer(ids[:, expected_sink_positions(total, budget, SINKS)])[0, -1]
        assert max_diff(run["logits"][0, -1], reference) <= 5e-3


def test_budget_covering_sequence_equals_forward_with_model_window(model_factory):
    model = model_factory("mistral_window")  # sliding_window = 8
    ids = ids_for(20, seed=1, vocab=model.config.vocab_size)
    with torch.inference_mode():
        cache = kvcache.make_cache(model, "sink", cache_length=32, options={"sinks": 4})
        assert max_diff(model(ids, cache), model(ids)) <= ATOL
