"""knorm: evict the keys with the largest L2 norm first (Devoto et al. 2024, kvpress's KnormPress).

Keys with a small norm tend to receive the most attention, so a cache keeps the ``cache_length``
smallest-norm keys, per row and K/V head. RoPE is a rotation, so the norm of a stored (rotated)
key is the norm of the key itself. The score needs no attention weights: every path runs the
fused kernel, and a decode step costs one norm over the held keys. Options:
    recent   newest tokens always kept (0, as kvpress, which compresses the prompt only and
             never evicts what is generated; set it when decoding long into a full cache).
    sinks    first tokens always kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..base import CacheSpec
from ..candidates import Candidates
from ..evicting import PROTECTED, EvictingCache, coarse, require_room
from ..options import option


@dataclass(frozen=True)
class KnormOptions:
    recent: int = option(0, "newest tokens always kept")
    sinks: int = option(0, "first tokens always kept")

    def __post_init__(self) -> None:
        if self.recent < 0 or self.sinks < 0:
            raise ValueError(f"recent and sinks must be >= 0, got {self.recent}, {self.sinks}")


class KnormCache(EvictingCache):
    name = "knorm"
    description = "evict the keys with the largest L2 norm first (KnormPress), per row and K/V head"
    Options = KnormOptions
    per_head = True

    def __init__(self, spec: CacheSpec, options: KnormOptions) -> None:
        require_room(spec, "recent + sinks", options.recent + options.sinks)
        super().__init__(spec, options)

    def priority(self, c: Candidates) -> torch.Tensor:
        # In float32 whatever the model's dtype: a half-precision norm ties distinct keys. Cut
        # (``coarse``): one key twice, rotated to two positions, ties whatever the rounding.
        score = coarse(-torch.linalg.vector_norm(c.keys, dim=-1, dtype=torch.float32))  # (B, Hkv, N)
        protected = c.positions > c.newest - self.options.recent
        if self.options.sinks:
            protected |= c.positions < self.options.sinks
        return score.masked_fill(protected, PROTECTED)
