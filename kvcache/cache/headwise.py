"""Head-wise budgets (Ada-KV style): each K/V head of a layer gets its own capacity.

The saving is real: a layer is a set of single-head caches, each allocated at its own size,
rather than a full-size buffer with some slots masked. Any policy works per head; the layer
splits the query heads by group and concatenates the outputs. (The allocation itself is
computed in budgets.py.)
"""

from __future__ import annotations

import dataclasses

import torch

from .base import CacheSpec, LayerCache, Step


class HeadwiseCache(LayerCache):
    """One layer whose K/V head h is a single-head ``cls`` cache of ``budgets[h]`` slots."""

    def __init__(self, spec: CacheSpec, cls: type[LayerCache], options: object, budgets: list[int]) -> None:
        if len(budgets) != spec.num_kv_heads or min(budgets) <= 0:
            raise ValueError(f"need {spec.num_kv_heads} positive head budgets, got {budgets}")
        super().__init__(spec, options)
        self.name = cls.name
        self.heads = [
            cls(dataclasses.replace(spec, num_kv_heads=1, cache_length=b), options) for b in budgets
        ]

    @property
    def budgets(self) -> list[int]:
        return [h.spec.cache_length for h in self.heads]

    def check(self, step: Step) -> None:
        for head in self.heads:
            head.check(step)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: Step) -> torch.Tensor:
        G = q.shape[1] // k.shape[1]
        outs = [
            head.attend(q[:, h * G : (h + 1) * G], k[:, h : h + 1], v[:, h : h + 1], step)
            for h, head in enumerate(self.heads)
        ]
        return torch.cat(outs, dim=1)

    def reset(self) -> None:
        for head in self.heads:
            head.reset()

    def nbytes(self) -> int:
        return sum(head.nbytes() for head in self.heads)
