"""Caches of different policies, storages and lengths run as the rows of one batch
(kvcache/cache/rows.py): every row gets what its cache gives alone, up to the rounding of the
batched matmuls (the "cache" tolerance: only the matmuls' shapes differ, and the first step's
logits already differ by up to 1.8e-6); one cache is the same call bit for bit; a call any cache
rejects changes none."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import atol, max_diff, random_ids

import kvcache
from kvcache.cache import KVCache, Rows
from kvcache.errors import CapacityError

# (policy, cache_length, prompt length): the rows differ in policy, storage, budget and length.
ROWS = [("dense", 64, 20), ("snapkv", 12, 17), ("sink", 10, 20), ("tova:int8", 12, 14), ("h2o", 12, 9),
        ("knorm", 12, 16)]


def make(model, policy: str, cache_length: int, batch_size: int = 1):
    name = policy.split(":")[0]
    options = {} if name == "dense" else kvcache.cache.budget_options(name, cache_length)
    return kvcache.make_cache(model, policy, cache_length=cache_length, batch_size=batch_size, options=options)


def prefilled(model, rows=ROWS):
    """Each row's cache after its own prompt, and the logits (1, vocab) of that prompt's last token."""
    caches, logits = [], []
    for i, (policy, length, n) in enumerate(rows):
        cache = make(model, policy, length)
        with torch.inference_mode():
            logits.append(model(random_ids(n, seed=i), cache, last_only=True)[:, 0])
        caches.append(cache)
    return caches, torch.cat(logits)


def states(caches):
    return [c.snapshot().tensors() for c in caches]


def assert_close_states(a, b, tol):
    for sa, sb in zip(a, b):
        assert sa.keys() == sb.keys()
        for name in sa:
            if sa[name].is_floating_point():
                assert max_diff(sa[name], sb[name]) <= tol, name
            else:
                assert torch.equal(sa[name], sb[name]), name


def test_rows_decode_as_each_cache_decodes_alone(llama):
    alone, first = prefilled(llama)
    together, again = prefilled(llama)
    assert torch.equal(first, again)
    rows = Rows(together)
    assert rows.batch_size == len(ROWS) and rows.lengths.tolist() == [n for _, _, n in ROWS]
    tokens = first.argmax(-1)
    with torch.inference_mode():
        for _ in range(8):  # past every budget: the evicting rows evict while batched
            batched = llama.decode(tokens[:, None], rows)
            single = torch.cat([llama.decode(tokens[i:i + 1, None], c) for i, c in enumerate(alone)])
            assert max_diff(batched, single) <= atol("cache")
            assert torch.equal(batched.argmax(-1), single.argmax(-1))
            tokens = single.argmax(-1)
    assert rows.lengths.tolist() == [n + 8 for _, _, n in ROWS]
    assert_close_states(states(together), states(alone), atol("cache"))


def test_a_chunk_over_rows_is_each_caches_chunk(llama):
    # The question after a context: several tokens a row, each cache at its own length.
    alone, _ = prefilled(llama)
    together, _ = prefilled(llama)
    ids = random_ids(5, batch=len(ROWS), seed=9)
    with torch.inference_mode():
        batched = llama(ids, Rows(together), last_only=True)[:, 0]
        single = torch.cat([llama(ids[i:i + 1], c, last_only=True)[:, 0] for i, c in enumerate(alone)])
    assert max_diff(batched, single) <= atol("cache")
    assert_close_states(states(together), states(alone), atol("cache"))


def test_one_cache_in_rows_is_the_same_call_bit_for_bit(llama):
    (alone,), first = prefilled(llama, ROWS[1:2])
    (inside,), _ = prefilled(llama, ROWS[1:2])
    tokens = first.argmax(-1)[:, None]
    with torch.inference_mode():
        for _ in range(4):
            a, b = llama.decode(tokens, alone), llama.decode(tokens, Rows([inside]))
            assert torch.equal(a, b)
            tokens = a.argmax(-1)[:, None]
    for sa, sb in zip(states([alone]), states([inside])):
        assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_a_cache_of_several_rows_takes_its_rows_in_order(llama):
    two = make(llama, "dense", 32, batch_size=2)
    one = make(llama, "window", 8)
    ids = random_ids(6, batch=3, seed=4)
    with torch.inference_mode():
        batched = llama(ids, Rows([two, one]), n_tokens=[6, 4, 5])
        fresh_two, fresh_one = make(llama, "dense", 32, batch_size=2), make(llama, "window", 8)
        single = torch.cat([llama(ids[:2], fresh_two, n_tokens=[6, 4]), llama(ids[2:], fresh_one, n_tokens=[5])])
    for row, n in enumerate((6, 4, 5)):
        assert max_diff(batched[row, :n], single[row, :n]) <= atol("cache")
    assert two.lengths.tolist() == [6, 4] and one.lengths.tolist() == [5]


def test_rows_refuse_what_cannot_be_a_batch(llama):
    a, b = make(llama, "dense", 16), make(llama, "snapkv", 8)
    with pytest.raises(ValueError, match="at least one cache"):
        Rows([])
    with pytest.raises(ValueError, match="appears twice"):
        Rows([a, b, a])
    with pytest.raises(ValueError, match="layer counts"):
        Rows([a, KVCache(b.layers[:1], b.spec, b.policy)])
    # generate takes one KVCache: Rows is for model(...) and model.decode.
    with pytest.raises(ValueError, match="takes a kvcache.KVCache"):
        kvcache.generate(llama, [[5, 6, 7]], max_new_tokens=2, cache=Rows([a]))
    assert a.lengths.tolist() == [0]


def test_a_call_any_cache_rejects_changes_none_of_them(llama):
    small = make(llama, "dense", 8)  # keeps every token: 8 at most
    roomy, ring = make(llama, "dense", 64), make(llama, "sink", 6)
    rows = Rows([roomy, ring, small])
    wide = copy.deepcopy(llama).double()
    with torch.inference_mode():
        llama(random_ids(6, batch=3), rows)
        before = states(rows.caches)
        with pytest.raises(CapacityError):
            llama(random_ids(4, batch=3, seed=1), rows)  # small would hold 10
        with pytest.raises(ValueError, match=r"shape \(3, T\)"):
            llama.decode(random_ids(1, batch=2), rows)
        with pytest.raises(ValueError, match="n_tokens must have shape"):
            llama(random_ids(2, batch=3), rows, n_tokens=[1, 2])
        with pytest.raises(ValueError, match="another model"):
            llama(random_ids(2, batch=4), Rows([roomy, ring, small, make(wide, "dense", 16)]))
    assert rows.lengths.tolist() == [6, 6, 6]
    for sa, sb in zip(before, states(rows.caches)):
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
