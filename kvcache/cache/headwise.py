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

    def advance_decode(self) -> None:
        for head in self.heads:
            head.advance_decode()

    def reset(self) -> None:
        for head in self.heads:
            head.reset()

    def nbytes(self) -> int:
        return sum(head.nbytes() for head in self.heads)

    # ----- state (snapshots): each head's, under ``head{h}.`` ---------------------------------
    @property
    def chunking_invariant(self) -> bool:
        return self.heads[0].chunking_invariant

    def state(self) -> dict[str, torch.Tensor]:
        return {f"head{h}.{name}": t for h, head in enumerate(self.heads) for name, t in head.state().items()}

    def _split(self, state) -> list[dict[str, torch.Tensor]]:
        """``state`` by head; raises ValueError on a name that belongs to no head."""
        parts: list[dict[str, torch.Tensor]] = [{} for _ in self.heads]
        for key, t in state.items():
            head, _, name = key.partition(".")
            h = head.removeprefix("head")
            if not head.startswith("head") or not h.isdigit() or int(h) >= len(self.heads):
                raise ValueError(f"the {self.name} layer: {key!r} names none of its {len(self.heads)} heads")
            parts[int(h)][name] = t
        return parts

    def check_state(self, state, rows: int) -> None:
        for head, part in zip(self.heads, self._split(state)):
            head.check_state(part, rows)

    def load_state(self, state, rows: torch.Tensor) -> None:
        for head, part in zip(self.heads, self._split(state)):
            head.load_state(part, rows)

    def config(self) -> dict[str, object]:
        return {**super().config(), "head_budgets": self.budgets}

    def empty_like(self, batch_size: int) -> HeadwiseCache:
        spec = dataclasses.replace(self.spec, batch_size=batch_size)
        return HeadwiseCache(spec, type(self.heads[0]), self.options, self.budgets)
