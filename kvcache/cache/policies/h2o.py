"""h2o (Heavy-Hitter Oracle): the ``recent`` newest tokens plus those with the most attention.

Each row and K/V head keeps its own tokens. A token's score is the attention it has received,
summed over the queries that saw it and over the query heads of its group, weighted by value norms if asked, accumulated from the
attention the cache computes anyway (chunked prefill included). Options:
    recent       newest tokens always kept.
    sinks        first tokens always kept (H2O with attention sinks).
    normalize    divide the score by the number of queries that could see the token, so old
                 tokens are not favoured just for having been seen more often.
    value_norm   weight each score by the norm of the token's value vector: a token that is
                 attended but carries a near-zero value contributes little to the output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..base import CacheSpec, Step
from ..evicting import PROTECTED, EvictingCache, newest


@dataclass(frozen=True)
class H2OOptions:
    recent: int = 32
    sinks: int = 0
    normalize: bool = False
    value_norm: bool = False

    def __post_init__(self) -> None:
        if self.recent < 0 or self.sinks < 0:
            raise ValueError(f"recent and sinks must be >= 0, got {self.recent}, {self.sinks}")


class H2OCache(EvictingCache):
    name = "h2o"
    description = "Heavy-Hitter Oracle: `recent` newest + most-attended tokens, per row and K/V head"
    Options = H2OOptions
    per_head = True
    stats = ("score",)
    needs_attention = True
    observe_every_step = True

    def __init__(self, spec: CacheSpec, options: H2OOptions) -> None:
        room = spec.cache_length - spec.reserve
        if options.recent + options.sinks >= room:
            raise ValueError(
                f"recent + sinks ({options.recent + options.sinks}) must be smaller than cache_length "
                f"({spec.cache_length})" + (f" - reserve ({spec.reserve})" if spec.reserve else "")
                + " to leave room for heavy hitters"
            )
        # How many queries saw each token is needed (and kept) only to normalize.
        self.stats = ("score", "seen") if options.normalize else ("score",)
        super().__init__(spec, options)

    def observe(self, stat, mass, seen, pos, values, step: Step) -> None:
        if self.options.value_norm:
            mass = mass * values.float().norm(dim=-1)
        stat["score"] += mass
        if self.options.normalize:
            stat["seen"] += seen

    def priority(self, stat, pos: torch.Tensor, step: Step) -> torch.Tensor:
        score = stat["score"]
        if self.options.normalize:
            score = score / stat["seen"].clamp(min=1.0)
        # A uniform step's newest position is known on the host: one comparison with a number.
        newest_pos = step.start0 + step.num_tokens - 1 if step.uniform else newest(step)
        protected = pos > newest_pos - self.options.recent
        if self.options.sinks:
            protected |= pos < self.options.sinks
        # Protected tokens outrank every score (any score + PROTECTED rounds to PROTECTED anyway).
        return score.masked_fill(protected, PROTECTED)
