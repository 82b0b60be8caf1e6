"""Attention kernels against a naive reference (explicit mask, repeated K/V heads)."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE, atol

from kvcache.kernels import attention


def _reference(q, k, v, q_pos, k_pos, window=None):
    """Naive attention: q (B, Hq, T, D), k/v (B, Hkv, S, D), q_pos (B, T), k_pos (B, S)."""
    G = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(G, dim=1)
    v = v.repeat_interleave(G, dim=1)
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    qp, kp = q_pos[:, None, :, None], k_pos[:, None, None, :]
    visible = (kp >= 0) & (kp <= qp)
    if window is not None:
        visible &= kp > qp - window
    scores = scores.masked_fill(~visible, float("-inf"))
    return scores.softmax(-1) @ v


def _qkv(B, Hq, Hkv, T, S, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(B, Hq, T, D, generator=g).to(DEVICE),
        torch.randn(B, Hkv, S, D, generator=g).to(DEVICE),
        torch.randn(B, Hkv, S, D, generator=g).to(DEVICE),
    )


@pytest.mark.parametrize("Hq,Hkv", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("window", [None, 1, 3])
def test_causal_matches_reference(Hq, Hkv, window):
    q, k, v = _qkv(2, Hq, Hkv, 9, 9)
    pos = torch.arange(9, device=DEVICE).expand(2, 9)
    out = attention.causal(q, k, v, window=window)
    assert out.shape == q.shape
    assert torch.allclose(out, _reference(q, k, v, pos, pos, window), atol=atol("cache"))


@pytest.mark.parametrize("Hq,Hkv", [(4, 2), (6, 1)])
@pytest.mark.parametrize("window,sinks,limit", [(3, 2, None), (5, 1, 4), (20, 2, 6), (4, 0, None)])
def test_causal_with_a_window_and_sinks_matches_masked(Hq, Hkv, window, sinks, limit):
    """Queries within the window's reach take the fused kernel, the rest a masked call: together
    they equal one masked call over the whole span with the same rule."""
    q, k, v = _qkv(2, Hq, Hkv, 11, 11, seed=3)
    pos = torch.arange(11, device=DEVICE).expand(2, 11)
    out = attention.causal(q, k, v, window=window, sinks=sinks, limit=limit)
    want = attention.masked(q, k, v, pos, pos.unsqueeze(1), window=window, sinks=sinks, limit=limit)
    assert out.shape == q.shape
    assert torch.allclose(out, want, atol=atol("cache"))
    if sinks == 0 and limit is None:
        assert torch.allclose(out, _reference(q, k, v, pos, pos, window), atol=atol("cache"))


@pytest.mark.parametrize("window,sinks,limit", [(100, 4, None), (120, 0, 90), (64, 3, 300)])
@pytest.mark.parametrize("renumbered", [False, True])
def test_causal_bands_a_long_windowed_span(window, sinks, limit, renumbered):
    """Past the window's reach, queries go in blocks over their band of keys (several blocks
    here, most starting past the sinks). With ``q_sink`` the sink keys are scored by it: the
    result equals the explicit-softmax path that scores them so."""
    T = 2 * attention.BAND_BLOCK + 90
    q, k, v = _qkv(1, 4, 2, T, T, seed=4)
    pos = torch.arange(T, device=DEVICE).expand(1, T)
    reach = min(window, limit or T)
    q_sink = None
    if renumbered:
        g = torch.Generator().manual_seed(5)
        q_sink = q.clone()
        q_sink[:, :, reach:] = torch.randn(q[:, :, reach:].shape, generator=g).to(DEVICE)
    out = attention.causal(q, k, v, window=window, sinks=sinks, limit=limit, q_sink=q_sink)
    want, _, _ = attention.masked_with_weights(q, k, v, pos, pos.unsqueeze(1), torch.ones(1, T, device=DEVICE),
                                               window=window, sinks=sinks, limit=limit, q_sink=q_sink)
    assert torch.allclose(out, want, atol=atol("cache"))


@pytest.mark.parametrize("window", [None, 4])
def test_masked_positions_as_data(window):
    """Queries at positions 7..9 over 12 slots holding shuffled positions, some empty."""
    q, k, v = _qkv(2, 4, 2, 3, 12, seed=1)
    q_pos = torch.tensor([[7, 8, 9], [3, 4, 5]], device=DEVICE)
    k_pos = torch.stack([torch.randperm(12, generator=torch.Generator().manual_seed(s)).to(DEVICE) for s in (0, 1)])
    k_pos[:, 10:] = -1  # empty slots
    # Invisible slots carry huge values: attending to any of them would show.
    v = v.masked_fill(((k_pos < 0) | (k_pos > 9))[:, None, :, None], 1e4)
    out = attention.masked(q, k, v, q_pos, k_pos[:, None], window=window)
    ref = _reference(q, k, v, q_pos, k_pos, window)
    assert torch.allclose(out, ref, atol=atol("cache"))
    assert out.abs().max() < 100


@pytest.mark.parametrize("window", [None, 4])
def test_masked_per_head_slots(window):
    """Per-head slot positions (B, Hkv, S) take the folded path; each K/V head's group of query
    heads is masked by its own positions. A shared mask (B, 1, S) takes the broadcast path; the
    two agree when every head holds the same positions."""
    q, k, v = _qkv(2, 6, 3, 3, 10, seed=4)
    q_pos = torch.tensor([[7, 8, 9], [5, 6, 7]], device=DEVICE)
    gen = torch.Generator().manual_seed(5)
    k_pos = torch.stack([torch.stack([torch.randperm(10, generator=gen).to(DEVICE) for _ in range(3)]) for _ in range(2)])
    k_pos[:, 1, 8:] = -1  # head 1 has empty slots
    out = attention.masked(q, k, v, q_pos, k_pos, window=window)
    for h in range(3):
        group = slice(2 * h, 2 * h + 2)
        ref = _reference(q[:, group], k[:, h : h + 1], v[:, h : h + 1], q_pos, k_pos[:, h], window)
        assert torch.allclose(out[:, group], ref, atol=atol("cache"))
    same = k_pos[:, :1].expand(-1, 3, -1)
    shared = attention.masked(q, k, v, q_pos, k_pos[:, :1], window=window)
    assert torch.allclose(shared, attention.masked(q, k, v, q_pos, same, window=window), atol=atol("same"))


def test_masked_query_blocks(monkeypatch):
    """Long chunks are processed QUERY_BLOCK queries at a time with the same result."""
    q, k, v = _qkv(1, 4, 2, 10, 14, seed=2)
    q_pos = torch.arange(4, 14, device=DEVICE)[None]
    k_pos = torch.arange(14, device=DEVICE)[None]
    whole = attention.masked(q, k, v, q_pos, k_pos[:, None], window=6)
    monkeypatch.setattr(attention, "QUERY_BLOCK", 3)
    blocked = attention.masked(q, k, v, q_pos, k_pos[:, None], window=6)
    assert torch.allclose(blocked, whole, atol=atol("same"))
    assert torch.allclose(blocked, _reference(q, k, v, q_pos, k_pos, 6), atol=atol("cache"))


@pytest.mark.parametrize("window,sinks,limit,renumbered", [(None, 0, None, False), (5, 2, None, True),
                                                            (None, 0, 7, False), (4, 0, None, False)])
def test_weights_of_a_prompt_in_order_read_only_the_slots_before_each_block(monkeypatch, window, sinks, limit,
                                                                             renumbered):
    """``in_order`` (slot s at position s, a prompt alone in an empty cache): each query block
    reads the slots up to its last query only, and the outputs and totals are those of every
    slot read (blocks of 4 queries over 15 slots; slot positions shared by the heads, and per
    head)."""
    T = 15
    q, k, v = _qkv(2, 6, 3, T, T, seed=6)
    pos = torch.arange(T, device=DEVICE).expand(2, T)
    q_sink = None
    if renumbered:
        q_sink = q.clone()
        q_sink[:, :, window:] = torch.randn(q[:, :, window:].shape, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    weight = torch.rand(2, T, generator=torch.Generator().manual_seed(8)).to(DEVICE)
    monkeypatch.setattr(attention, "QUERY_BLOCK", 4)
    rule = dict(window=window, sinks=sinks, limit=limit, q_sink=q_sink)
    for k_pos in (pos.unsqueeze(1), pos.unsqueeze(1).expand(-1, 3, -1)):
        want = attention.masked_with_weights(q, k, v, pos, k_pos, weight, **rule)
        got = attention.masked_with_weights(q, k, v, pos, k_pos, weight, in_order=True, **rule)
        for a, b in zip(got, want):
            assert torch.allclose(a, b, atol=atol("cache"))


def test_weights_alone_give_the_same_totals():
    """``outputs=False`` skips the outputs and changes nothing in the totals it reports."""
    q, k, v = _qkv(2, 4, 2, 9, 13, seed=3)
    q_pos = torch.arange(4, 13, device=DEVICE).expand(2, -1)
    k_pos = torch.arange(13, device=DEVICE).expand(2, 1, -1)
    weight = torch.rand(2, 9, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    out, mass, seen = attention.masked_with_weights(q, k, v, q_pos, k_pos, weight, window=5)
    none, mass_alone, seen_alone = attention.masked_with_weights(q, k, v, q_pos, k_pos, weight, window=5, outputs=False)
    assert none is None and out is not None
    assert torch.equal(mass_alone, mass) and torch.equal(seen_alone, seen)


def test_decode_weights_alone_give_the_same_mass():
    """``decode(outputs=False)`` reads no values and reports the mass ``want_mass`` reports."""
    q, k, v = _qkv(3, 4, 2, 1, 11, seed=4)
    visible = torch.rand(3, 1, 11, generator=torch.Generator().manual_seed(2)).to(DEVICE) > 0.3
    _, mass = attention.decode(q, k, v, visible, want_mass=True)
    none, alone = attention.decode(q, k, None, visible, want_mass=True, outputs=False)
    assert none is None and torch.equal(alone, mass)
    with pytest.raises(ValueError, match="outputs=False asks for the attention mass alone"):
        attention.decode(q, k, v, visible, outputs=False)


def test_all_visible_skips_only_a_redundant_mask():
    q, k, v = _qkv(2, 4, 2, 1, 6, seed=3)
    q_pos = torch.full((2, 1), 5, device=DEVICE)
    k_pos = torch.arange(6, device=DEVICE).expand(2, 1, 6)
    a = attention.masked(q, k, v, q_pos, k_pos)
    b = attention.masked(q, k, v, q_pos, k_pos, all_visible=True)
    assert torch.allclose(a, b, atol=atol("same"))


def test_visibility():
    q_pos = torch.tensor([[2, 5]], device=DEVICE)
    k_pos = torch.tensor([[[0, 1, 2, 3, 4, 5, -1]]], device=DEVICE)
    vis = attention.visibility(q_pos, k_pos, None)
    assert vis.shape == (1, 1, 2, 7)
    assert vis[0, 0].tolist() == [
        [True, True, True, False, False, False, False],
        [True, True, True, True, True, True, False],
    ]
    win = attention.visibility(q_pos, k_pos, 2)
    assert win[0, 0].tolist() == [
        [False, True, True, False, False, False, False],
        [False, False, False, False, True, True, False],
    ]


def test_decode_rejects_renumbered_sinks_with_weights():
    q, k = torch.randn(1, 4, 1, 8, device=DEVICE), torch.randn(1, 2, 5, 8, device=DEVICE)
    with pytest.raises(ValueError, match="q_sink"):
        attention.decode(q, k, k, None, q_sink=q, sink_slots=2, want_mass=True)


def _after_prefix_case(B, Hq, Hkv, P, gap, T, dtype, per_head):
    """q, k, v and positions in ``after_prefix``'s layout: P filled prefix slots holding older
    tokens (per head, a different choice of them with ``per_head``), ``gap`` empty slots, then
    the chunk's T keys, whose queries sit after everything kept."""
    q, k, v = (x.to(dtype) for x in _qkv(B, Hq, Hkv, T, P + gap + T, seed=7 * P + gap + T))
    g = torch.Generator().manual_seed(P + T)
    Hp = Hkv if per_head else 1
    older = torch.stack([torch.randperm(3 * P + 1, generator=g)[:P].sort().values for _ in range(B * Hp)])
    start = 3 * P + 1
    q_pos = torch.arange(start, start + T).expand(B, T)
    k_pos = torch.cat((older.view(B, Hp, P), torch.full((B, Hp, gap), -1), q_pos[:, None].expand(B, Hp, T)), dim=2)
    return q, k, v, q_pos.to(DEVICE), k_pos.to(DEVICE)


@pytest.mark.parametrize("Hq,Hkv", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("P,gap,T", [(0, 0, 5), (1, 0, 1), (7, 0, 5), (40, 0, 16), (9, 3, 6), (0, 4, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per_head", [False, True])
def test_a_chunk_after_a_prefix_it_sees_in_full_is_the_masked_attention(Hq, Hkv, P, gap, T, dtype, per_head):
    """after_prefix (the prefix unmasked and the chunk causal, merged by log-sum-exp) against
    the naive reference and against ``masked``, the path it stands for; its weights against
    ``masked_with_weights``'s."""
    q, k, v, q_pos, k_pos = _after_prefix_case(2, Hq, Hkv, P, gap, T, dtype, per_head)
    tol = atol("cache", dtype)
    out = attention.after_prefix(q, k, v, q_pos, k_pos, P)
    masked = attention.masked(q, k, v, q_pos, k_pos)
    assert out.dtype == dtype and out.shape == q.shape
    assert torch.allclose(out.float(), masked.float(), atol=tol)
    if not per_head:
        want = _reference(q.float(), k.float(), v.float(), q_pos, k_pos[:, 0])
        assert torch.allclose(out.float(), want, atol=tol)
    weight = torch.rand(2, T, generator=torch.Generator().manual_seed(T)).to(DEVICE)
    got = attention.after_prefix_with_weights(q, k, v, q_pos, k_pos, P, weight)
    want = attention.masked_with_weights(q, k, v, q_pos, k_pos, weight)
    assert torch.equal(got[0], out)  # the outputs are the fused calls'
    assert got[1].shape == want[1].shape and got[2].shape == want[2].shape
    # Mass sums up to G * T weights of one: the tolerance scales with it.
    assert torch.allclose(got[1], want[1], atol=tol * Hq // Hkv * T, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5)
    assert torch.allclose(got[2], want[2])
    # Under autograd (training's replay) no fused call gives the log-sum-exp: the masked calls, exactly.
    grad = attention.after_prefix(q.clone().requires_grad_(), k, v, q_pos, k_pos, P)
    assert torch.equal(grad.detach(), masked) if P else torch.allclose(grad.detach().float(), masked.float(), atol=tol)
    grad = attention.after_prefix_with_weights(q.clone().requires_grad_(), k, v, q_pos, k_pos, P, weight)
    want_mass = attention.masked_with_weights(q, k, v, q_pos, k_pos, weight, in_order=False)[1]
    assert torch.equal(grad[1], want_mass) and torch.equal(grad[2], want[2])


def test_a_prompt_alone_with_weights_is_the_causal_call_bit_for_bit():
    """With no prefix, the outputs are those of the causal call a dense prompt takes, so one dense
    prefill can fill a scoring policy's cache."""
    q, k, v, q_pos, k_pos = _after_prefix_case(1, 4, 2, 0, 0, 37, torch.float32, per_head=True)
    out, mass, _ = attention.after_prefix_with_weights(q, k, v, q_pos, k_pos, 0, torch.ones(1, 37, device=DEVICE))
    assert torch.equal(out, attention.causal(q, k, v))
    # Every query head's weights sum to one: Hq x T of them in all.
    assert torch.allclose(mass.sum(), torch.tensor(4 * 37.0, device=DEVICE), rtol=1e-5)
