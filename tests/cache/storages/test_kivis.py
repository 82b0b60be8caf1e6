"""KIVI with full-precision sinks (``kivis``): the first positions read back exactly wherever they
are kept, every other slot exactly as KIVI reads it, and attention over the views equals
attention over what they decode to."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE

import kvcache
from kvcache.cache import CacheSpec
from kvcache.cache.registry import make_cache
from kvcache.cache.storages import make_storage
from kvcache.cache.storages.kivis import SINKS
from kvcache.kernels import attention, blocked


def _store(name: str, B=2, H=2, C=64, D=16, dtype=torch.float32):
    spec = CacheSpec(batch_size=B, num_kv_heads=H, head_dim=D, cache_length=C, dtype=dtype, device=DEVICE,
                     storage=name)
    return make_storage(spec)


def _tokens(gen, B, H, T, D):
    """Keys and values whose first token is far larger than the rest, as a sink's are."""
    k = torch.randn(B, H, T, D, generator=gen)
    v = torch.randn(B, H, T, D, generator=gen)
    k[:, :, 0] *= 20
    v[:, :, 0] *= 5
    return k.to(DEVICE), v.to(DEVICE)


@pytest.mark.parametrize("bits", [4, 2])
def test_sinks_read_back_exactly_and_the_rest_as_kivi(bits):
    """After a chunk of 40 tokens (and 3 decode steps), slots 0-3 decode to the very keys and
    values written; every other slot to what kivi decodes from the same writes."""
    gen = torch.Generator().manual_seed(0)
    B, H, D = 2, 2, 16
    k, v = _tokens(gen, B, H, 43, D)
    sinks, plain = _store(f"kivis{bits}/16"), _store(f"kivi{bits}/16")
    for store in (sinks, plain):
        store.write_slice(0, k[:, :, :40], v[:, :, :40], torch.arange(40, device=DEVICE).expand(B, 40))
        for t in range(40, 43):
            store.write_slice(t, k[:, :, t : t + 1], v[:, :, t : t + 1], torch.full((B, 1), t, device=DEVICE))
    ks, vs, _ = sinks.view(43)
    kp, vp, _ = plain.view(43)
    assert torch.equal(ks.decoded()[:, :, :SINKS], k[:, :, :SINKS])
    assert torch.equal(vs.decoded()[:, :, :SINKS], v[:, :, :SINKS])
    assert torch.equal(ks.decoded()[:, :, SINKS:], kp.decoded()[:, :, SINKS:])
    assert torch.equal(vs.decoded()[:, :, SINKS:], vp.decoded()[:, :, SINKS:])
    # KIVI's own codes of the sinks are off, the more so at 2 bits: the copies are what pays.
    assert not torch.equal(kp.decoded()[:, :, :SINKS], k[:, :, :SINKS])


def test_sinks_follow_a_keep():
    """A keep that moves the stored sinks to other slots and brings new tokens: every slot holding
    a position below SINKS reads that position's key and value exactly."""
    gen = torch.Generator().manual_seed(1)
    B, H, C, D = 1, 2, 8, 16
    k, v = _tokens(gen, B, H, C + 4, D)
    store = _store("kivis4/4", B=B, H=H, C=C, D=D)
    store.write_slice(0, k[:, :, :C], v[:, :, :C], torch.arange(C, device=DEVICE).expand(B, C))
    ks, vs, pos = store.view(C)
    new_k, new_v = store.roundtrip(k[:, :, C:], v[:, :, C:])
    # Every head of a row shares its slots: positions and the index are (B, 1, .).
    cand_pos = torch.cat((pos, torch.arange(C, C + 4, device=DEVICE).expand(B, 1, 4)), dim=2)
    index = torch.tensor([11, 3, 9, 0, 2, 10, 1, 8], device=DEVICE).expand(B, 1, C)
    store.keep(ks.with_tail(new_k), vs.with_tail(new_v), cand_pos, index, stored=C)
    keys, values, pos = store.view(C)
    kd, vd = keys.decoded(), values.decoded()
    for slot, p in enumerate(index[0, 0].tolist()):
        if p < SINKS:
            assert torch.equal(kd[:, :, slot], k[:, :, p])
            assert torch.equal(vd[:, :, slot], v[:, :, p])
    assert sorted(p for p in pos[0, 0].tolist() if p < SINKS) == [0, 1, 2, 3]


def test_a_first_chunk_kept_from_its_roundtrip_keeps_its_sinks_exact():
    """An evicting cache's first chunk, larger than the cache, is attended as the roundtrip reads
    it (values coded) and then kept: the sinks' copies are the values as given, not as read."""
    gen = torch.Generator().manual_seed(3)
    B, H, C, D = 1, 2, 8, 16
    k, v = _tokens(gen, B, H, 12, D)
    store = _store("kivis4/4", B=B, H=H, C=C, D=D)
    rk, rv = store.roundtrip(k, v)
    assert not torch.equal(rv[:, :, :SINKS], v[:, :, :SINKS])
    index = torch.tensor([0, 1, 2, 3, 8, 9, 10, 11], device=DEVICE).expand(B, 1, C)
    store.keep(rk, rv, torch.arange(12, device=DEVICE).expand(B, 1, 12), index, stored=0)
    keys, values, _ = store.view(C)
    assert torch.equal(keys.decoded()[:, :, :SINKS], k[:, :, :SINKS])
    assert torch.equal(values.decoded()[:, :, :SINKS], v[:, :, :SINKS])


def test_decode_attention_over_the_views_equals_attention_over_their_decoding():
    """The blocked kernel reads sinks from their copies: its output equals full-precision
    attention over the decoded slots, with a mask and the attention mass."""
    gen = torch.Generator().manual_seed(2)
    B, H, G, D, T = 2, 2, 3, 16, 70
    k, v = _tokens(gen, B, H, T, D)
    store = _store("kivis4/16", B=B, H=H, C=80, D=D)
    store.write_slice(0, k, v, torch.arange(T, device=DEVICE).expand(B, T))
    ks, vs, _ = store.view(T)
    q = torch.randn(B, H * G, 1, D, generator=gen).to(DEVICE)
    visible = torch.rand(B, 1, T, generator=gen).to(DEVICE) > 0.3
    out, mass = blocked.decode(q, ks, vs, visible, want_mass=True)
    ref, ref_mass = attention.decode(q, ks.decoded(), vs.decoded(), visible, want_mass=True)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mass, ref_mass, rtol=1e-5, atol=1e-6)


# How far the sinks' copies may be from the full-precision cache's keys and values of the same
# prompt: dense attends its chunks as full precision does at the first positions (bitwise), h2o
# within float rounding; sink (a ring) attends its first chunk with KIVI's read-back values, so
# the later layers' keys at positions 1-3 are what that computed, not full precision's.
COPY_TOLERANCE = {"dense": 0.0, "h2o": 1e-5, "sink": None}


@pytest.mark.parametrize("policy", ["dense", "sink", "h2o"])
def test_generation_keeps_the_sinks(llama, policy):
    """Through a model under a policy that fills, evicts and decodes: the tokens come out, every
    layer still holds the first SINKS positions, its view reads their slots from the copies, and
    the copies are the keys and values a full-precision dense cache holds for them."""
    prompt = list(range(5, 45))
    cache = make_cache(llama, f"{policy}:kivis4/8", cache_length=60 if policy == "dense" else 24)
    out = kvcache.generate(llama, prompt, max_new_tokens=6, cache=cache, stop_tokens=(), prefill_chunk=16)
    assert len(out) == 6
    full = make_cache(llama, "dense", cache_length=60)
    kvcache.generate(llama, prompt, max_new_tokens=6, cache=full, stop_tokens=(), prefill_chunk=16)
    for layer, exact in zip(cache.layers, full.layers):
        store = layer.storage
        keys, values, pos = store.view(store.pos.shape[2] - 1)
        kd, vd = keys.decoded(), values.decoded()
        for b in range(kd.shape[0]):
            for h in range(kd.shape[1]):
                slots = [(s, p) for s, p in enumerate(pos[b, min(h, pos.shape[1] - 1)].tolist()) if 0 <= p < SINKS]
                assert sorted(p for _, p in slots) == list(range(SINKS))
                for s, p in slots:
                    assert torch.equal(kd[b, h, s], store.k_sink[b, h, p])
                    assert torch.equal(vd[b, h, s], store.v_sink[b, h, p])
        tol = COPY_TOLERANCE[policy]
        if tol is not None:
            torch.testing.assert_close(store.k_sink[:, :, :SINKS], exact.storage.k[:, :, :SINKS], rtol=0, atol=tol)
            torch.testing.assert_close(store.v_sink[:, :, :SINKS], exact.storage.v[:, :, :SINKS], rtol=0, atol=tol)
