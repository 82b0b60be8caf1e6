"""The dense cache is exact: any chunking, any ragged batch, equals the plain forward."""

from __future__ import annotations

import pytest
import torch
from conftest import CACHE_ATOL, DEVICE, FAMILIES, VOCAB, atol, max_diff, random_ids
from hypothesis import given, settings
from hypothesis import strategies as st

import kvcache

ATOL = CACHE_ATOL[torch.float32]


def _chunked(model, ids, cuts, cache=None):
    """Logits of ``ids`` (B, T) fed through a dense cache in chunks ending at ``cuts``."""
    B, T = ids.shape
    if cache is None:
        cache = kvcache.make_cache(model, "dense", cache_length=T, batch_size=B)
    outs, prev = [], 0
    for cut in list(cuts) + [T]:
        if cut > prev:
            outs.append(model(ids[:, prev:cut], cache))
            prev = cut
    assert cache.lengths.tolist() == [T] * B
    return torch.cat(outs, dim=1)


@st.composite
def chunkings(draw):
    family = draw(st.sampled_from(FAMILIES))
    T = draw(st.integers(1, 40))
    B = draw(st.integers(1, 2))
    cuts = sorted(draw(st.sets(st.integers(1, max(1, T - 1)), max_size=6)))
    seed = draw(st.integers(0, 2**16))
    return family, T, B, [c for c in cuts if c < T], seed


@settings(max_examples=25, deadline=None, derandomize=True)
@given(chunkings())
def test_any_chunking_equals_full_forward(model_factory, case):
    family, T, B, cuts, seed = case
    model = model_factory(family)
    ids = random_ids(T, batch=B, seed=seed)
    with torch.inference_mode():
        full = model(ids)
        chunked = _chunked(model, ids, cuts)
    assert full.abs().max() > 0.5  # logits of order 1: the tolerance is meaningful
    diff = max_diff(chunked, full)
    assert diff <= ATOL, f"{family} T={T} cuts={cuts}: max |diff| {diff:.3g}"


@pytest.mark.parametrize("family", FAMILIES)
def test_token_by_token_equals_full_forward(model_factory, family):
    """Decode-style one-token steps (the ``all_visible`` path, and past the mistral window)."""
    model = model_factory(family)
    ids = random_ids(20, batch=2, seed=11)
    with torch.inference_mode():
        full = model(ids)
        stepped = _chunked(model, ids, range(1, 20))
    assert max_diff(stepped, full) <= ATOL


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_chunking_low_precision(checkpoint_factory, dtype):
    model = kvcache.load(checkpoint_factory("qwen3").path, dtype=dtype, device=DEVICE)
    ids = random_ids(24, batch=2, seed=12)
    with torch.inference_mode():
        full = model(ids)
        chunked = _chunked(model, ids, [5, 6, 13, 20])
        ref = kvcache.load(checkpoint_factory("qwen3").path, device=DEVICE)(ids)
    assert chunked.dtype == dtype
    cache = kvcache.make_cache(model, cache_length=4, batch_size=1)
    assert cache.layers[0].storage.k.dtype == dtype
    assert max_diff(chunked, full) <= CACHE_ATOL[dtype]
    # and both stay close to the fp32 model
    assert max_diff(full, ref) <= CACHE_ATOL[dtype] * 5


# --- ragged batches ----------------------------------------------------------------------------


def _ragged_run(model, rows, schedule, pad_seed=0):
    """Feed ``rows`` (list of 1-D id tensors) through one cache; ``schedule`` is a list of
    per-call n_tokens lists. Padding is filled with random ids. Returns each row's real logits."""
    B = len(rows)
    g = torch.Generator().manual_seed(pad_seed)
    cache = kvcache.make_cache(model, cache_length=max(len(r) for r in rows), batch_size=B)
    done = [0] * B
    got = [[] for _ in range(B)]
    for n in schedule:
        T = max(max(n), 1)
        chunk = torch.randint(0, VOCAB, (B, T), generator=g).to(DEVICE)
        for b in range(B):
            chunk[b, : n[b]] = rows[b][done[b] : done[b] + n[b]]
        logits = model(chunk, cache, n_tokens=n)
        assert logits.shape == (B, T, VOCAB)
        for b in range(B):
            got[b].append(logits[b, : n[b]])
            done[b] += n[b]
        assert cache.lengths.tolist() == done
    return [torch.cat(g_, dim=0) for g_ in got]


def _alone(model, row):
    return model(row[None])[0]


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral_window"])
def test_ragged_chunks_equal_each_row_alone(model_factory, family):
    model = model_factory(family)
    rows = [random_ids(n, seed=20 + n)[0] for n in (13, 4, 10)]
    # Rows advance at different rates; row 1 sits out (n=0) in the middle and at the end.
    schedule = [[5, 2, 0], [3, 0, 4], [1, 2, 6], [4, 0, 0]]
    with torch.inference_mode():
        got = _ragged_run(model, rows, schedule)
        for b, row in enumerate(rows):
            assert max_diff(got[b], _alone(model, row)) <= ATOL, f"row {b}"


def test_padding_content_is_never_attended(llama):
    rows = [random_ids(n, seed=30 + n)[0] for n in (9, 3)]
    schedule = [[4, 3], [5, 0]]
    with torch.inference_mode():
        a = _ragged_run(llama, rows, schedule, pad_seed=1)
        b = _ragged_run(llama, rows, schedule, pad_seed=2)
    for x, y in zip(a, b):
        assert max_diff(x, y) <= atol("same")


@st.composite
def ragged_schedules(draw):
    B = draw(st.integers(1, 3))
    lengths = [draw(st.integers(1, 16)) for _ in range(B)]
    remaining = list(lengths)
    schedule = []
    while any(remaining):
        width = draw(st.integers(1, 8))
        n = [draw(st.integers(0, min(width, r))) for r in remaining]
        if not any(n):
            n[remaining.index(max(remaining))] = min(width, max(remaining))
        remaining = [r - k for r, k in zip(remaining, n)]
        schedule.append(n)
    return lengths, schedule, draw(st.integers(0, 2**16))


@settings(max_examples=25, deadline=None, derandomize=True)
@given(ragged_schedules())
def test_any_ragged_schedule_equals_each_row_alone(llama, case):
    lengths, schedule, seed = case
    rows = [random_ids(n, seed=seed + b)[0] for b, n in enumerate(lengths)]
    with torch.inference_mode():
        got = _ragged_run(llama, rows, schedule, pad_seed=seed)
        for b, row in enumerate(rows):
            diff = max_diff(got[b], _alone(llama, row))
            assert diff <= ATOL, f"row {b} of {lengths}, schedule {schedule}: {diff:.3g}"


# --- capacity, reset, size ---------------------------------------------------------------------


def _snapshot(cache):
    return [
        (layer.storage.k.clone(), layer.storage.v.clone(), layer.storage.pos.clone())
        for layer in cache.layers
    ]


def _same_state(a, b):
    return all(torch.equal(x, y) for la, lb in zip(a, b) for x, y in zip(la, lb))


def test_capacity_error_leaves_cache_unchanged(llama):
    ids = random_ids(10, batch=2, seed=40)
    with torch.inference_mode():
        cache = kvcache.make_cache(llama, cache_length=8, batch_size=2)
        llama(ids[:, :6], cache)
        before = _snapshot(cache)
        with pytest.raises(kvcache.CapacityError, match="cache_length"):
            llama(ids[:, 6:9], cache)  # 6 + 3 > 8
        # ragged: only row 1 would overflow
        with pytest.raises(kvcache.CapacityError, match="row 1"):
            llama(ids[:, 6:9], cache, n_tokens=[1, 3])
        assert cache.lengths.tolist() == [6, 6]
        assert _same_state(_snapshot(cache), before)
        after_reject = llama(ids[:, 6:8], cache)  # exactly fills the cache: accepted

        clean = kvcache.make_cache(llama, cache_length=8, batch_size=2)
        llama(ids[:, :6], clean)
        expected = llama(ids[:, 6:8], clean)
    assert torch.equal(after_reject, expected)
    assert cache.lengths.tolist() == [8, 8]
    with pytest.raises(kvcache.CapacityError):
        llama(ids[:, :1], cache)


def test_capacity_error_is_a_kvcache_error(llama):
    cache = kvcache.make_cache(llama, cache_length=3, batch_size=1)
    with pytest.raises(kvcache.KVCacheError):
        llama(random_ids(4), cache)
    assert issubclass(kvcache.CapacityError, kvcache.KVCacheError)
    assert cache.lengths.tolist() == [0]


def test_reset_forgets_every_token(llama):
    ids = random_ids(12, batch=2, seed=41)
    other = random_ids(12, batch=2, seed=42)
    with torch.inference_mode():
        clean = kvcache.make_cache(llama, cache_length=12, batch_size=2)
        expected = torch.cat([llama(ids[:, :3], clean), llama(ids[:, 3:5], clean)], dim=1)

        cache = kvcache.make_cache(llama, cache_length=12, batch_size=2)
        llama(other, cache, n_tokens=[12, 7])  # stale keys in every slot
        cache.reset()
        assert cache.lengths.tolist() == [0, 0]
        # every slot is marked empty again (keys and values may stay: they are never read)
        assert all(bool((layer.storage.pos == -1).all()) for layer in cache.layers)
        got = torch.cat([llama(ids[:, :3], cache), llama(ids[:, 3:5], cache)], dim=1)
    assert max_diff(got, expected) <= ATOL
    assert max_diff(got, llama(ids[:, :5])) <= ATOL


@pytest.mark.parametrize("dtype,batch,length", [(torch.float32, 2, 10), (torch.bfloat16, 3, 7)])
def test_nbytes(checkpoint_factory, dtype, batch, length):
    model = kvcache.load(checkpoint_factory("qwen3").path, dtype=dtype, device=DEVICE)
    cfg = model.config
    cache = kvcache.make_cache(model, cache_length=length, batch_size=batch)
    elem = torch.tensor([], dtype=dtype).element_size()
    slots = length + 1  # one scratch slot absorbs padding writes
    # Positions below ``length`` take int8: one byte per slot.
    per_layer = 2 * batch * cfg.num_kv_heads * slots * cfg.head_dim * elem + batch * slots * 1
    assert cache.nbytes() == cfg.num_layers * per_layer
    # Buffers are allocated once: filling the cache does not change its size.
    with torch.inference_mode():
        model(random_ids(length, batch=batch), cache)
    assert cache.nbytes() == cfg.num_layers * per_layer
    assert "nbytes" in repr(cache) and "dense" in repr(cache)


def test_make_cache_geometry(model_factory):
    model = model_factory("qwen3")
    cache = kvcache.make_cache(model, "dense", cache_length=5, batch_size=3)
    assert cache.batch_size == 3 and cache.cache_length == 5 and cache.policy == "dense"
    assert len(cache.layers) == model.config.num_layers
    k = cache.layers[0].storage.k
    assert k.shape[0] == 3 and k.shape[1] == 2 and k.shape[3] == 24  # GQA heads, explicit head_dim
    assert model_factory("mistral_window").config.sliding_window == 8
    assert kvcache.make_cache(model_factory("mistral_window"), cache_length=4).spec.sliding_window == 8


# ----- slots allocated as the cache fills --------------------------------------------------------


def _ragged_then_decode(model, cache, ids, lengths, chunk=100, steps=3):
    """Logits of ``ids`` (B, T) fed in ragged chunks of ``chunk`` (row b stops at ``lengths[b]``,
    the rest of its chunks padding), then ``steps`` decode steps: (B, chunks + steps, vocab)."""
    outs = []
    with torch.inference_mode():
        for start in range(0, max(lengths), chunk):
            n = [max(0, min(chunk, L - start)) for L in lengths]
            outs.append(model(ids[:, start : start + chunk], cache, n_tokens=n, last_only=True)[:, 0])
        for i in range(steps):
            outs.append(model.decode(ids[:, i : i + 1], cache))
    return torch.stack(outs, dim=1)


@pytest.mark.parametrize("storage", ["full", "int8", "token4"])
def test_a_cache_allocated_as_it_fills_computes_what_one_allocated_up_front_does(llama, storage):
    """Bitwise, through ragged chunks (whose padding goes to the scratch slot, the last of the slots
    allocated) and decode steps; it allocates a small multiple of what it holds."""
    ids = random_ids(700, batch=2, seed=8)
    lengths = [700, 430]
    grown = kvcache.make_cache(llama, f"dense:{storage}", cache_length=5000, batch_size=2)
    whole = kvcache.make_cache(llama, f"dense:{storage}", cache_length=5000, batch_size=2)
    whole.allocate()
    assert grown.allocated_tokens < 5000 == whole.allocated_tokens
    got = _ragged_then_decode(llama, grown, ids, lengths)
    assert torch.equal(got, _ragged_then_decode(llama, whole, ids, lengths))
    assert 703 <= grown.allocated_tokens < 2 * 703 and grown.nbytes() < whole.nbytes() / 3
    if storage == "full":
        with torch.inference_mode():
            plain = llama(ids[:1, :700])[0, -1]
        assert max_diff(got[0, 6], plain) <= ATOL  # the last chunk's logits: position 699


def test_a_snapshot_restores_into_a_cache_of_another_allocation(llama):
    """A snapshot has the slots its cache had allocated: it restores into a cache with fewer (which
    allocates the rows' tokens) or more (whose slots past the rows' tokens are emptied), and each
    continues bitwise as the original does."""
    ids = random_ids(900, seed=9)
    source = kvcache.make_cache(llama, cache_length=2000)
    with torch.inference_mode():
        llama(ids[:, :300], source)
        llama(ids[:, 300:600], source)  # past 512 slots: 1024 allocated
    snap = source.snapshot()
    fewer = source.empty_like()
    more = kvcache.make_cache(llama, cache_length=2000)
    more.allocate()
    with torch.inference_mode():
        llama(random_ids(900, seed=10), more)  # a longer row, to be replaced
    fewer.restore(snap)
    more.restore(snap)
    assert fewer.allocated_tokens == 600 < source.allocated_tokens < more.allocated_tokens
    assert bool((more.layers[0].storage.pos[0, 0, 600:] == -1).all())
    outs = []
    for cache in (source, fewer, more):
        with torch.inference_mode():
            outs.append(torch.cat([llama(ids[:, 600:650], cache)[:, -1], llama.decode(ids[:, 650:651], cache)]))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
