"""sink (StreamingLLM): the first ``sinks`` tokens plus the most recent ones.

Position modes:
    absolute    every key keeps the phase of its true position; a query at position p sees the
                sinks at distance p - s, which grows without bound.
    renumbered  positions are assigned within the cache, as in the paper: the sinks keep 0..S-1
                and the recent keys follow contiguously, so no distance exceeds ``cache_length``.

Renumbering is exact and rotates no stored key. Keys are stored rotated at their true
positions. Once a row has seen more than ``cache_length`` tokens, a query at p is assigned
p - shift with shift = p - (cache_length - 1), and so are the recent keys (p' - shift); their
relative distance, which is all RoPE scores depend on, is unchanged, so they are scored as
stored. Only the distance to a sink changes (from p - s to p - shift - s): the sinks' scores are
taken with the query rotated back by shift (``sink_queries``), the one mechanism of every path
(prefill, decode, compiled, packed codes, training). (Exact up to the float32 rounding of RoPE
angles, which every implementation shares: at position 1e5 the logits of a renumbered step
differ from re-embedding the kept tokens from scratch by about 1e-3.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...model.rope import apply_rope, rope_angles
from ..base import CacheSpec, Step
from ..evicting import require_room
from ..options import option
from ..ring import RingCache

MODES = ("absolute", "renumbered")


@dataclass(frozen=True)
class SinkOptions:
    sinks: int = option(4, "first tokens always kept (the attention sinks)")
    positions: str = option("renumbered", "positions attention uses: the true ones, or renumbered within "
                                          "the cache as in the paper", MODES)

    def __post_init__(self) -> None:
        if self.sinks < 0:
            raise ValueError(f"sinks must be >= 0, got {self.sinks}")


class SinkCache(RingCache):
    name = "sink"
    description = "StreamingLLM: first `sinks` tokens + most recent (positions absolute or renumbered)"
    Options = SinkOptions

    @classmethod
    def options_for_budget(cls, cache_length: int) -> dict[str, object]:
        # StreamingLLM keeps 4 sinks; a small budget keeps a quarter of itself.
        return {"sinks": max(1, min(4, cache_length // 4))}

    def __init__(self, spec: CacheSpec, options: SinkOptions) -> None:
        require_room(spec, "sinks", options.sinks)
        if options.positions == "renumbered" and spec.block > 1:
            raise ValueError(f"renumbered sink positions need a ring of single tokens; with block={spec.block} "
                             "pass positions='absolute'")
        if options.positions == "renumbered" and spec.inv_freq is None:
            raise ValueError("renumbered sink positions need the model's rotary frequencies (spec.inv_freq)")
        super().__init__(spec, options)

    def lookback(self) -> int | None:
        return self.spec.cache_length - self.options.sinks

    def sinks(self) -> int:
        return self.options.sinks

    def shift(self, q_pos: torch.Tensor) -> torch.Tensor:
        """How far renumbering moves a query at q_pos (B, T) (and every recent key) back."""
        return (q_pos - (self.spec.cache_length - 1)).clamp(min=0)

    def assigned_positions(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions the attention uses: query (B, T) and key (B, 1, T, S) for keys at k_pos (B, 1, S)."""
        if self.options.positions == "absolute":
            return q_pos, k_pos.unsqueeze(2).expand(-1, -1, q_pos.shape[1], -1)
        shift = self.shift(q_pos)[:, None, :, None]
        kp = k_pos.unsqueeze(2)
        return q_pos - self.shift(q_pos), torch.where(kp < self.options.sinks, kp, kp - shift)

    def sink_queries(self, q: torch.Tensor, step: Step) -> torch.Tensor | None:
        if self.options.positions == "absolute" or self.options.sinks == 0:
            return None
        if step.known and step.span_end <= self.spec.cache_length:
            return None  # no position has reached cache_length yet: nothing is renumbered
        # q: (B, Hq, T, D) rotated at p; rotate by -shift to p - shift for scoring sinks. The
        # angles are alike in every layer of this cache length: computed once per call.
        key = ("sink_unshift_angles", self.spec.cache_length, q.dtype)
        if key not in step.shared:
            cos, sin = rope_angles(self.spec.inv_freq, -self.shift(step.positions), q.dtype)
            step.shared[key] = cos.unsqueeze(1), sin.unsqueeze(1)
        return apply_rope(q, *step.shared[key])
