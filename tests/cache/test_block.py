"""``block=N``, an option of every policy: evict whole aligned blocks of N positions.

  * block=1 is each policy's token-level behaviour, unchanged;
  * with block=N every kept block is complete except the one holding the row's newest position,
    no row holds more than cache_length tokens, and each query sees exactly what was kept before
    its call plus its chunk up to itself (attention happens before eviction);
  * window and sink keep the newest blocks (and sink its sink blocks) as many as fit;
  * a budget that covers the sequence gives the plain forward's logits;
  * bad values fail in make_cache with a message that says what to change.
"""

from __future__ import annotations

import pytest
import torch
from policy_util import EXACT_ATOL, AttentionRecorder, feed, ids_for, kept, max_diff, visible_sets

import kvcache

ATOL = EXACT_ATOL[torch.float32]
VOCAB = 128  # the conftest llama
EVICTING = [name for name in kvcache.policies() if name != "dense"]
BLOCK = 4
# Two ragged rows: multi-token chunks (one with padding), a row sitting out, decode steps.
LENGTHS = [23, 17]
SCHEDULE = [[9, 5], [1, 1], [6, 0], [1, 4], [1, 1], [2, 6], [1, 1], [1, 1], [1, 1]]


def _options(name: str, C: int, **extra) -> dict:
    options = kvcache.cache.budget_options(name, C)
    if name == "sink":
        options.update(sinks=BLOCK, positions="absolute")
    return {**options, **extra}


def _rows():
    return [ids_for(L, seed=i, vocab=VOCAB)[0] for i, L in enumerate(LENGTHS)]


def _schedule():
    done, schedule = [0, 0], []
    for n in SCHEDULE:
        n = [min(k, L - d) for k, L, d in zip(n, LENGTHS, done)]
        done = [d + k for d, k in zip(done, n)]
        schedule.append(n)
    rest = [L - d for L, d in zip(LENGTHS, done)]
    if any(rest):
        schedule.append(rest)
    return schedule


def _blocks(positions: list[int]) -> dict[int, list[int]]:
    blocks: dict[int, list[int]] = {}
    for p in positions:
        blocks.setdefault(p // BLOCK, []).append(p)
    return blocks


@pytest.mark.parametrize("name", EVICTING)
def test_block_one_is_the_token_level_policy(llama, name):
    C = 8
    rows, schedule = _rows(), _schedule()
    options = _options(name, C)
    plain = kvcache.make_cache(llama, name, cache_length=C, batch_size=2, options=options)
    one = kvcache.make_cache(llama, name, cache_length=C, batch_size=2, block=1, options=options)
    got_plain = feed(llama, plain, rows, schedule)
    got_one = feed(llama, one, rows, schedule)
    for a, b in zip(got_plain, got_one):
        assert torch.equal(a, b)
    for la, lb in zip(plain.layers, one.layers):
        assert [kept(la, b) for b in range(2)] == [kept(lb, b) for b in range(2)]


@pytest.mark.parametrize("reserve", [0, BLOCK])
@pytest.mark.parametrize("name", EVICTING)
def test_kept_positions_are_whole_blocks(llama, name, reserve):
    C = 3 * BLOCK
    if reserve and name in ("window", "sink"):
        pytest.skip("reserve applies to scoring policies")
    cache = kvcache.make_cache(llama, name, cache_length=C, batch_size=2, block=BLOCK, reserve=reserve,
                               options=_options(name, C))
    recorder = AttentionRecorder(cache)
    before = [[[[] for _ in range(layer.storage.pos.shape[1])] for _ in LENGTHS] for layer in cache.layers]
    evicted = False

    def check(cache, n, T):
        nonlocal before, evicted
        lengths = cache.lengths.tolist()
        now = [[kept(layer, b) for b in range(2)] for layer in cache.layers]
        for i, _layer in enumerate(cache.layers):
            for b, L in enumerate(lengths):
                for h, held in enumerate(now[i][b]):
                    where = f"layer {i} row {b} head {h} length {L}: {held}"
                    assert len(held) <= C and len(set(held)) == len(held), where
                    assert all(0 <= p < L for p in held), where
                    evicted |= len(held) < L
                    newest = (L - 1) // BLOCK
                    blocks = _blocks(held)
                    assert blocks.get(newest) == list(range(newest * BLOCK, L)), where
                    for k, members in blocks.items():
                        if k != newest:
                            assert members == list(range(k * BLOCK, (k + 1) * BLOCK)), where
                    if L > C and not reserve:
                        # As many whole blocks as fit besides the newest one.
                        assert len(held) > C - BLOCK, where
                    if name == "window":
                        assert held == list(range(max(0, newest * BLOCK - (len(held) - (L - newest * BLOCK))), L)), where
                    if name == "sink":
                        assert held[:BLOCK] == list(range(min(L, BLOCK))), where
                        assert held[BLOCK:] == list(range(L - len(held) + BLOCK, L)) if L > C else True, where
        # Attention before eviction: each query sees what was kept plus its chunk up to itself.
        calls = [call for call in recorder.calls if call["q_pos"].shape[1] == T]
        assert len(calls) == len(cache.layers)
        for i, call in enumerate(calls):
            for b, L in enumerate(lengths):
                start = L - n[b]
                for t in range(n[b]):
                    for h, seen in enumerate(visible_sets(call, b, t)):
                        assert seen == sorted(before[i][b][h] + list(range(start, start + t + 1)))
        before = now
        recorder.clear()

    with recorder.patch():
        feed(llama, cache, _rows(), _schedule(), after_call=check)
    assert evicted


@pytest.mark.parametrize("name", EVICTING)
def test_block_budget_covering_the_sequence_is_dense(llama, name):
    rows, schedule = _rows(), _schedule()
    C = 6 * BLOCK  # >= every row's length
    cache = kvcache.make_cache(llama, name, cache_length=C, batch_size=2, block=BLOCK, options=_options(name, C))
    got = feed(llama, cache, rows, schedule)
    for row, logits in zip(rows, got):
        assert max_diff(logits, llama(row[None])[0]) <= ATOL


def test_block_options_are_checked(llama):
    with pytest.raises(ValueError, match="block must be a positive int"):
        kvcache.make_cache(llama, "h2o", cache_length=16, block=0)
    with pytest.raises(ValueError, match="block must be a positive int"):
        kvcache.make_cache(llama, "h2o", cache_length=16, block=True)
    with pytest.raises(ValueError, match="block=32 does not fit the window policy's smallest budget"):
        kvcache.make_cache(llama, "window", cache_length=16, block=32)
    with pytest.raises(ValueError, match="budget less reserve"):
        kvcache.make_cache(llama, "h2o", cache_length=16, reserve=10, block=8)
    with pytest.raises(ValueError, match="positions='absolute'"):
        kvcache.make_cache(llama, "sink", cache_length=16, block=4, options={"sinks": 4, "positions": "renumbered"})
    # dense never evicts: any block size is accepted and changes nothing.
    assert kvcache.make_cache(llama, "dense", cache_length=16, block=64).layers[0].spec.block == 64


def test_a_captured_decode_step_refuses_blocks(llama):
    from kvcache.generation.compiled import check_capturable

    with pytest.raises(ValueError, match="this cache keeps whole blocks \\(block=4\\). Use compile=False, or block=1"):
        check_capturable(kvcache.make_cache(llama, "h2o", cache_length=16, block=4))
    check_capturable(kvcache.make_cache(llama, "dense", cache_length=16, block=4))  # dense never evicts
