"""random: evict tokens at random (kvpress's RandomPress), the baseline every policy should beat.

Each call draws one uniform score per candidate from a generator seeded with ``score_seed`` (on the
CPU, as kvpress draws them), in position order over the tokens that compete, so that a prompt
compressed once keeps exactly the tokens kvpress's press keeps for the same seed. Every layer
and call draws the same sequence, as kvpress's press does. A decode step into a full cache (which
kvpress never takes) scores each token by a hash of its position, head and the seed instead, with
tensor operations only, so that a captured decode step (compile.py) ranks as the eager one. Options:
    score_seed  the seed of the generator (kvpress's ``seed``; named so that it is not
                generation's --seed on the command line).
    recent   newest tokens always kept.
    sinks    first tokens always kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..base import CacheSpec
from ..candidates import Candidates
from ..evicting import PROTECTED, EvictingCache, require_room
from ..options import option


@dataclass(frozen=True)
class RandomOptions:
    score_seed: int = option(0, "seed of the generator that draws the scores (kvpress: seed)")
    recent: int = option(0, "newest tokens always kept")
    sinks: int = option(0, "first tokens always kept")

    def __post_init__(self) -> None:
        if self.recent < 0 or self.sinks < 0:
            raise ValueError(f"recent and sinks must be >= 0, got {self.recent}, {self.sinks}")


class RandomCache(EvictingCache):
    name = "random"
    description = "evict at random (RandomPress, seeded), per row and K/V head: the baseline"
    Options = RandomOptions
    per_head = True

    def __init__(self, spec: CacheSpec, options: RandomOptions) -> None:
        require_room(spec, "recent + sinks", options.recent + options.sinks)
        super().__init__(spec, options)

    def priority(self, c: Candidates) -> torch.Tensor:
        B, H, N = c.keys.shape[:3]
        pos = c.positions.expand(B, H, N)
        if c.step.num_tokens == 1:
            score = self._hashed(pos)
        else:
            score = torch.zeros(B, H, N)
            one = (c.step.valid.sum(1) <= 1).tolist()  # rows adding one token decode, as they would alone
            hashed = self._hashed(pos).cpu()
            for b in range(B):
                if one[b]:
                    score[b] = hashed[b]
                    continue
                # Each row draws from its own freshly seeded generator, one score per non-empty
                # candidate in position order (empty slots, position -1, sort first and score 0), so
                # a row ranks as it would alone and a prompt as kvpress's k-th token does.
                order = pos[b].argsort(dim=-1, stable=True).cpu()  # (H, N)
                filled = int((pos[b, 0] >= 0).sum())
                generator = torch.Generator().manual_seed(self.options.score_seed)
                drawn = torch.rand(H, filled, generator=generator, dtype=c.keys.dtype).float()
                score[b].scatter_(1, order[:, N - filled:], drawn)
            score = score.to(c.keys.device)
        protected = c.positions > c.newest - self.options.recent
        if self.options.sinks:
            protected |= c.positions < self.options.sinks
        return score.masked_fill(protected, PROTECTED)

    def _hashed(self, pos: torch.Tensor) -> torch.Tensor:
        """(B, H, N) scores in [0, 1) from position, head and seed alone: a decode step (which
        kvpress never takes) ranks with tensor operations only, the same eager and captured."""
        head = torch.arange(pos.shape[1], device=pos.device).view(1, -1, 1)
        x = pos.double() * 12.9898 + head * 78.233 + self.options.score_seed * 37.719
        return torch.frac(torch.sin(x).abs() * 43758.5453).float()
