"""kvcache.hf's dense cache against transformers' own DynamicCache, same model, same weights.

Greedy generation of 64 new tokens must give the same tokens and logits within conftest's
CACHE_ATOL (fp32 1e-5) for kvcache's families and for families kvcache does not implement;
also with chunked prefill, a left-padded ragged batch, and right padding fed by hand. The
sizes the cache reports to transformers are the tokens seen, not the slots held.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from conftest import CACHE_ATOL, DEVICE, HYBRID, SCORED, max_diff, random_ids
from hf_models import OTHER_FAMILIES, build, greedy, left_pad, make

import kvcache
import kvcache.hf
from kvcache.hf import cache_kwargs

ATOL = CACHE_ATOL[torch.float32]
NEW = 64


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "mistral", "mistral_window", "phi3", *OTHER_FAMILIES, "phi3_partial",
                                  *HYBRID, *SCORED, "gemma2_cap", "gemma2_nocap"])
def test_generate_equals_dynamic_cache(name):
    ids = random_ids(16, seed=1)
    want_ids, want_logits = greedy(build(name), ids, NEW)
    model = build(name)
    cache = kvcache.hf.make_cache(model, "dense", cache_length=16 + NEW)
    got_ids, got_logits = greedy(model, ids, NEW, cache)
    assert model.config._attn_implementation == "kvcache"
    assert torch.equal(got_ids, want_ids)
    assert max_diff(got_logits, want_logits) <= ATOL
    assert cache.get_seq_length() == 16 + NEW - 1 == int(cache.lengths[0])


def test_chunked_prefill_equals_plain_forward():
    model = build("llama")
    ids = random_ids(40, seed=2)
    with torch.no_grad():
        want = model(ids, use_cache=False).logits
        cache = kvcache.hf.make_cache(model, "dense", cache_length=40)
        got = []
        start = 0
        for n in (16, 1, 7, 16):
            got.append(model(ids[:, start:start + n], **cache_kwargs(cache)).logits)
            start += n
    assert cache.get_seq_length() == 40
    assert max_diff(torch.cat(got, dim=1), want) <= ATOL


def test_generate_with_prefill_chunks_equals_dynamic_cache():
    ids = random_ids(30, seed=3)
    want_ids, want_logits = greedy(build("qwen3"), ids, 16)
    model = build("qwen3")
    cache = kvcache.hf.make_cache(model, "dense", cache_length=46)
    _, chunked_logits = greedy(build("qwen3"), ids, 16, transformers.DynamicCache(), prefill_chunk_size=8)
    if max_diff(chunked_logits, want_logits) > ATOL:
        # Some releases (5.2) rotate every prefill chunk at the last chunk's positions, so their own
        # chunked prefill differs from the plain one: kvcache refuses those positions instead.
        with pytest.raises(ValueError, match="position_ids of row 0 .* differ from the positions the cache gives"):
            greedy(model, ids, 16, cache, prefill_chunk_size=8)
        return
    got_ids, got_logits = greedy(model, ids, 16, cache, prefill_chunk_size=8)
    assert torch.equal(got_ids, want_ids)
    assert max_diff(got_logits, want_logits) <= ATOL


def test_left_padded_batch_equals_rows_alone_and_dynamic_cache():
    rows = [random_ids(20, seed=4)[0].tolist(), random_ids(11, seed=5)[0].tolist()]
    ids, mask = left_pad(rows)
    want_ids, want_logits = greedy(build("llama"), ids, 24, attention_mask=mask)
    model = build("llama")
    cache = kvcache.hf.make_cache(model, "dense", cache_length=44, batch_size=2)
    got_ids, got_logits = greedy(model, ids, 24, cache, attention_mask=mask)
    assert torch.equal(got_ids, want_ids)
    assert max_diff(got_logits, want_logits) <= ATOL
    assert cache.lengths.tolist() == [20 + 23, 11 + 23]  # real tokens per row
    assert cache.get_seq_length() == 20 + 23  # columns, padding included, as transformers counts
    for b, row in enumerate(rows):
        alone = kvcache.hf.make_cache(model, "dense", cache_length=44)
        ids_b, logits_b = greedy(model, torch.tensor([row], device=DEVICE), 24, alone)
        assert torch.equal(ids_b[0, len(row):], got_ids[b, 20:])
        assert max_diff(logits_b[0], got_logits[b]) <= ATOL


def test_right_padding_fed_by_hand_equals_rows_alone():
    """A right-padded chunk needs no position_ids; the next one gets each row's own positions."""
    model = build("qwen2")
    a, b = random_ids(12, seed=6)[0], random_ids(9, seed=7)[0]
    ids = torch.stack([a, torch.cat([b, torch.zeros(3, dtype=torch.long, device=DEVICE)])])
    mask = torch.tensor([[1] * 12, [1] * 9 + [0] * 3], device=DEVICE)
    nxt = random_ids(2, batch=2, seed=8)
    with torch.no_grad():
        cache = kvcache.hf.make_cache(model, "dense", cache_length=14, batch_size=2)
        first = model(ids, attention_mask=mask, **cache_kwargs(cache)).logits
        positions = cache.lengths[:, None].to(DEVICE) + torch.arange(2, device=DEVICE)  # lengths: CPU
        mask = torch.cat([mask, torch.ones(2, 2, dtype=torch.long, device=DEVICE)], dim=1)
        second = model(nxt, attention_mask=mask, position_ids=positions, **cache_kwargs(cache)).logits
        for row, (real, n) in enumerate(((a, 12), (b, 9))):
            alone = kvcache.hf.make_cache(model, "dense", cache_length=14)
            want = model(torch.cat([real, nxt[row]])[None], **cache_kwargs(alone)).logits[0]
            assert max_diff(first[row, :n], want[:n]) <= ATOL
            assert max_diff(second[row], want[n:]) <= ATOL
    assert cache.lengths.tolist() == [14, 11]


def test_attention_sees_the_2d_padding_mask_not_a_built_mask():
    """transformers builds no (T x keys) mask for attn_implementation='kvcache'."""
    model = build("llama")
    ids, mask = left_pad([random_ids(10, seed=9)[0].tolist(), random_ids(6, seed=10)[0].tolist()])
    seen = []
    hook = model.model.layers[0].self_attn.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["attention_mask"]), with_kwargs=True)
    try:
        greedy(model, ids, 3, kvcache.hf.make_cache(model, "dense", cache_length=13, batch_size=2), attention_mask=mask)
    finally:
        hook.remove()
    assert [tuple(m.shape) for m in seen] == [(2, 10), (2, 11), (2, 12)]


def test_sizes_report_tokens_seen_not_slots_held():
    model = build("llama")
    cache = make(model, "h2o", 8)
    ids = random_ids(30, seed=11)
    with torch.no_grad():
        for start in range(0, 30, 10):
            model(ids[:, start:start + 10], **cache_kwargs(cache))
    assert cache.get_seq_length() == 30 == int(cache.lengths[0])
    layer = cache.kv.layers[0]
    # Slots held: the budget, in every K/V head (h2o evicts per head), and no more.
    assert layer.storage.pos.shape[-1] == 8 + 1 and bool((layer.storage.pos[0, :, :8] >= 0).all())
    assert cache.get_mask_sizes(1, 0) == (8 + 1, 30 - 8)  # held slots + the new token
    assert cache.get_max_length() == -1  # an evicting cache takes any number of tokens
    dense = kvcache.hf.make_cache(model, "dense", cache_length=50)
    assert dense.get_max_length() == 50 and dense.get_mask_sizes(5, 1) == (5, 0)
    assert not cache.is_compileable and len(cache) == 2 and cache.batch_size == 1
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.lengths.tolist() == [0]


def test_make_cache_takes_make_caches_arguments():
    """kvcache.hf.make_cache's signature is kvcache.make_cache's, less the model (and plus nothing)."""
    import inspect

    ours = inspect.signature(kvcache.hf.make_cache).parameters
    theirs = inspect.signature(kvcache.make_cache).parameters
    assert list(ours) == list(theirs)
    assert all(ours[n].default == theirs[n].default and ours[n].kind == theirs[n].kind for n in ours)
