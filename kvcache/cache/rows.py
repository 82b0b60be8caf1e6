"""Several caches run as the rows of one batch.

A small model decoding one row reads every weight for one token; comparing policies on one
prompt (the cells of an eval sweep) is then bound by reading the weights once per cache. Given to
the model in place of a ``KVCache``, ``Rows([cache_a, cache_b, ...])`` lets one model call serve
them all: the projections, norms, MLPs and the head run once over the stacked rows, and each
row's attention goes to its own cache, whatever its policy, storage, size or length.

What each cache sees is what it sees when it runs alone: ``begin`` asks each cache for its own
step over its rows (every check it makes; a call that any of them rejects changes none of them),
each layer hands each cache's (B_i, H, T, D) slice of the queries, keys and values to that
cache's layer with that step, and ``commit`` advances each cache. So each row's attention is its
cache's own computation; the batched matmuls around it may round differently from one row's,
which is the only difference from running the caches one after another.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch

from .base import KVCache, Step


@dataclass(frozen=True)
class RowsStep(Step):
    """The step of a call over ``Rows``: the caches' own steps (``parts``, one per cache, in
    order) and, in the fields every ``Step`` has, their rows stacked, as the model reads them
    (positions, last_index, span_end)."""

    parts: tuple[Step, ...] = ()


class RowsLayer:
    """One layer of ``Rows``: the caches' layers of that index, each given its own rows."""

    def __init__(self, layers: Sequence, bounds: Sequence[tuple[int, int]]) -> None:
        self.layers = list(layers)
        self.bounds = list(bounds)

    def check(self, step: Step) -> None:
        """Nothing to add: ``Rows.begin`` had each cache check its own step."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: RowsStep) -> torch.Tensor:
        """q (B, Hq, T, D), k and v (B, Hkv, T, D) over every cache's rows -> (B, Hq, T, D)."""
        outs = [layer.attend(q[a:b], k[a:b], v[a:b], part)
                for layer, (a, b), part in zip(self.layers, self.bounds, step.parts, strict=True)]
        return outs[0] if len(outs) == 1 else torch.cat(outs)


class Rows:
    """``caches`` (one or more ``KVCache``, each made for the same model) as the rows of one
    batch, in order: cache 0's rows first. Pass it where a model takes a cache; its rows are
    ``batch_size`` = the caches' batch sizes summed. The caches stay usable on their own."""

    def __init__(self, caches: Sequence[KVCache]) -> None:
        caches = list(caches)
        if not caches:
            raise ValueError("Rows needs at least one cache")
        if len({id(c) for c in caches}) != len(caches):
            raise ValueError("a cache appears twice in Rows: each cache can hold only one place in the batch")
        counts = {len(c.layers) for c in caches}
        if len(counts) > 1:
            raise ValueError(f"the caches have different layer counts ({sorted(counts)}): they must be "
                             "made for the same model")
        self.caches = caches
        ends = list(accumulate(c.batch_size for c in caches))
        self.bounds = list(zip([0] + ends[:-1], ends))
        self.layers = [RowsLayer([c.layers[i] for c in caches], self.bounds) for i in range(len(caches[0].layers))]

    @property
    def batch_size(self) -> int:
        return self.bounds[-1][1]

    @property
    def lengths(self) -> torch.Tensor:
        """(B,) long, CPU: the tokens each row has seen (its cache's ``lengths``)."""
        return torch.cat([c.lengths for c in self.caches])

    def check_model(self, model: torch.nn.Module) -> None:
        for cache in self.caches:
            cache.check_model(model)

    def begin(self, input_ids: torch.Tensor, n_tokens: torch.Tensor | list[int] | None,
              model: torch.nn.Module | None = None) -> RowsStep:
        """Each cache's step over its rows of ``input_ids`` (B, T), stacked (``KVCache.begin``)."""
        if input_ids.dim() != 2 or input_ids.shape[0] != self.batch_size:
            raise ValueError(f"input_ids must have shape ({self.batch_size}, T) for the {len(self.caches)} "
                             f"caches' {self.batch_size} rows, got {tuple(input_ids.shape)}")
        n = None if n_tokens is None else torch.as_tensor(n_tokens).cpu()
        if n is not None and n.shape != (self.batch_size,):
            raise ValueError(f"n_tokens must have shape ({self.batch_size},), got {tuple(n.shape)}")
        parts = tuple(c.begin(input_ids[a:b], None if n is None else n[a:b], model)
                      for c, (a, b) in zip(self.caches, self.bounds))
        cat = {name: torch.cat([getattr(p, name) for p in parts])
               for name in ("positions", "valid", "append_slot", "last_index", "newest", "start", "n_tokens")}
        starts = cat["start"]
        return RowsStep(
            **cat,
            fresh=all(p.fresh for p in parts),
            uniform=all(p.uniform for p in parts) and int(starts.min()) == int(starts.max()),
            span_end=max(p.span_end for p in parts),
            min_start=min(p.min_start for p in parts),
            start0=parts[0].start0,
            decode=all(p.decode for p in parts),
            parts=parts,
        )

    def commit(self, step: RowsStep) -> None:
        """Advance each cache by its own step."""
        for cache, part in zip(self.caches, step.parts, strict=True):
            cache.commit(part)

    def __repr__(self) -> str:
        return f"Rows({', '.join(f'{c.policy!r}' for c in self.caches)}; batch_size={self.batch_size})"
