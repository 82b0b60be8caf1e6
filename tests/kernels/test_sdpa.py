"""kvcache's SDPA calls (kvcache/kernels/sdpa.py): PyTorch's attention, without cuDNN's backend in
eager CUDA calls, and nothing of the backend settings changed after a call."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE

from kvcache.kernels.sdpa import sdpa


def _inputs(T: int, S: int):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, T, 16, generator=g).to(DEVICE)
    k = torch.randn(2, 2, S, 16, generator=g).to(DEVICE)
    v = torch.randn(2, 2, S, 16, generator=g).to(DEVICE)
    return q, k, v


@pytest.mark.parametrize("case", ["causal", "mask", "decode"])
def test_sdpa_is_pytorchs_attention(case):
    q, k, v = _inputs(1 if case == "decode" else 7, 7 if case != "decode" else 9)
    mask = torch.rand(2, 1, q.shape[2], k.shape[2], generator=torch.Generator().manual_seed(1)).to(DEVICE) > 0.3
    mask[..., 0] = True
    kwargs = {"causal": dict(is_causal=True), "mask": dict(attn_mask=mask), "decode": {}}[case]
    got = sdpa(q, k, v, enable_gqa=True, **kwargs)
    # The math backend: what every backend computes, in float32 to within rounding.
    with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.MATH]):
        want = F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kwargs)
    assert got.shape == want.shape
    assert (got - want).abs().max() <= 1e-5


@pytest.mark.skipif(DEVICE.type != "cuda", reason="backend choice is a CUDA matter")
def test_sdpa_leaves_out_cudnn_during_the_call_and_restores_the_settings(monkeypatch):
    q, k, v = (t.to(torch.bfloat16) for t in _inputs(1, 300))
    during = []
    native = F.scaled_dot_product_attention

    def recording(*args, **kwargs):
        during.append((torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled()))
        return native(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    before = torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled()
    sdpa(q, k, v, enable_gqa=True)
    assert during == [(False, before[1])]
    assert (torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled()) == before


@pytest.mark.skipif(DEVICE.type != "cuda", reason="backend choice is a CUDA matter")
def test_sdpa_keeps_a_backend_the_caller_turned_off_off():
    q, k, v = (t.to(torch.bfloat16) for t in _inputs(1, 300))
    with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.MATH]):
        want = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        got = sdpa(q, k, v, enable_gqa=True)  # math alone, as the caller asked: the same kernel
        assert not torch.backends.cuda.flash_sdp_enabled()
    assert torch.equal(got, want)
