"""h2o (Heavy-Hitter Oracle): the ``recent`` newest tokens plus those with the most attention.

Each row and K/V head keeps its own tokens. A token's score is the attention it has received,
summed over the queries that saw it and over the query heads of its group (weighted by value
norms if asked), accumulated from the attention the cache computes anyway (chunked prefill
included).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..base import CacheSpec
from ..candidates import Candidates
from ..evicting import PROTECTED, EvictingCache, require_room
from ..options import option


@dataclass(frozen=True)
class H2OOptions:
    recent: int = option(32, "newest tokens always kept")
    sinks: int = option(0, "first tokens always kept (H2O with attention sinks)")
    normalize: bool = option(False, "divide a token's score by the number of queries that could see it, "
                                    "so old tokens are not favoured for having been seen more often")
    value_norm: bool = option(False, "weight each score by the norm of the token's value vector")

    def __post_init__(self) -> None:
        if self.recent < 0 or self.sinks < 0:
            raise ValueError(f"recent and sinks must be >= 0, got {self.recent}, {self.sinks}")


class H2OCache(EvictingCache):
    name = "h2o"
    description = "Heavy-Hitter Oracle: `recent` newest + most-attended tokens, per row and K/V head"
    Options = H2OOptions
    per_head = True
    stat_names = ("score",)
    needs_attention = True
    observe_every_step = True

    @classmethod
    def options_for_budget(cls, cache_length: int) -> dict[str, object]:
        # The paper splits the budget evenly between recent tokens and heavy hitters.
        return {"recent": cache_length // 2}

    def __init__(self, spec: CacheSpec, options: H2OOptions) -> None:
        require_room(spec, "recent + sinks", options.recent + options.sinks, " to leave room for heavy hitters")
        self.stat_names = self.stat_names_for(options)
        super().__init__(spec, options)

    @staticmethod
    def stat_names_for(options: H2OOptions) -> tuple[str, ...]:
        """The per-slot statistics kept: how many queries saw each token only to normalize."""
        return ("score", "seen") if options.normalize else ("score",)

    def observe(self, c: Candidates) -> None:
        mass = c.mass
        if self.options.value_norm:
            mass = mass * c.values.float().norm(dim=-1)
        c.stats["score"] += mass
        if self.options.normalize:
            c.stats["seen"] += c.seen

    def priority(self, c: Candidates) -> torch.Tensor:
        # Protected tokens outrank every score (any score + PROTECTED rounds to PROTECTED anyway).
        return self.heavy(c).masked_fill(self.protected(c), PROTECTED)

    def heavy(self, c: Candidates) -> torch.Tensor:
        """(B, Hp, N) the accumulated attention of each candidate (per query that saw it, with
        ``normalize``)."""
        score = c.stats["score"]
        if self.options.normalize:
            score = score / c.stats["seen"].clamp(min=1.0)
        return score

    def protected(self, c: Candidates) -> torch.Tensor:
        """(B, Hp, N) bool: the recent tokens and the sinks, kept whatever their score."""
        protected = c.positions > c.newest - self.options.recent
        if self.options.sinks:
            protected |= c.positions < self.options.sinks
        return protected
