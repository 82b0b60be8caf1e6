"""kvcache/parts against transformers' own modules: the same weights and inputs give the same
outputs, in float32 and in bfloat16 (where the order of the cast and the scaling shows)."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE, atol, max_diff

from kvcache.model.config import ModelConfig
from kvcache.model.mlp import MLP
from kvcache.model.norm import GemmaRMSNorm, RMSNorm, make_norm

transformers = pytest.importorskip("transformers")

DTYPES = [torch.float32, torch.bfloat16]


def _pair(ours, theirs, dtype):
    """Copy random weights (around one for RMSNorm, around zero for Gemma's offsets) from ours
    into theirs, both in ``dtype`` on the test device."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _name, p in ours.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3 + (1.0 if isinstance(ours, RMSNorm) else 0.0))
        theirs.load_state_dict(ours.state_dict(), strict=True)
    return ours.to(DEVICE, dtype), theirs.to(DEVICE, dtype)


def _input(dtype, dim=64):
    return torch.randn(3, 5, dim, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype) * 2


@pytest.mark.parametrize("dtype", DTYPES)
def test_rmsnorm_is_llamas(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    ours, theirs = _pair(RMSNorm(64, 1e-6), LlamaRMSNorm(64, eps=1e-6), dtype)
    x = _input(dtype)
    assert torch.equal(ours(x), theirs(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemma_rmsnorm_is_gemma3s(dtype):
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    ours, theirs = _pair(GemmaRMSNorm(64, 1e-6), Gemma3RMSNorm(64, eps=1e-6), dtype)
    x = _input(dtype)
    # torch's fused rms_norm and transformers' x * rsqrt(mean(x^2) + eps) round differently in
    # float32; each rounds once to the dtype afterwards.
    tolerance = atol("same") if dtype == torch.float32 else atol("precision", dtype)
    assert max_diff(ours(x), theirs(x)) <= tolerance
    assert ours(x).dtype == dtype
    assert make_norm("gemma", 64, 1e-6).weight.abs().sum() == 0  # an offset: zero is the identity scale


@pytest.mark.parametrize("activation, module", [("silu", "llama.modeling_llama.LlamaMLP"),
                                                ("gelu_pytorch_tanh", "gemma3.modeling_gemma3.Gemma3MLP")])
def test_gated_mlp_is_transformers(activation, module):
    import importlib

    path, _, name = module.rpartition(".")
    theirs_cls = getattr(importlib.import_module(f"transformers.models.{path}"), name)
    cfg = ModelConfig(vocab_size=8, hidden_size=64, intermediate_size=96, num_layers=1, num_heads=4, num_kv_heads=2,
                      head_dim=16, activation=activation)
    hf_cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, hidden_act=activation)
    hf_cfg.hidden_activation = activation  # Gemma's name for it
    ours, theirs = MLP(cfg), theirs_cls(hf_cfg)
    theirs.load_state_dict(ours.state_dict(), strict=True)
    x = _input(torch.float32)
    ours, theirs = ours.to(DEVICE), theirs.to(DEVICE)
    with torch.no_grad():
        assert max_diff(ours(x), theirs(x)) <= atol("same")
