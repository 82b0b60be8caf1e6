"""Attention over packed codes (kvcache/kernels/blocked.py) against the full-precision kernels
over the same slots decoded: every layout and key mode, masks from positions (windows, sinks,
the model's own window, per-head slots), attention mass and visibility counts, decode steps with
and without mass, renumbered sinks, chunk tokens appended after the slots, query and key blocks
smaller than the inputs; and that nothing decodes a whole cache."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE

import kvcache
from kvcache.cache import CacheSpec
from kvcache.cache.storages import make_storage
from kvcache.kernels import CHANNEL, RESIDUAL, TOKEN, PackedKeys, PackedValues, attention, blocked

CPU = DEVICE  # the test device (the name predates it)
ATOL = 2e-5  # float32: scales folded into queries and weights instead of applied to the codes
LAYOUTS = ["token8", "token4/4", "token2", "kivi4/4", "kivi2/8", "kivi8/4", "token5", "kivi3/4", "rtoken4/4", "rtoken3"]


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    """Blocks far smaller than the inputs, so every path crosses block boundaries."""
    monkeypatch.setattr(blocked, "BLOCK", 8)
    monkeypatch.setattr(blocked, "MIN_BLOCK", 8)
    monkeypatch.setattr(blocked, "QUERY_BLOCK", 5)
    monkeypatch.setattr(blocked, "SPAN", 16)
    monkeypatch.setattr(blocked, "SPAN_BYTES", 1)


def filled(name: str, B=2, H=2, D=16, C=30, per_head=True, seed=0, device=CPU):
    """A storage whose slots [0, 24) went through chunks, decode steps and moves, so that a KIVI
    one holds per-channel, per-token and residual keys; its positions are a permutation."""
    gen = torch.Generator().manual_seed(seed)
    spec = CacheSpec(batch_size=B, num_kv_heads=H, head_dim=D, cache_length=C, dtype=torch.float32, device=device,
                     storage=name)
    store = make_storage(spec, per_head=per_head)
    def x(T):
        return (1.5 * torch.randn(B, H, T, D, generator=gen) + torch.randn(B, H, T, 1, generator=gen)).to(device)
    def at(rows):
        return torch.tensor(rows, device=device)
    store.write_slice(0, x(13), x(13), torch.arange(13, device=device).expand(B, 13))
    for t in range(13, 22):
        store.write_slice(t, x(1), x(1), at([[t]] * B))
    k, v = x(1), x(1)
    store.write_slice(C, k, v, at([[22]] * B))
    store.settle(at([[[3]] * store.pos.shape[1], [[9]] * store.pos.shape[1]]), k, v, at([[22]] * B))
    store.write_slice(22, x(2), x(2), at([[23, 24]] * B))  # completes group [20, 24)
    store.write_slice(24, x(1), x(1), at([[25]] * B))  # opens the next (and stages nothing)
    perm = torch.stack([torch.randperm(24, generator=gen) for _ in range(B * store.pos.shape[1])]).view(B, -1, 24)
    store.pos[:, :, :24] = perm.clamp(max=40).to(device)
    store.pos[0, :, 18:22] = -1  # empty slots in one row
    return store


def test_filled_storages_hold_every_key_mode():
    modes = set(filled("kivi4/4").k_mode[:, :, :25].flatten().tolist())
    assert modes == {CHANNEL, TOKEN, RESIDUAL}


def _ref(store, span):
    k, v, pos = store.view(span)
    return k, v, pos, k.decoded(), v.decoded()


@pytest.mark.parametrize("name", LAYOUTS)
@pytest.mark.parametrize("rule", [dict(), dict(window=6, sinks=2), dict(limit=9), dict(all_visible=True)])
def test_masked_matches_full_precision(name, rule):
    store = filled(name, per_head=not rule.get("all_visible"))
    k, v, pos, kd, vd = _ref(store, 25)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 7, 16, generator=gen).to(DEVICE)
    q_pos = torch.arange(18, 25, device=DEVICE).expand(2, 7)
    if rule.get("all_visible"):
        # A promise that every slot holds a position no query is before (a filled dense cache).
        pos = torch.arange(25, device=DEVICE).expand(2, 1, 25)
        store.pos[:, :, :25] = pos
        k, v, pos, kd, vd = _ref(store, 25)
        q_pos = q_pos + 25
    got = attention.masked(q, k, v, q_pos, pos, **rule)
    want = attention.masked(q, kd, vd, q_pos, pos, **rule)
    assert (got - want).abs().max() <= ATOL


@pytest.mark.parametrize("name", LAYOUTS)
@pytest.mark.parametrize("sink", [False, True])
def test_weights_mass_and_seen_match_full_precision(name, sink):
    """Chunk tokens appended after the slots (an evicting cache's candidates) included."""
    store = filled(name)
    k, v, pos, kd, vd = _ref(store, 25)
    gen = torch.Generator().manual_seed(2)
    new_k = torch.randn(2, 2, 6, 16, generator=gen).to(DEVICE)
    new_v = torch.randn(2, 2, 6, 16, generator=gen).to(DEVICE)
    new_pos = torch.arange(41, 47, device=DEVICE).expand(2, 2, 6)
    k, v = k.with_tail(new_k), v.with_tail(new_v)
    assert isinstance(k, PackedKeys) and k.shape == (2, 2, 31, 16)
    kd, vd = torch.cat((kd, new_k), dim=2), torch.cat((vd, new_v), dim=2)
    pos = torch.cat((pos, new_pos), dim=2)
    q = torch.randn(2, 4, 6, 16, generator=gen).to(DEVICE)
    q_pos = torch.arange(41, 47, device=DEVICE).expand(2, 6)
    weight = torch.tensor([[1.0, 0.0, 1.0, 0.5, 1.0, 1.0], [0.0, 1.0, 1.0, 1.0, 2.0, 0.0]], device=DEVICE)
    rule = dict(window=8, sinks=3)
    if sink:
        rule["q_sink"] = torch.randn(2, 4, 6, 16, generator=gen).to(DEVICE)
    got = attention.masked_with_weights(q, k, v, q_pos, pos, weight, **rule)
    want = attention.masked_with_weights(q, kd, vd, q_pos, pos, weight, **rule)
    for a, b in zip(got, want):
        assert a.shape == b.shape and (a - b).abs().max() <= ATOL
    assert torch.equal(k.tail, new_k)  # the chunk's tokens, as given


@pytest.mark.parametrize("name", LAYOUTS)
@pytest.mark.parametrize("mass", [False, True])
def test_decode_matches_full_precision(name, mass):
    store = filled(name, per_head=False)
    k, v, pos, kd, vd = _ref(store, 25)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 1, 16, generator=gen).to(DEVICE)
    for visible in (None, pos >= 0):
        got = attention.decode(q, k, v, visible, want_mass=mass)
        want = attention.decode(q, kd, vd, visible, want_mass=mass)
        assert (got[0] - want[0]).abs().max() <= ATOL
        if mass:
            assert (got[1] - want[1]).abs().max() <= ATOL
    # Renumbered sinks: the first slots scored by another query.
    q_sink = torch.randn(2, 4, 1, 16, generator=gen).to(DEVICE)
    got, _ = attention.decode(q, k, v, pos >= 0, q_sink=q_sink, sink_slots=3)
    want, _ = attention.decode(q, kd, vd, pos >= 0, q_sink=q_sink, sink_slots=3)
    assert (got - want).abs().max() <= ATOL


@pytest.mark.parametrize("name", ["token4", "kivi4/4"])
def test_causal_matches_full_precision(name):
    store = filled(name, per_head=False)
    k, v, _, kd, vd = _ref(store, 13)
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(2, 4, 13, 16, generator=gen).to(DEVICE)
    q_sink = torch.randn(2, 4, 13, 16, generator=gen).to(DEVICE)
    q_sink[:, :, :4] = q[:, :, :4]  # as renumbering leaves the queries within the window's reach
    for rule in (dict(), dict(window=4, sinks=2, q_sink=q_sink)):
        got = attention.causal(q, k, v, **rule)
        want = attention.causal(q, kd, vd, **rule)
        assert (got - want).abs().max() <= ATOL


def test_packed_views_are_not_tensors():
    """A packed view decodes only when asked (``decoded()``); a torch function, a tensor method,
    indexing or arithmetic given a view fails instead of decoding the whole cache unseen."""
    store = filled("kivi4/4")
    k, v, _ = store.view(24)
    dense = k.decoded()
    assert k.detach() is k and k.shape == dense.shape and k.dtype == torch.float32
    tail = torch.randn(2, 2, 3, 16, device=DEVICE)
    assert torch.equal(k.with_tail(tail).decoded(), torch.cat((dense, tail), dim=2))
    for use in (lambda: torch.linalg.vector_norm(k, dim=-1), lambda: k.float(), lambda: k[:, 1],
                lambda: 2 * k, lambda: torch.cat((k, tail), dim=2)):
        with pytest.raises((TypeError, AttributeError)):
            use()


@pytest.mark.parametrize("policy", ["dense:int4", "h2o:int4", "h2o:int2", "window:int8", "tova:int4"])
def test_nothing_decodes_a_whole_cache(llama, monkeypatch, policy):
    """Decode steps of the policies that do not read keys or values for their own ranking never
    decode a packed view; attention converts at most one block of codes at a time. (A chunk of
    several tokens attends its slots decoded, transiently, one layer at a time: at the cost of
    dense attention, with a peak no higher than dense's, as benchmarks/prefill.py measures.)"""
    def refuse(self, *args):
        raise AssertionError("a packed view was decoded")

    from kvcache.quant import packed

    largest = []
    real = packed.as_float
    recorded = lambda c, bits, work=None: largest.append(c.shape[2]) or real(c, bits, work)  # noqa: E731
    monkeypatch.setattr(packed, "as_float", recorded)
    monkeypatch.setattr(blocked, "as_float", recorded)
    cache = kvcache.make_cache(llama, policy, cache_length=180 if policy.startswith("dense") else 160,
                               options={"recent": 8} if "h2o" in policy else None)
    ids = torch.randint(3, 128, (1, 180), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    with torch.inference_mode():
        llama(ids[:, :130], cache)
        largest.clear()
        monkeypatch.setattr(PackedKeys, "decoded", refuse)
        monkeypatch.setattr(PackedValues, "decoded", refuse)
        for t in range(130, 180):
            llama(ids[:, t : t + 1], cache)
    # A block holds whole key groups: 64 slots for int4 and int2, BLOCK for per-token layouts.
    # On CUDA the Triton kernel reads decode steps' codes in place: no block is converted at all.
    assert largest or DEVICE.type == "cuda"
    assert max(largest, default=0) <= max(blocked.BLOCK, cache.layers[0].storage.__dict__.get("key_group", 0))


@pytest.mark.parametrize("name", ["kivi4/4", "kivi2/8"])
def test_channel_scores_of_a_partial_group_ignore_the_buffer_rows_past_it(name):
    """Per-channel scores whose last group is partial read its missing slots from the
    conversion buffer's rows past the span (one batched product, no copy): whatever those rows
    hold (NaN here), the scores are the ones computed without the buffer."""
    store = filled(name)
    k, _, _ = store.view(25)
    m = 25  # groups of 4 or 8: the last one holds a single slot of the span
    q = torch.randn(2, 2, 3, 16, generator=torch.Generator().manual_seed(4))
    want = k.scores(q, None, 0, m)
    rows = -(-m // k.group) * k.group
    work = torch.full((2, 2, rows, 16), float("nan"))
    got = k.scores(q, None, 0, m, work)
    assert torch.isfinite(got).all()
    assert (got - want).abs().max() <= 1e-6
