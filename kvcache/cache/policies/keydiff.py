"""keydiff: evict the keys most similar to the average key direction (Park et al. 2025, kvpress's
KeyDiffPress).

The anchor is the mean of the candidates' unit-normalised keys, per row and K/V head; a token's
score is minus the cosine similarity of its key to that anchor, so the most distinctive keys stay.
Like knorm it needs no attention weights and no queries (query-agnostic), and every path runs the
fused kernel. The anchor is taken over the tokens that compete (held and new), which is the whole
context when a prompt is compressed once, as kvpress does. Options:
    recent   newest tokens always kept (0, as kvpress, which never evicts what is generated).
    sinks    first tokens always kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..base import CacheSpec
from ..candidates import Candidates
from ..evicting import PROTECTED, EvictingCache, require_room
from ..options import option


@dataclass(frozen=True)
class KeyDiffOptions:
    recent: int = option(0, "newest tokens always kept")
    sinks: int = option(0, "first tokens always kept")

    def __post_init__(self) -> None:
        if self.recent < 0 or self.sinks < 0:
            raise ValueError(f"recent and sinks must be >= 0, got {self.recent}, {self.sinks}")


class KeyDiffCache(EvictingCache):
    name = "keydiff"
    description = "evict the keys most similar to the mean key direction (KeyDiffPress), per row and K/V head"
    Options = KeyDiffOptions
    per_head = True

    def __init__(self, spec: CacheSpec, options: KeyDiffOptions) -> None:
        require_room(spec, "recent + sinks", options.recent + options.sinks)
        super().__init__(spec, options)

    def priority(self, c: Candidates) -> torch.Tensor:
        keys = c.keys.float()  # (B, Hkv, N, D)
        present = (~c.empty).float().unsqueeze(-1)  # (B, Hkv, N, 1): empty slots take no part in the anchor
        unit = F.normalize(keys, p=2, dim=-1) * present
        anchor = unit.sum(2, keepdim=True) / present.sum(2, keepdim=True).clamp(min=1.0)  # (B, Hkv, 1, D)
        score = -F.cosine_similarity(keys, anchor, dim=-1)  # (B, Hkv, N)
        protected = c.positions > c.newest - self.options.recent
        if self.options.sinks:
            protected |= c.positions < self.options.sinks
        return score.masked_fill(protected, PROTECTED)
