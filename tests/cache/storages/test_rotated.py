"""``rtoken``: per-token codes of rotated keys and values (kvcache/cache/storages/rotated.py).
The storage contract, bytes, kernels and generation are checked with every storage in
test_storage.py and tests/kernels; here, what the rotation itself promises."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE

from kvcache.cache import CacheSpec
from kvcache.cache.storages import make_storage
from kvcache.quant.codes import decode_tokens, encode_tokens
from kvcache.quant.rotation import rotation


def spec(storage: str, D: int = 64, C: int = 40) -> CacheSpec:
    return CacheSpec(batch_size=2, num_kv_heads=2, head_dim=D, cache_length=C, dtype=torch.float32,
                     device=DEVICE, storage=storage)


def keys_with_large_channels(T: int = 32, D: int = 64, seed: int = 0) -> torch.Tensor:
    """(2, 2, T, D): Gaussian keys with two large channels of fixed sign, as keys after RoPE have."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 2, T, D, generator=g)
    x[..., 3] += 12.0
    x[..., 40] -= 8.0
    return x.to(DEVICE)


def stored(name: str, x: torch.Tensor):
    store = make_storage(spec(name, D=x.shape[-1]))
    T = x.shape[2]
    store.write_slice(0, x, x, torch.arange(T, device=DEVICE).expand(2, T))
    return store


def test_slots_hold_the_per_token_codes_of_the_rotated_vectors():
    x = keys_with_large_channels()
    store = stored("rtoken4", x)
    R = rotation(64, DEVICE)
    codes, meta = encode_tokens(x @ R, 4, 64)
    assert torch.equal(store.k[:, :, :32], codes) and torch.equal(store.k_meta[:, :, :32], meta)
    k, v, _ = store.view(32)
    want = decode_tokens(codes, meta, 4, torch.float32) @ R.T
    torch.testing.assert_close(k.decoded(), want, rtol=0, atol=1e-5)
    torch.testing.assert_close(v.decoded(), want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("bits", [4, 3])
def test_rotation_lowers_the_error_of_keys_with_large_channels(bits):
    """The reason for the layout: the same bytes as ``token``, a fraction of its error."""
    x = keys_with_large_channels(seed=bits)
    err = {}
    for layout in ("token", "rtoken"):
        store = stored(f"{layout}{bits}", x)
        assert store.nbytes() == make_storage(spec(f"token{bits}")).nbytes()
        k, _, _ = store.view(32)
        err[layout] = (k.decoded() - x).square().mean().item()
    assert err["rtoken"] < 0.5 * err["token"], err


def test_a_chunk_attends_what_is_stored():
    """``roundtrip`` is exact: what a chunk attends is what the slots read back once written."""
    x = keys_with_large_channels(T=8)
    store = make_storage(spec("rtoken3"))
    k, v = store.roundtrip(x, x)
    store.write_slice(0, k, v, torch.arange(8, device=DEVICE).expand(2, 8))
    kv, vv, _ = store.view(8)
    assert torch.equal(kv.decoded(), k) and torch.equal(vv.decoded(), v)
    assert torch.equal(store.read_back(0, 8)[0], k)


def test_scores_and_mixes_equal_attention_over_the_decoded_slots():
    x = keys_with_large_channels(T=24)
    store = stored("rtoken4/16", x)
    k, v, _ = store.view(24)
    q = torch.randn(2, 2, 3, 64, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    torch.testing.assert_close(k.scores(q, None, 0, 24), q @ k.decoded().transpose(-1, -2), rtol=1e-5, atol=1e-4)
    p = torch.softmax(torch.randn(2, 2, 3, 24, generator=torch.Generator().manual_seed(8)), -1).to(DEVICE)
    torch.testing.assert_close(v.mix(p, 0, 24), p @ v.decoded(), rtol=1e-5, atol=1e-5)
    # One row alone reads as the whole view's row (``rows`` slices the rotation with the rest).
    torch.testing.assert_close(k.rows(slice(1, 2)).decoded(), k.decoded()[1:2])
