"""dense: keep every token. Exact: the result equals the model's forward without a cache."""

from __future__ import annotations

import torch

from ... import attention
from ..base import CacheSpec, LayerCache, Step, capacity_error
from ..storage import make_storage


class DenseCache(LayerCache):
    """Appends every token; a chunk that would exceed ``cache_length`` is rejected."""

    name = "dense"
    description = "keep every token (exact; fails when cache_length is exceeded)"

    evicts = False

    def __init__(self, spec: CacheSpec, options: object = None) -> None:
        super().__init__(spec, options)
        self.storage = make_storage(spec)

    def check(self, step: Step) -> None:
        if step.span_end > self.spec.cache_length:
            raise capacity_error(step, self.spec.cache_length, self.name)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: Step) -> torch.Tensor:
        T = step.num_tokens
        if step.uniform:
            self.storage.write_slice(step.start0, k, v, step.positions)
        else:
            self.storage.write(step.append_slot, k, v, step.positions)
        if step.fresh:
            # Attend over the bits the cache keeps, as every later step will: the result then
            # does not depend on how the sequence is chunked, whatever the storage.
            return attention.causal(q, *self.storage.roundtrip(k, v), window=self.spec.window)
        span = step.span_end
        ks, vs, pos = self.storage.view(span)
        # A one-token step over a uniformly filled cache sees every slot, unless a model window cuts it.
        all_visible = step.uniform and T == 1 and (self.spec.window is None or span <= self.spec.window)
        return attention.masked(q, ks, vs, step.positions, pos, window=self.spec.window, all_visible=all_visible)

    def reset(self) -> None:
        self.storage.reset()

    def nbytes(self) -> int:
        return self.storage.nbytes()
