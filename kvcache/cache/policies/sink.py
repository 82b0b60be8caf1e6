"""sink (StreamingLLM): the first ``sinks`` tokens plus the most recent ones.

Position modes:
    absolute    every key keeps the phase of its true position; a query at position p sees the
                sinks at distance p - s, which grows without bound.
    renumbered  positions are assigned within the cache, as in the paper: the sinks keep 0..S-1
                and the recent keys follow contiguously, so no distance exceeds ``cache_length``.

Renumbering is exact and never rotates a key twice. Keys are stored rotated at their true
positions. Once a row has seen more than ``cache_length`` tokens, a query at p is assigned
p - shift with shift = p - (cache_length - 1), and so are the recent keys (p' - shift); their
relative distance, which is all RoPE scores depend on, is unchanged, so they are scored as
stored. Only the distance to a sink changes (from p - s to p - shift - s). The decode step over
full rows scores the sinks rotated once, from their stored position s, to s + shift (the same
distance); the stored sinks are kept aside while the slots hold the rotated copies, and put back
before anything else reads the slots. A chunk, or a row not yet full, scores the sinks with the
query rotated once to p - shift instead. Both rotations start from stored values every step and
are never accumulated. (Exact up to the float32 rounding of RoPE angles, which every
implementation shares: at position 1e5 the logits of a renumbered step differ from re-embedding
the kept tokens from scratch by about 1e-3.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...rope import apply_rope, rope_angles, rotate_half
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
        # While the slots hold the sinks rotated for decoding: the sinks as stored and their
        # rotate_half, each (B, Hkv, sinks, D).
        self._stored_sinks: tuple[torch.Tensor, torch.Tensor] | None = None

    def window(self) -> int | None:
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

    def _sink_queries(self, q: torch.Tensor, step: Step) -> torch.Tensor | None:
        if self.options.positions == "absolute" or self.options.sinks == 0:
            return None
        if not step.static and step.span_end <= self.spec.cache_length:
            return None  # no position has reached cache_length yet: nothing is renumbered
        # q: (B, Hq, T, D) rotated at p; rotate by -shift to p - shift for scoring sinks.
        cos, sin = rope_angles(self.spec.inv_freq, -self.shift(step.positions), q.dtype)
        return apply_rope(q, cos.unsqueeze(1), sin.unsqueeze(1))

    def _prepare_full(self, ks: torch.Tensor, step: Step) -> None:
        S = self.options.sinks
        if self.options.positions == "absolute" or S == 0:
            return
        if self._stored_sinks is None:
            k = ks[:, :, :S].clone()
            # With rotate_half(k) kept too, each step's rotation k * cos + rotate_half(k) * sin
            # is two elementwise calls.
            self._stored_sinks = k, rotate_half(k)
        # The angles of +shift per row, shared by every layer of this cache length: (B, 1, 1, D).
        key = ("sink_shift_angles", self.spec.cache_length)
        if key not in step.shared:
            cos, sin = rope_angles(self.spec.inv_freq, self.shift(step.positions), ks.dtype)
            step.shared[key] = cos.unsqueeze(1), sin.unsqueeze(1)
        cos, sin = step.shared[key]
        k, k_half = self._stored_sinks
        ks[:, :, :S] = torch.addcmul(k * cos, k_half, sin)

    def _restore_sinks(self) -> None:
        """Put the stored sinks back in their slots. A full-precision ``view`` is the buffer itself,
        which the rotated copies overwrote; a quantized one is a fresh decode, where this is a no-op."""
        if self._stored_sinks is not None:
            self.storage.view(self.options.sinks)[0].copy_(self._stored_sinks[0])
            self._stored_sinks = None

    def decode_static(self, q, k, v, step: Step) -> torch.Tensor:
        # The slots must hold the sinks as stored: the captured step scores them by rotating the query.
        self._restore_sinks()
        return super().decode_static(q, k, v, step)

    def _chunk(self, q, k, v, step: Step) -> torch.Tensor:
        # (A decode step never needs this: once its rows are full they stay full until reset.)
        self._restore_sinks()
        return super()._chunk(q, k, v, step)

    def reset(self) -> None:
        self._stored_sinks = None
        super().reset()

    def state(self) -> dict[str, torch.Tensor]:
        # Canonical form: the sinks back in their slots as stored. The next decode step over
        # full rows rotates them again from there, exactly as it would have from the copy.
        self._restore_sinks()
        return super().state()
