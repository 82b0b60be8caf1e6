"""Attention with a family's scores rule (model/scores.py) against transformers' eager attention
of that family: Gemma 2's soft-capping and gpt-oss's sink logits, through each path of
kvcache.kernels.attention (causal, masked over a cache with holes, the decode step), and gpt-oss's
mixture of experts and YaRN frequencies against its own modules."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import DEVICE, atol, max_diff

from kvcache.kernels import attention
from kvcache.model.config import ModelConfig
from kvcache.model.experts import Experts
from kvcache.model.scores import Scores

transformers = pytest.importorskip("transformers")

B, Hq, Hkv, D = 2, 4, 2, 16


def _qkv(T: int, S: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, T, D, generator=gen) * 2
    k, v = (torch.randn(B, Hkv, S, D, generator=gen) for _ in range(2))
    return q.to(DEVICE), k.to(DEVICE), v.to(DEVICE)


def _theirs(family: str, q, k, v, visible, sinks):
    """transformers' eager attention of ``family`` with a boolean (B, 1, T, S) mask."""
    mask = torch.zeros(visible.shape, device=q.device).masked_fill(~visible, float("-inf"))
    module = SimpleNamespace(num_key_value_groups=Hq // Hkv, training=False, sinks=sinks)
    if family == "gemma2":
        from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward
        out, _ = eager_attention_forward(module, q, k, v, mask, scaling=D**-0.5, softcap=1.5)
    else:
        from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward
        out, _ = eager_attention_forward(module, q, k, v, mask, scaling=D**-0.5)
    return out.transpose(1, 2)  # they return (B, T, Hq, D)


def _rule(family: str) -> tuple[Scores, torch.Tensor | None]:
    if family == "gemma2":
        return Scores(softcap=1.5), None
    sinks = torch.randn(Hq, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    return Scores(sink_logits=sinks), sinks


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
def test_causal_and_windowed_attention_equal_transformers(family):
    rule, sinks = _rule(family)
    T = 40
    q, k, v = _qkv(T, T)
    t = torch.arange(T, device=DEVICE)
    for window in (None, 8):
        visible = t[None, :] <= t[:, None]
        if window is not None:
            visible &= t[None, :] > t[:, None] - window
        want = _theirs(family, q, k, v, visible.expand(B, 1, T, T), sinks)
        got = attention.causal(q, k, v, window=window, scores=rule)
        assert max_diff(got, want) <= atol("same") * 10, f"window {window}"
        assert max_diff(attention.causal(q, k, v, window=window), want) > 1e-2  # the rule matters


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
def test_masked_and_decode_over_a_cache_with_holes_equal_transformers(family):
    """Key slots in any order, some empty (-1): the masked path for a chunk, the decode step, and
    the attention mass a scoring policy reads (the sink's share is no key's)."""
    rule, sinks = _rule(family)
    S = 24
    gen = torch.Generator().manual_seed(3)
    k_pos = torch.randperm(S, generator=gen)[None, None].repeat(B, 1, 1).to(DEVICE)
    k_pos[0, 0, :5] = -1
    for T in (6, 1):
        q, k, v = _qkv(T, S, seed=T)
        q_pos = torch.arange(S - T, S, device=DEVICE).expand(B, T)
        visible = (k_pos[:, :, None, :] >= 0) & (k_pos[:, :, None, :] <= q_pos[:, None, :, None])
        want = _theirs(family, q, k, v, visible, sinks)
        got = attention.masked(q, k, v, q_pos, k_pos, scores=rule)
        assert max_diff(got, want) <= atol("same") * 10, f"{T} queries"
        if T == 1:
            out, mass = attention.decode(q, k, v, visible[:, :, 0], want_mass=True, scores=rule)
            assert max_diff(out, want) <= atol("same") * 10
            total = mass.sum(-1) / (Hq // Hkv)  # (B, Hkv): each query's weights summed
            if sinks is None:
                assert torch.allclose(total, torch.ones_like(total))
            else:
                assert bool((total < 1).all())


def _gpt_oss_config(**extra):
    return transformers.GptOssConfig(hidden_size=32, intermediate_size=24, num_local_experts=4,
                                     num_experts_per_tok=2, num_hidden_layers=1, num_attention_heads=4,
                                     num_key_value_heads=2, head_dim=16, vocab_size=64, **extra)


@pytest.mark.parametrize("tokens", [1, 9])
def test_experts_equal_gpt_oss_mlp(tokens):
    """One token per row (the gathered path a decode step takes) and a chunk (expert by expert)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    hf = _gpt_oss_config()
    theirs = GptOssMLP(hf)
    ours = Experts(ModelConfig.from_hf(hf.to_dict()))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    ours.load_state_dict(theirs.state_dict(), strict=True)
    ours, theirs = ours.to(DEVICE), theirs.to(DEVICE)
    x = torch.randn(3, tokens, 32, generator=gen).to(DEVICE)
    with torch.no_grad():
        assert max_diff(ours(x), theirs(x)[0]) <= atol("same") * 10


@pytest.mark.parametrize("truncate", [True, False])
def test_yarn_frequencies_and_factor_equal_transformers(truncate):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from kvcache.model.rope import inverse_frequencies

    rope = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "truncate": truncate, "original_max_position_embeddings": 4096}
    hf = _gpt_oss_config(rope_parameters=rope, max_position_embeddings=131072)
    want, factor = ROPE_INIT_FUNCTIONS["yarn"](hf)
    cfg = ModelConfig.from_hf(hf.to_dict())
    assert torch.equal(inverse_frequencies(cfg.rope, cfg.head_dim), want)
    assert cfg.rope.magnitude == pytest.approx(factor)
