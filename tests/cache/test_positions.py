"""Stored positions take the narrowest integer type that holds them: int8 or int16 for a dense
cache (positions below its cache_length), int32 for an evicting one; a row past int32's range is
refused before anything changes; snapshots of caches that stored int64 positions still restore."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE
from policy_util import feed

import kvcache
from kvcache.cache import positions
from kvcache.cache.base import CacheSpec
from kvcache.cache.positions import MAX_POSITIONS, position_dtype
from kvcache.cache.snapshot import Snapshot
from kvcache.cache.storages import make_storage
from kvcache.errors import CapacityError

C = 12
BEFORE = [[10, 8], [3, 3], [1, 1], [1, 1], [1, 1]]
AFTER = [[5, 2], [1, 1], [1, 1], [4, 6], [1, 1]]


@pytest.mark.parametrize("limit,dtype", [(0, torch.int8), (1, torch.int8), (128, torch.int8), (129, torch.int16),
                                         (32768, torch.int16), (32769, torch.int32), (2**31, torch.int32),
                                         (None, torch.int32)])
def test_the_narrowest_type_that_holds_every_position_and_empty(limit, dtype):
    assert position_dtype(limit) == dtype
    if limit:
        # -1 (an empty slot) and the largest position below the limit fit.
        t = torch.tensor([-1, limit - 1]).to(dtype)
        assert t.tolist() == [-1, limit - 1]


@pytest.mark.parametrize("limit", [-1, 2**31 + 1, 1.5, "8", True])
def test_bad_limits_are_clear_errors(limit):
    with pytest.raises(ValueError, match="limit|int32"):
        position_dtype(limit)


def _layers(cache):
    for layer in cache.layers:
        yield from getattr(layer, "heads", [layer])


@pytest.mark.parametrize("storage", list(kvcache.storages()))
def test_dense_caches_store_narrow_positions_evicting_ones_int32(llama, storage):
    for length, dtype in ((100, torch.int8), (1000, torch.int16)):
        cache = kvcache.make_cache(llama, f"dense:{storage}", cache_length=length)
        assert {layer.storage.pos.dtype for layer in _layers(cache)} == {dtype}
    for policy in kvcache.policies():
        if policy == "dense":
            continue
        cache = kvcache.make_cache(llama, f"{policy}:{storage}", cache_length=64,
                                   options=kvcache.cache.budget_options(policy, 64))
        assert {layer.storage.pos.dtype for layer in _layers(cache)} == {torch.int32}, policy
    # Per-head budgets: each head's storage too.
    cache = kvcache.make_cache(llama, f"h2o:{storage}", cache_length=64, head_budgets=[[40, 88]] * 2, options={"recent": 8})
    assert {layer.storage.pos.dtype for layer in _layers(cache)} == {torch.int32}


def test_a_large_dense_cache_takes_int32():
    spec = CacheSpec(batch_size=1, num_kv_heads=1, head_dim=8, cache_length=40000, dtype=torch.float16,
                     device=torch.device("cpu"))
    assert make_storage(spec, limit=40000).pos.dtype == torch.int32


def test_stored_positions_are_the_tokens_positions(llama):
    """A dense cache of 100 slots holds int8 positions 0..n-1, then -1; window's hold its newest."""
    ids = torch.randint(3, 128, (1, 90), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    dense = kvcache.make_cache(llama, "dense:kivi4", cache_length=100)
    window = kvcache.make_cache(llama, "window:token8", cache_length=32)
    with torch.inference_mode():
        llama(ids, dense)
        llama(ids, window)
    pos = dense.layers[0].storage.pos[0, 0]
    assert pos.dtype == torch.int8 and pos[:90].tolist() == list(range(90)) and bool((pos[90:] == -1).all())
    kept = window.layers[0].storage.pos[0, 0, :32]
    assert sorted(kept.tolist()) == list(range(58, 90))


def _continue(model, cache, rows, schedule):
    """Feed ``rows`` in chunks of ``schedule`` (per-row counts) from wherever ``cache`` is; the
    real logits of each row. Padding is random but the same for every call."""
    g = torch.Generator().manual_seed(1)
    done, got = [0] * len(rows), [[] for _ in rows]
    for n in schedule:
        chunk = torch.randint(0, 128, (len(rows), max(n)), generator=g).to(DEVICE)
        for b, row in enumerate(rows):
            chunk[b, : n[b]] = row[done[b] : done[b] + n[b]]
        logits = model(chunk, cache, n_tokens=n)
        for b in range(len(rows)):
            got[b].append(logits[b, : n[b]])
            done[b] += n[b]
    return [torch.cat(x) for x in got]


def _snapshot_equal(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture
def quiet_positions(llama):
    """The shared model warns once past its max_position_embeddings: left as it was found."""
    warned = llama._warned_positions
    yield
    llama._warned_positions = warned


@pytest.mark.parametrize("policy", ["window", "dense"])
@pytest.mark.filterwarnings("ignore:a sequence reached position")
def test_a_row_past_int32_positions_is_refused_and_nothing_changes(llama, quiet_positions, policy):
    """Positions [0, MAX_POSITIONS) fit int32; a chunk or a step that would go past is refused
    in ``begin``, before any layer writes."""
    cache = kvcache.make_cache(llama, policy, cache_length=16)
    with torch.inference_mode():
        llama(torch.randint(3, 128, (1, 4)).to(DEVICE), cache)
    if policy == "dense":
        # A dense cache's own capacity comes first.
        with pytest.raises(CapacityError, match="cache_length"):
            llama(torch.randint(3, 128, (1, 13)).to(DEVICE), cache)
        return
    cache.lengths.fill_(MAX_POSITIONS - 1)  # as if the row had seen that many tokens
    with torch.inference_mode():
        llama(torch.tensor([[5]], device=DEVICE), cache)  # the last position int32 holds
    assert int(cache.layers[0].storage.pos.max()) == MAX_POSITIONS - 1
    before = cache.snapshot().tensors()
    for ids in (torch.tensor([[5]]), torch.tensor([[5, 6]])):
        with pytest.raises(CapacityError, match="int32"), torch.inference_mode():
            llama(ids.to(DEVICE), cache)
        assert _snapshot_equal(before, cache.snapshot().tensors())


# ----- snapshots of caches that stored int64 positions -------------------------------------------


@pytest.fixture
def int64_positions(monkeypatch):
    """Caches made inside this fixture's ``on()`` store int64 positions, as kvcache once did."""

    class Switch:
        def on(self):
            monkeypatch.setattr(positions, "position_dtype", lambda limit=None: torch.long)

        def off(self):
            monkeypatch.undo()

    return Switch()


def _cache(model, name: str):
    policy, _, storage = name.partition(":")
    options = {} if policy == "dense" else kvcache.cache.budget_options(policy, C)
    return kvcache.make_cache(model, name, cache_length=64 if policy == "dense" else C, batch_size=2, options=options)


def _rows():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 128, (40,), generator=g).to(DEVICE) for _ in range(2)]


# Layouts named outright (an ``int<bits>`` name may hold full precision in a cache this small).
NAMES = ["dense", "dense:kivi4", "dense:kivi2", "window:token8", "sink:full", "h2o:kivi2", "snapkv:full", "tova:kivi4"]


@pytest.mark.parametrize("name", NAMES)
def test_a_snapshot_with_int64_positions_restores(llama, int64_positions, name):
    """A snapshot taken when slots held int64 positions restores into today's cache, which then
    continues bitwise as the old cache does."""
    rows = _rows()
    int64_positions.on()
    old = _cache(llama, name)
    int64_positions.off()
    assert old.layers[0].storage.pos.dtype == torch.long
    with torch.inference_mode():
        feed(llama, old, rows, BEFORE)
    snap = old.snapshot()
    new = _cache(llama, name)
    assert new.layers[0].storage.pos.dtype != torch.long
    new.restore(snap)
    done = [sum(n[b] for n in BEFORE) for b in range(2)]
    assert new.lengths.tolist() == done
    rest = [r[d:] for r, d in zip(rows, done)]
    with torch.inference_mode():
        a = _continue(llama, old, rest, AFTER)
        b = _continue(llama, new, rest, AFTER)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert torch.equal(old.layers[0].storage.pos, new.layers[0].storage.pos.long())


def test_a_snapshot_whose_positions_do_not_fit_is_refused(llama, int64_positions):
    """An int64 position beyond what the cache's slots hold (int8 for 64 slots) is refused with
    ValueError, and the cache is left as it was."""
    rows = _rows()
    int64_positions.on()
    old = _cache(llama, "dense")
    int64_positions.off()
    with torch.inference_mode():
        feed(llama, old, rows, BEFORE)
    tensors = dict(old.snapshot().tensors())
    tensors["layer1.storage.pos"] = tensors["layer1.storage.pos"].clone()
    tensors["layer1.storage.pos"][0, 0, 0] = 1000
    bad = Snapshot.from_tensors(old.policy, [layer.config() for layer in old.layers], tensors)
    cache = _cache(llama, "dense")
    with torch.inference_mode():
        feed(llama, cache, rows, BEFORE[:2])
    before = cache.snapshot().tensors()
    with pytest.raises(ValueError, match="storage.pos"):
        cache.restore(bad)
    assert _snapshot_equal(before, cache.snapshot().tensors())
    # Positions must be integers.
    tensors["layer1.storage.pos"] = tensors["layer1.storage.pos"].float()
    with pytest.raises(ValueError, match="storage.pos"):
        cache.restore(Snapshot.from_tensors(old.policy, [layer.config() for layer in old.layers], tensors))
    assert _snapshot_equal(before, cache.snapshot().tensors())
