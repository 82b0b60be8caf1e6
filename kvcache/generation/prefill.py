"""Prefill: feed every row's prompt through the cache in chunks, taking what a prefix store has.

Chunks lie on a grid of positions: chunk g covers positions [g * chunk, (g + 1) * chunk) of every
row, so a prompt is cut at the same places whether or not a stored prefix let it skip its first
chunks. A row that starts from a stored prefix joins at the chunk holding its first token to
compute (dense prefixes can end anywhere; other caches' prefixes end on the grid).

With ``aligned=True`` each prompt is prefilled alone (batch 1) on the grid, from a prefix that
ends on the grid, and copied into its row afterwards: its state then depends on its own tokens
only, never on the other rows or on what the store held, and a run that reuses a prefix makes
exactly the calls that a run without it makes after that prefix. On one device the logits are
bitwise equal (tests/prefix/test_store.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..cache.base import KVCache
from ..model.transformer import Transformer
from ..prefix.store import PrefixStore

# on_prefill(done, total): prompt tokens processed (or taken from the store) so far, and in all.
ProgressCallback = Callable[[int, int], None]

# Rows of a batch that start with the same tokens the store lacks have that prefix prefilled once,
# alone, before the batch, if it is at least this long: a separate call for fewer tokens costs
# about what it saves.
SHARED_MIN = 64


def prefill(
    model: Transformer,
    cache: KVCache,
    rows: Sequence[Sequence[int]],
    *,
    chunk: int | None,
    store: PrefixStore | None = None,
    aligned: bool = False,
    on_prefill: ProgressCallback | None = None,
) -> torch.Tensor:
    """Feed the prompts ``rows`` (token ids, one list per row of the empty ``cache``) and return
    the logits (B, vocab) of each row's last prompt token.

    chunk: prompt tokens per forward pass, the grid (None: each prompt in one pass).
    store: take each row's longest stored prefix (never its last token) and store what is computed.
    aligned: prefill each prompt alone on the grid (see module docstring); needs ``chunk``.
    """
    if aligned and chunk is None:
        raise ValueError("aligned=True prefills on a fixed grid of prefill_chunk tokens: give a prefill_chunk")
    if store is not None:
        store.bind(model, cache, chunk=chunk, aligned=aligned)
    total = sum(map(len, rows))
    if not aligned or len(rows) == 1:
        if store is not None and len(rows) > 1:
            _prefill_shared(model, cache, rows, chunk, store)
        return _prefill(model, cache, rows, chunk, store, _progress(on_prefill, 0, total))
    logits = []
    done = 0
    for b, row in enumerate(rows):
        alone = cache.empty_like(batch_size=1)
        logits.append(_prefill(model, alone, [row], chunk, store, _progress(on_prefill, done, total))[0])
        cache.restore(alone.snapshot(), rows=[b])
        done += len(row)
    return torch.stack(logits)


def _prefill_shared(model, cache: KVCache, rows, chunk: int | None, store: PrefixStore) -> None:
    """Prefill alone, and store, each prefix that two or more rows start with (short of their
    last tokens, and cut to what the store keeps) and that the store does not hold yet, longest
    first, so that every row then restores it rather than computing it again in the batch.
    (Aligned prefills are one prompt at a time, so later rows reuse earlier ones anyway.)"""
    seeds = set()
    for i, a in enumerate(rows):
        for b in rows[i + 1 :]:
            n = store.boundary(min(_common(a, b), len(a) - 1, len(b) - 1))
            if n >= SHARED_MIN:
                seeds.add(tuple(a[:n]))
    for seed in sorted(seeds, key=len, reverse=True):
        # A prompt that continues the seed (one more token) would reuse all of it: already held.
        if store.reusable(list(seed) + [0]) < len(seed):
            _prefill(model, cache.empty_like(batch_size=1), [list(seed)], chunk, store, lambda done: None)


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _progress(on_prefill: ProgressCallback | None, before: int, total: int) -> Callable[[int], None]:
    def report(done: int) -> None:
        if on_prefill is not None:
            on_prefill(before + done, total)

    return report


def _prefill(model, cache: KVCache, rows, chunk: int | None, store: PrefixStore | None,
             report: Callable[[int], None]) -> torch.Tensor:
    """The grid loop (module docstring) over ``rows`` into the empty ``cache``, after each row
    took its stored prefix; stores after every chunk. Returns (B, vocab) last-token logits."""
    B = len(rows)
    lengths = [len(p) for p in rows]
    longest = max(lengths)
    step = chunk or longest
    starts = [0] * B if store is None else [store.restore(cache, b, row) for b, row in enumerate(rows)]
    device = model.embed_tokens.weight.device
    # Right-padded prompts, with a chunk of room so that a row starting off the grid can be cut
    # a full chunk wide.
    padded = torch.zeros(B, longest + step, dtype=torch.long)
    for b, p in enumerate(rows):
        padded[b, : len(p)] = torch.tensor(p)
    next_logits = torch.empty(B, model.config.vocab_size, device=device)
    first = min(starts) // step * step
    for begin in range(first, longest, step):
        lo = [max(begin, s) for s in starts]
        n = [max(min(begin + step, L) - a, 0) for a, L in zip(lo, lengths)]
        width = max(n)
        if width == 0:
            continue
        ids = torch.stack([padded[b, lo[b] : lo[b] + width] for b in range(B)]).to(device)
        logits = model(ids, cache, n_tokens=n, last_only=True)[:, 0]
        # Rows whose prompt ends in this chunk take their next-token logits from it.
        ends = torch.tensor([k > 0 and a + k == L for a, k, L in zip(lo, n, lengths)], device=device)
        next_logits = torch.where(ends[:, None], logits.to(next_logits.dtype), next_logits)
        if store is not None:
            for b in range(B):
                if n[b]:
                    store.add(cache, b, rows[b][: lo[b] + n[b]], on_grid=True)
        report(sum(min(L, begin + step) if s < begin + step else s for s, L in zip(starts, lengths)))
    return next_logits
