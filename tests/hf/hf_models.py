"""Tiny random transformers models for the kvcache.hf tests: conftest's families (through
``conftest.build_hf_model``) and families kvcache does not implement itself, built the same way
(seeded, parameters perturbed so that norms and biases are far from their initial values).

Not a conftest: ``tests/conftest.py`` is imported as the module ``conftest``.
"""

from __future__ import annotations

import zlib

import pytest
import torch
from conftest import _COMMON, DEVICE, FAMILIES, HIDDEN, SCORED, VOCAB, build_hf_model
from policy_util import cache_args

import kvcache.hf
from kvcache.hf import cache_kwargs

# Families kvcache does not implement, whose attention goes through transformers' interface.
# granite scales its scores by attention_multiplier, not 1/sqrt(head_dim).
OTHER_FAMILIES = ["gemma", "granite", "olmo2"]


def _other_config(name: str):
    import transformers

    if name == "phi3_partial":
        # Rotary over half of each head: frequencies kvcache cannot rotate with.
        rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
        return transformers.Phi3Config(**_COMMON, rope_parameters=rope, tie_word_embeddings=False)
    if name == "gemma":
        return transformers.GemmaConfig(**_COMMON, head_dim=16, tie_word_embeddings=True)
    if name == "granite":
        return transformers.GraniteConfig(**_COMMON, attention_multiplier=0.1, embedding_multiplier=2.0,
                                          residual_multiplier=0.5, logits_scaling=2.0, tie_word_embeddings=False)
    if name == "olmo2":
        # Its query and key norms span all heads, before the split into heads.
        return transformers.Olmo2Config(**_COMMON, tie_word_embeddings=False)
    if name == "gemma2_cap":
        # Gemma 2's own soft caps (50 and 30) and window (4096); conftest's "gemma2" caps harder.
        return transformers.Gemma2Config(**_COMMON, head_dim=16, tie_word_embeddings=True)
    if name == "gemma2_nocap":
        return transformers.Gemma2Config(**_COMMON, head_dim=16, attn_logit_softcapping=None,
                                         final_logit_softcapping=None, tie_word_embeddings=True)
    if name == "falcon":
        # Rotary; its attention went through the AttentionInterface from transformers 5.25 on.
        return transformers.FalconConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2,
                                         num_attention_heads=4, new_decoder_architecture=False, multi_query=True,
                                         alibi=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if name == "gpt_neox_japanese":
        # Rotary, but its attention is computed in the module, outside the AttentionInterface.
        return transformers.GPTNeoXJapaneseConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2,
                                                  num_attention_heads=4, intermediate_multiple_size=2,
                                                  bos_token_id=1, eos_token_id=2)
    raise KeyError(name)


def _check_buildable(name: str) -> None:
    """Skip when the installed transformers cannot build the family's config even from its own
    defaults (5.4.0's Olmo2Config fails its own field validation): nothing to test there."""
    import transformers

    config_cls = {"olmo2": transformers.Olmo2Config}.get(name)
    if config_cls is None:
        return
    try:
        config_cls()
    except Exception as e:  # transformers' own validation error types differ between releases
        pytest.skip(f"transformers {transformers.__version__} cannot build a default {config_cls.__name__}: {e}")


def build(name: str, attn: str = "eager"):
    """A tiny fp32 causal LM of family ``name`` in eval mode on the test device, with ``attn``
    attention; the same weights every call."""
    if name in FAMILIES or name in SCORED:
        model = build_hf_model(name).to(DEVICE)
        model.set_attn_implementation(attn)
        return model
    from transformers import AutoModelForCausalLM

    seed = zlib.crc32(name.encode()) % 10_000
    torch.manual_seed(seed)
    _check_buildable(name)
    cfg = _other_config(name)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname or "ln_" in pname:
                # Gemma's norms scale by (1 + weight): its weights start at 0.
                base = 0.0 if pname.endswith("bias") or cfg.model_type.startswith("gemma") else 1.0
                p.copy_(base + 0.3 * torch.randn(p.shape, generator=gen))
            elif pname.endswith("bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            elif "embed" in pname or "wte" in pname:
                scale = HIDDEN**-0.5 if cfg.tie_word_embeddings else 1.0
                p.copy_(scale * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval().to(DEVICE)


def greedy(model, ids: torch.Tensor, n: int, cache=None, **kwargs):
    """(sequences (B, T + n), logits (B, n, vocab)) of greedy ``generate``; ``cache`` is passed
    as the installed transformers takes it (None: transformers' DynamicCache)."""
    out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, **cache_kwargs(cache),
                         output_logits=True, return_dict_in_generate=True, **kwargs)
    return out.sequences, torch.stack(out.logits, dim=1)


def feed_both(hf, native, ours, theirs, ids: torch.Tensor, schedule: list[int], label: str) -> int:
    """Feed ``ids`` in calls of ``schedule`` tokens to the transformers model ``hf`` through its
    kvcache.hf cache ``ours`` and to kvcache's ``native`` model through ``theirs``: after every
    call the logits agree within HF_ATOL and every layer holds the same positions. Returns the
    tokens fed."""
    from conftest import HF_ATOL, max_diff

    start = 0
    with torch.no_grad():
        for n in schedule:
            chunk = ids[:, start:start + n]
            start += n
            got = hf(input_ids=chunk, **cache_kwargs(ours)).logits
            assert max_diff(got, native(chunk, theirs)) <= HF_ATOL[torch.float32], f"{label}, after {start} tokens"
            for i, (a, b) in enumerate(zip(ours.kv.layers, theirs.layers)):
                assert torch.equal(a.storage.pos, b.storage.pos), f"{label}, layer {i}, after {start} tokens"
    return start


def left_pad(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows of different lengths as (ids, attention_mask), both (B, longest) on the test device,
    padded on the left."""
    T = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    mask = torch.zeros(len(rows), T, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, T - len(r):] = torch.tensor(r)
        mask[b, T - len(r):] = 1
    return ids.to(DEVICE), mask.to(DEVICE)


def make(model, policy: str, cache_length: int, **kwargs) -> kvcache.hf.HFCache:
    """``kvcache.hf.make_cache`` with the options the policy's paper uses at ``cache_length``."""
    options = {**kvcache.cache.budget_options(policy, cache_length), **kwargs}
    return kvcache.hf.make_cache(model, policy, cache_length=cache_length, **cache_args(options))
