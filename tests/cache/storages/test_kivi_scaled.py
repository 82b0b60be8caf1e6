"""2-bit KIVI keys per channel with a scale per key (quant/codes.py ``quantize_scaled``) and values
in groups of channels: the storage against a reference built from the codes' definition, every
path that seals a group (a chunk, decode steps, a keep) and the one that moves a key out of it."""

from __future__ import annotations

import torch
from conftest import DEVICE

from kvcache.cache import CacheSpec
from kvcache.cache.storages import in_place, make_storage
from kvcache.cache.storages.kivi import CHANNEL_MARK, KiviStorage
from kvcache.kernels import CHANNEL, RESIDUAL, TOKEN, blocked
from kvcache.quant.codes import MIN_TOKEN_SCALE, encode_tokens, key_clip, quantize, quantize_scaled, unpack


def _store(name="kivi2/16", D=16, H=2, C=64, B=1) -> KiviStorage:
    spec = CacheSpec(batch_size=B, num_kv_heads=H, head_dim=D, cache_length=C, dtype=torch.float32, device=DEVICE,
                     storage=name)
    return make_storage(spec)


def _keys(gen, B, H, T, D):
    """Keys whose norms vary from token to token, around a few large fixed-sign channels."""
    norm = torch.rand(B, H, T, 1, generator=gen) * 3 + 0.2
    return ((torch.randn(B, H, T, D, generator=gen) + torch.linspace(-2, 4, D)) * norm).to(DEVICE)


def _reference_keys(x: torch.Tensor) -> torch.Tensor:
    """A group of keys (..., G, D) as ``quantize_scaled`` defines their reading."""
    q, scale, zero, t = quantize_scaled(x, 2, clip=key_clip(2))
    return (q.float() * scale.float() + zero.float()) * t.float()


def test_quantize_scaled_fits_each_key_scale():
    """Codes are per channel over the group of x / rms; each key's scale is the least-squares
    factor of its decoded codes (never worse than its rms), positive, in fp16. On keys whose norms
    vary, the error is well below plain per-channel codes'."""
    gen = torch.Generator().manual_seed(0)
    x = _keys(gen, 2, 3, 64, 32)
    q, scale, zero, t = quantize_scaled(x, 2, clip=key_clip(2))
    assert q.dtype == torch.uint8 and int(q.max()) <= 3 and scale.shape == zero.shape == (2, 3, 1, 32)
    assert t.dtype == torch.float16 and t.shape == (2, 3, 64, 1) and bool((t.float() >= MIN_TOKEN_SCALE).all())
    rms = x.square().mean(-1, keepdim=True).sqrt().half().float()
    q_ref, s_ref, z_ref = quantize(x / rms, 2, dim=-2, clip=key_clip(2))
    assert torch.equal(q, q_ref) and torch.equal(scale, s_ref) and torch.equal(zero, z_ref)
    u = q.float() * scale.float() + zero.float()
    fit = ((x * u).sum(-1, keepdim=True) / u.square().sum(-1, keepdim=True)).half().float()
    assert torch.equal(t.float(), fit)
    err = ((u * t.float() - x) ** 2).sum(-1)
    assert bool((err <= ((u * rms - x) ** 2).sum(-1) * (1 + 1e-3) + 1e-5).all())
    qp, sp, zp = quantize(x, 2, dim=-2, clip=key_clip(2))
    plain = ((qp.float() * sp.float() + zp.float() - x) ** 2).sum()
    assert float(err.sum()) < 0.8 * float(plain)
    # Given scales are kept, and their keys divided by them (the others by their rms).
    given = torch.where(torch.arange(64, device=DEVICE)[:, None] < 40, t, torch.zeros_like(t))
    q2, s2, z2, t2 = quantize_scaled((u * t.float()), 2, given=given)
    assert torch.equal(t2[..., :40, :], t[..., :40, :])
    qg, sg, zg = quantize((u * t.float()) / torch.where(given > 0, given.float(), (u * t.float()).square().mean(
        -1, keepdim=True).sqrt().half().float()), 2, dim=-2)
    assert torch.equal(q2, qg) and torch.equal(s2, sg)
    # A group of zero keys comes back as zeros.
    q0, s0, z0, t0 = quantize_scaled(torch.zeros(1, 1, 8, 4, device=DEVICE), 2)
    assert float(((q0.float() * s0.float() + z0.float()) * t0.float()).abs().max()) == 0.0


def test_kivi2_keys_read_back_as_the_reference_whatever_the_writes():
    """A chunk and decode steps seal the same groups to the same codes, per-channel scales and
    per-key scales (negated in ``k_meta``); the view reads them back exactly as the reference,
    the open group at full precision; values are coded in 4 groups of channels."""
    gen = torch.Generator().manual_seed(1)
    B, H, T, D, G = 2, 2, 40, 16, 16
    k, v = _keys(gen, B, H, T, D), torch.randn(B, H, T, D, generator=gen).to(DEVICE)
    pos = torch.arange(T, device=DEVICE).expand(B, T)
    chunk, steps = _store(B=B), _store(B=B)
    assert chunk.key_token_scale and chunk.group == D // 4
    chunk.write_slice(0, k, v, pos)
    for t in range(T):
        steps.write_slice(t, k[:, :, t : t + 1], v[:, :, t : t + 1], pos[:, t : t + 1])
    for name in ("k", "v", "k_meta", "v_meta", "k_channel"):
        assert torch.equal(getattr(chunk, name), getattr(steps, name)), name
    assert chunk.k_mode[0, 0, :T].tolist() == [CHANNEL] * 32 + [RESIDUAL] * 8
    keys, values, _ = chunk.view(T)
    got = keys.decoded()
    for g in range(2):
        ref = _reference_keys(k[:, :, g * G : (g + 1) * G])
        assert torch.equal(got[:, :, g * G : (g + 1) * G], ref)
        assert bool((chunk.k_meta[:, :, g * G : (g + 1) * G, 0] < 0).all())
    assert torch.equal(got[:, :, 32:], k[:, :, 32:])
    assert torch.equal(chunk.v[:, :, :32], encode_tokens(v[:, :, :32], 2, D // 4)[0])
    assert torch.equal(values.decoded()[:, :, 32:], v[:, :, 32:])


def test_kivi2_attention_over_codes_matches_the_decoded_cache():
    """The blocked kernel, which scales per-channel scores by each key's own scale, against
    attention over the decoded keys and values."""
    gen = torch.Generator().manual_seed(2)
    B, H, T, D = 1, 2, 50, 16
    store = _store(B=B)
    k, v = _keys(gen, B, H, T, D), torch.randn(B, H, T, D, generator=gen).to(DEVICE)
    store.write_slice(0, k, v, torch.arange(T, device=DEVICE)[None])
    keys, values, _ = store.view(T)
    q = torch.randn(B, 2 * H, 1, D, generator=gen).to(DEVICE)
    out, _ = blocked.decode(q, keys, values, None)
    kd, vd = keys.decoded().repeat_interleave(2, 1), values.decoded().repeat_interleave(2, 1)
    ref = torch.softmax((q @ kd.transpose(-1, -2)) * D**-0.5, -1) @ vd
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5)


def test_kivi2_keep_moves_and_reseals_keys_with_their_scales():
    """A keep in rank order moves per-channel keys: each is re-coded per token from its reading
    (its own scale included); placed in place, the groups are sealed again with new tokens, every
    key scaled by its own (a kept key keeps the one it had: sealing again does not drift), within
    the reach of 2-bit codes of what was written."""
    C, _G, D = 64, 16, 16
    gen = torch.Generator().manual_seed(3)
    x = _keys(gen, 1, 2, C, D)
    new = _keys(gen, 1, 2, 16, D)
    index = torch.rand(1, 1, C + 16, generator=gen).argsort(-1, descending=True)[..., :C].to(DEVICE)
    for placement in ("rank", "in_place"):
        store = _store(C=C)
        store.write_slice(0, x, x, torch.arange(C, device=DEVICE)[None])
        assert bool((store.k_mode[:, :, :C] == CHANNEL).all())
        ks, vs, pos = store.view(C)
        before, own = ks.decoded(), store.k_meta[:, :, :C, 0].clone()
        cand_pos = torch.cat((pos, torch.arange(C, C + 16, device=DEVICE)[None, None]), 2)
        idx = index if placement == "rank" else in_place(index, C)[0]
        store.keep(ks.with_tail(new), vs.with_tail(new), cand_pos, idx, stored=C)
        mode = store.k_mode[:, :, :C]
        got = store.view(C)[0].decoded()
        src = idx.expand(1, 2, C)
        slot = torch.arange(C, device=DEVICE)
        if placement == "rank":
            moved = (src < C) & (src != slot) & (mode == TOKEN)
            assert int(moved.sum()) > C // 2
            old = before.gather(2, src.clamp(max=C - 1)[..., None].expand(1, 2, C, D))
            codes, meta = encode_tokens(old, 2, D)
            assert torch.equal(torch.where(moved[..., None], store.k[:, :, :C], 0), torch.where(moved[..., None], codes, 0))
            assert torch.equal(torch.where(moved[..., None], store.k_meta[:, :, :C], 0),
                               torch.where(moved[..., None], meta, 0))
        else:
            assert bool((mode == CHANNEL).all()) and bool((store.k_meta[:, :, :C, 0] < 0).all())
            stays = src == slot
            assert int(stays.sum()) > C
            assert torch.equal(store.k_meta[:, :, :C, 0][stays], own[stays])
            written = torch.cat((x, new), 2).gather(2, src[..., None].expand(1, 2, C, D))
            rel = ((got - written) ** 2).sum() / (written**2).sum()
            assert float(rel) < 0.1


def test_4_and_8_bit_keys_are_marked_and_read_as_before():
    """Widths without per-key scales keep ``CHANNEL_MARK`` (a factor of 1) and one value group:
    their keys read back exactly as plain per-channel codes."""
    gen = torch.Generator().manual_seed(4)
    for bits in (4, 8):
        store = _store(f"kivi{bits}/16")
        assert not store.key_token_scale and store.group == 16
        k = _keys(gen, 1, 2, 16, 16)
        store.write_slice(0, k, k, torch.arange(16, device=DEVICE)[None])
        assert bool((store.k_meta[:, :, :16] == CHANNEL_MARK).all())
        q, scale, zero = quantize(k, bits, dim=2)
        assert torch.equal(unpack(store.k[:, :, :16], bits), q)
        assert torch.equal(store.view(16)[0].decoded(), q.float() * scale.float() + zero.float())


def test_3_bit_keys_take_a_scale_each_in_clipped_ranges():
    """3-bit KIVI keys are sealed as 2-bit ones are (a scale per key, a clipped range per channel,
    its own candidates), chunk or steps alike; values stay in one group of channels."""
    gen = torch.Generator().manual_seed(5)
    B, H, T, D = 1, 2, 40, 16
    k, v = _keys(gen, B, H, T, D), torch.randn(B, H, T, D, generator=gen).to(DEVICE)
    pos = torch.arange(T, device=DEVICE).expand(B, T)
    chunk, steps = _store("kivi3/16"), _store("kivi3/16")
    assert chunk.key_token_scale and chunk.group == D and key_clip(3) and key_clip(3) != key_clip(2)
    chunk.write_slice(0, k, v, pos)
    for t in range(T):
        steps.write_slice(t, k[:, :, t : t + 1], v[:, :, t : t + 1], pos[:, t : t + 1])
    for name in ("k", "v", "k_meta", "v_meta", "k_channel"):
        assert torch.equal(getattr(chunk, name), getattr(steps, name)), name
    got = chunk.view(T)[0].decoded()
    for g in range(2):
        q, scale, zero, t = quantize_scaled(k[:, :, g * 16 : (g + 1) * 16], 3, clip=key_clip(3))
        assert torch.equal(got[:, :, g * 16 : (g + 1) * 16], (q.float() * scale.float() + zero.float()) * t.float())
    assert torch.equal(got[:, :, 32:], k[:, :, 32:])
