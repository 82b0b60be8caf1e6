"""Snapshots, restores and forks, for every registered policy with every storage.

Continuing from a restored snapshot must give bitwise the same logits as continuing the cache
the snapshot was taken from (the same calls on the same state); the snapshot itself never
changes; a snapshot of another configuration is rejected before anything changes.
"""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE
from policy_util import feed

import kvcache

C = 12
# Ragged prefill, then decode steps past the budget (sink's renumbered decode keeps its sinks
# aside while rows are full, which a snapshot must see through), then more of both.
BEFORE = [[10, 8], [3, 3], [1, 1], [1, 1], [1, 1], [1, 1]]
AFTER = [[5, 2], [1, 1], [1, 1], [1, 1], [4, 6], [1, 1]]
CASES = [(p, s) for p in kvcache.policies() for s in kvcache.storages()]


def _cache(model, name: str, storage: str, batch_size: int = 2, cache_length: int = C, reserve: int = 0, **extra):
    options = {} if name == "dense" else kvcache.cache.budget_options(name, cache_length)
    length = 64 if name == "dense" else cache_length
    return kvcache.make_cache(model, f"{name}:{storage}", cache_length=length, batch_size=batch_size, reserve=reserve,
                              options={**options, **extra})


def _rows(n_rows: int, total: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (total,), generator=g).to(DEVICE) for _ in range(n_rows)]


def _continue(model, cache, rows, done: list[int]):
    """Feed ``AFTER`` from where ``BEFORE`` ended; returns each row's logits."""
    # (``feed`` counts lengths from zero; these rows start where the snapshot left them.)
    rest = [r[d:] for r, d in zip(rows, done)]
    start = cache.lengths.clone()
    g = torch.Generator().manual_seed(1)
    got = [[] for _ in rest]
    done = [0] * len(rest)
    for n in AFTER:
        T = max(n)
        chunk = torch.randint(0, 128, (len(rest), T), generator=g).to(DEVICE)
        for b in range(len(rest)):
            chunk[b, : n[b]] = rest[b][done[b] : done[b] + n[b]]
        with torch.inference_mode():
            logits = model(chunk, cache, n_tokens=n)
        for b in range(len(rest)):
            got[b].append(logits[b, : n[b]])
            done[b] += n[b]
    assert (cache.lengths - start).tolist() == done
    return [torch.cat(x) for x in got]


def _prefilled(model, name, storage, rows):
    cache = _cache(model, name, storage)
    with torch.inference_mode():
        feed(model, cache, rows, BEFORE)
    return cache


def _copy(snapshot) -> dict[str, torch.Tensor]:
    return {k: t.clone() for k, t in snapshot.tensors().items()}


@pytest.mark.parametrize("name,storage", CASES, ids=[f"{p}:{s}" for p, s in CASES])
def test_continuing_from_a_restored_snapshot_is_bitwise_identical(llama, name, storage):
    rows = _rows(2, 40, seed=3)
    done = [sum(n[b] for n in BEFORE) for b in range(2)]
    cache = _prefilled(llama, name, storage, rows)
    snap = cache.snapshot()
    frozen = _copy(snap)
    first = _continue(llama, cache, rows, done)
    # The snapshot is a copy: continuing the cache did not change it.
    assert all(torch.equal(frozen[k], t) for k, t in snap.tensors().items())

    fresh = cache.empty_like()
    fresh.restore(snap)
    assert fresh.lengths.tolist() == done
    second = _continue(llama, fresh, rows, done)
    # Back into the cache it came from, which has moved on since.
    cache.restore(snap)
    third = _continue(llama, cache, rows, done)
    for a, b, c in zip(first, second, third):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert all(torch.equal(frozen[k], t) for k, t in snap.tensors().items())


@pytest.mark.parametrize("name", list(kvcache.policies()))
def test_fork_continues_independently(llama, name):
    rows = _rows(2, 40, seed=4)
    done = [sum(n[b] for n in BEFORE) for b in range(2)]
    cache = _prefilled(llama, name, "full", rows)
    twin = cache.fork()
    a = _continue(llama, cache, rows, done)
    assert twin.lengths.tolist() == done  # the fork did not advance with the original
    b = _continue(llama, twin, rows, done)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("name", list(kvcache.policies()))
def test_rows_restore_into_other_rows(llama, name):
    """Rows are independent: row 1's snapshot in row 0 of another cache, and the reverse."""
    rows = _rows(2, 40, seed=5)
    done = [sum(n[b] for n in BEFORE) for b in range(2)]
    cache = _prefilled(llama, name, "full", rows)
    swapped = cache.empty_like()
    swapped.restore(cache.snapshot(rows=[1, 0]))
    assert swapped.lengths.tolist() == done[::-1]
    # Row by row, in the other order: the same state, so the same continuation.
    alt = cache.empty_like()
    alt.restore(cache.snapshot(rows=[1]), rows=[1])
    alt.restore(cache.snapshot(rows=[0]), rows=[0])
    a = _continue(llama, cache, rows, done)
    b = _continue(llama, alt, rows, done)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_snapshot_of_an_empty_cache_resets_rows(llama):
    """expected_attention's query sums exist only after a first call; an empty snapshot clears them."""
    for name in kvcache.policies():
        rows = _rows(2, 40, seed=6)
        empty = _cache(llama, name, "full").snapshot()
        cache = _prefilled(llama, name, "full", rows)
        cache.restore(empty)
        fresh = _cache(llama, name, "full")
        with torch.inference_mode():
            a = feed(llama, cache, rows, BEFORE)
            b = feed(llama, fresh, rows, BEFORE)
        assert all(torch.equal(x, y) for x, y in zip(a, b)), name


def _unchanged(cache, before) -> bool:
    after = cache.snapshot().tensors()
    return all(torch.equal(before[k], t) for k, t in after.items())


@pytest.mark.parametrize("kind", ["cache_length", "storage", "policy", "options", "reserve", "rows"])
def test_mismatched_restore_is_rejected_before_any_change(llama, kind):
    rows = _rows(2, 40, seed=7)
    snap = _prefilled(llama, "h2o", "full", rows).snapshot()
    make = {
        "cache_length": lambda: _cache(llama, "h2o", "full", cache_length=10),
        "storage": lambda: _cache(llama, "h2o", "int8"),
        "policy": lambda: _cache(llama, "tova", "full"),
        "options": lambda: kvcache.make_cache(llama, "h2o", cache_length=C, batch_size=2, options={"recent": 2}),
        "reserve": lambda: _cache(llama, "h2o", "full", reserve=2),
        "rows": lambda: _cache(llama, "h2o", "full", batch_size=3),
    }[kind]
    target = make()
    with torch.inference_mode():
        feed(llama, target, _rows(target.batch_size, 40, seed=8), [[5] * target.batch_size])
    before = target.snapshot().tensors()
    lengths = target.lengths.clone()
    with pytest.raises(ValueError, match="configuration|holds 2 rows"):
        target.restore(snap)
    assert torch.equal(target.lengths, lengths) and _unchanged(target, before)


def test_bad_rows_and_objects_are_rejected(llama):
    cache = _cache(llama, "window", "full")
    snap = cache.snapshot(rows=[0])
    for rows in ([0, 0], [2], [-1], [], [True], 0):
        with pytest.raises(ValueError, match="rows must"):
            cache.snapshot(rows=rows)
    with pytest.raises(ValueError, match="holds 1 rows"):
        cache.restore(snap)
    with pytest.raises(ValueError, match="expected a Snapshot"):
        cache.restore({"lengths": torch.zeros(2, dtype=torch.long, device=DEVICE)})


def test_headwise_budgets_snapshot(llama):
    budgets = [[3, 9], [8, 4]]
    rows = _rows(2, 40, seed=9)
    done = [sum(n[b] for n in BEFORE) for b in range(2)]
    cache = kvcache.make_cache(llama, "h2o", cache_length=C, batch_size=2, head_budgets=budgets, options={"recent": 2})
    with torch.inference_mode():
        feed(llama, cache, rows, BEFORE)
    snap = cache.snapshot()
    assert snap.layers[0]["head_budgets"] == [3, 9]
    a = _continue(llama, cache, rows, done)
    twin = cache.empty_like()
    twin.restore(snap)
    b = _continue(llama, twin, rows, done)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    other = kvcache.make_cache(llama, "h2o", cache_length=C, batch_size=2, head_budgets=[[4, 8], [8, 4]], options={"recent": 2})
    with pytest.raises(ValueError, match="head_budgets"):
        other.restore(snap)


def test_snapshot_round_trips_through_flat_tensors(llama):
    rows = _rows(2, 40, seed=10)
    cache = _prefilled(llama, "expected_attention", "int4", rows)
    snap = cache.snapshot()
    again = type(snap).from_tensors(snap.policy, snap.layers, snap.tensors())
    twin = cache.empty_like()
    twin.restore(again)
    assert _unchanged(twin, snap.tensors())
    assert snap.nbytes() == sum(t.numel() * t.element_size() for k, t in snap.tensors().items() if k != "lengths")
