"""Phi-3's longrope (Phi-3-128k, Phi-3.5): frequencies divided by short factors while a sequence is
within the original context and by long ones once it has passed it. Each call rotates its keys
with the set its row's length after the call selects, and stored keys keep theirs, as transformers
does step by step; so a model call equals transformers' with the same chunks, and chunkings agree
while the sequence stays within the original context."""

from __future__ import annotations

import pytest
import torch
from conftest import CACHE_ATOL, DEVICE, HF_ATOL, max_diff, random_ids

import kvcache

FAMILY = "phi3_longrope"
ORIGINAL = 32  # the tiny model's original context
ATOL = CACHE_ATOL[torch.float32]


def feed(model, ids, cache, sizes):
    out, start = [], 0
    for n in sizes:
        out.append(model(ids[:, start:start + n], cache))
        start += n
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("T", [20, 48])
def test_one_pass_equals_transformers_on_both_sides_of_the_original_context(checkpoint_factory, model_factory, T):
    model = model_factory(FAMILY)
    ids = random_ids(T, batch=2, seed=1)
    with torch.inference_mode():
        ref = checkpoint_factory(FAMILY).hf(ids).logits
        assert max_diff(model(ids), ref) <= HF_ATOL[torch.float32]


def test_the_factors_switch_where_the_original_context_ends(model_factory):
    """The same 20 tokens, then one more chunk that ends within the original context or past it:
    the second chunk's logits differ only when it crosses."""
    model = model_factory(FAMILY)
    ids = random_ids(40, seed=2)
    with torch.inference_mode():
        within, crossing = (kvcache.make_cache(model, cache_length=40) for _ in range(2))
        a = feed(model, ids[:, :ORIGINAL], within, [20, ORIGINAL - 20])
        b = feed(model, ids[:, :ORIGINAL + 1], crossing, [20, ORIGINAL + 1 - 20])
    assert max_diff(a[:, :20], b[:, :20]) == 0
    assert max_diff(a[:, 20:], b[:, 20:ORIGINAL]) > 1e-3


def test_chunks_equal_transformers_stepping_with_the_same_chunks(checkpoint_factory, model_factory):
    from transformers import DynamicCache

    from kvcache.hf.compat import CACHE_ARG

    hf, model = checkpoint_factory(FAMILY).hf, model_factory(FAMILY)
    ids = random_ids(48, seed=3)
    sizes = [16, 10, 1, 1, 20]  # within, within, within, then across the original context
    with torch.inference_mode():
        theirs, seen, past = [], 0, DynamicCache()
        for n in sizes:
            theirs.append(hf(ids[:, seen:seen + n], use_cache=True, **{CACHE_ARG: past}).logits)
            seen += n
        got = feed(model, ids, kvcache.make_cache(model, cache_length=48), sizes)
        one_pass_within = model(ids[:, :28])
    assert max_diff(got, torch.cat(theirs, dim=1)) <= HF_ATOL[torch.float32]
    assert max_diff(got[:, :28], one_pass_within) <= ATOL  # within the original context: any chunking


@pytest.mark.parametrize("prompt", [12, 40])
def test_greedy_tokens_equal_transformers_generate(checkpoint_factory, model_factory, prompt):
    """transformers' Phi-3 prefills again, with the long factors, when generation passes the
    original context; kvcache.generate does too, and prefills a prompt already past it in one
    pass (whatever prefill_chunk), so that every key has the long rotation."""
    model = model_factory(FAMILY)
    ids = random_ids(prompt, batch=2, seed=4)
    with torch.no_grad():
        ref = checkpoint_factory(FAMILY).hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                                     max_new_tokens=32, eos_token_id=None, pad_token_id=0)
    got = kvcache.generate(model, ids.tolist(), max_new_tokens=32, stop_tokens=(), prefill_chunk=16)
    assert got == ref[:, prompt:].tolist()


def test_each_ragged_row_switches_at_its_own_length(model_factory):
    """Two rows fed together, one past the original context after the chunk and one not: each
    equals its row fed alone."""
    model = model_factory(FAMILY)
    long_row, short_row = random_ids(40, seed=5)[0], random_ids(20, seed=6)[0]
    with torch.inference_mode():
        cache = kvcache.make_cache(model, cache_length=40, batch_size=2)
        ids = torch.zeros(2, 40, dtype=torch.long, device=DEVICE)
        ids[0], ids[1, :20] = long_row, short_row
        both = model(ids, cache, n_tokens=[40, 20])
        assert max_diff(both[0], model(long_row[None])[0]) <= ATOL
        assert max_diff(both[1, :20], model(short_row[None])[0]) <= ATOL


def test_policies_that_re_rotate_stored_keys_are_refused(model_factory):
    model = model_factory(FAMILY)
    with pytest.raises(ValueError, match="rotary frequencies"):
        kvcache.make_cache(model, "sink", cache_length=16, options={"sinks": 2, "positions": "renumbered"})
    kvcache.make_cache(model, "h2o", cache_length=16)  # policies that never rotate work on it
