"""Caches whose kept set depends on positions alone (window, sink) keep tokens in a ring.

The token at position p always lives in slot ``slot(p)``, so the decode step is a write at a
slot computed from positions, exactly like dense: no scoring, no search for a victim, no move. A
multi-token chunk still attends over the kept slots plus the chunk (earlier queries of the chunk
may need keys a later token of the chunk will overwrite); afterwards only the chunk tokens that
survive are written, each to its slot.
"""

from __future__ import annotations

import torch

from ..kernels import attention
from ..quant.packed import after
from .base import Step
from .candidates import Candidates
from .evicting import PROTECTED, EvictingCache, check_context


class RingCache(EvictingCache):
    """An evicting cache whose slots are a function of positions (see module docstring)."""

    # The ring keeps the newest tokens and is always full: batched eviction has nothing to batch.
    supports_reserve = False
    # Tokens of the current call that are context, the rest a reconstruction attended and then
    # dropped (kvcache.generation.reconstruction's pass, through the rings of a model's sliding layers); None: ordinary.
    _context: int | None = None

    def record(self, context: int | None) -> None:
        """Make the next calls reconstruction calls whose first ``context`` tokens alone are
        stored (``kvcache.generation.reconstruction`` does this around its pass); None makes calls ordinary again."""
        check_context(context)
        self._context = context

    @property
    def chunking_invariant(self) -> bool:
        # What it keeps is a function of positions, and each query sees the same keys however the
        # sequence is chunked, provided a chunk attends its new tokens as they will be stored.
        return self.storage.exact_roundtrip and self.spec.block == 1

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: Step) -> torch.Tensor:
        if self.spec.block > 1:
            # Whole blocks: the ranked paths of every evicting cache (blocks.py), by ``priority``.
            return super().attend(q, k, v, step)
        # A ring appends at the slot its position names: no held-slot bookkeeping, no search.
        if step.decode:
            return self.decode(q, k, v, step)
        return self._chunk(q, k, v, step)

    def slot(self, positions: torch.Tensor) -> torch.Tensor:
        """Slot of each position (any shape, long)."""
        S, C = self.sinks(), self.spec.cache_length
        return torch.where(positions < S, positions, S + (positions - S) % (C - S))

    def priority(self, c: Candidates) -> torch.Tensor:
        """The ranking the slots realise (sinks, then newest first); the ring's own paths place
        tokens by ``slot`` and never rank them."""
        return c.positions.float() + PROTECTED * (c.positions < self.sinks())

    def _survives(self, positions: torch.Tensor, newest: torch.Tensor) -> torch.Tensor:
        """Which of ``positions`` (B, T) are still kept once each row's newest is ``newest`` (B, 1)."""
        return (positions > newest - (self.spec.cache_length - self.sinks())) | (positions < self.sinks())

    def _keep(self, c: Candidates, stored: int) -> None:
        if self.spec.block > 1:
            return super()._keep(c, stored)
        C, step = self.spec.cache_length, c.step
        new_k, new_v = after(c.stored_keys, stored), after(c.stored_values, stored)
        if self._context is None:
            keep = step.valid & self._survives(step.positions, step.newest[:, None])
        else:
            # A reconstruction call: the ring ends as after its context alone.
            m = self._context
            context = torch.arange(step.num_tokens, device=step.positions.device) < m
            keep = step.valid & context & self._survives(step.positions, step.positions[:, m - 1 : m])
        # new_k, new_v are the chunk as attended (read back from its codes by a quantized storage,
        # whose encoding of a read-back value gives the same codes).
        # Tokens that do not survive go to the scratch slot, so one scatter writes the chunk.
        slots = torch.where(keep, self.slot(step.positions), C)
        self.storage.write(slots, new_k, new_v, step.positions)
        self.storage.empty_scratch()

    def decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: Step) -> torch.Tensor:
        # The token goes to its position's slot, and the slots are attended with the policy's
        # visibility (empty ones hidden): all C of them in a captured step, those filled in an
        # eager one, and without a mask once every row is full (every slot then holds one of its
        # row's newest positions) unless the model's own window cuts some. Renumbered sinks are
        # scored by the query rotated back (``sink_queries``), so no slot is modified to score.
        C, S = self.spec.cache_length, self.sinks()
        key = ("ring_slots", C, S)  # alike in every layer of this geometry: computed once per step
        if key not in step.shared:
            step.shared[key] = self.slot(step.positions)
        self.storage.write(step.shared[key], k, v, step.positions)
        ks, vs, pos = self.storage.view(min(C, step.span_end) if step.known else C)
        if step.min_start + 1 >= C and self.spec.sliding_window is None:
            visible = None
        else:
            visible = attention.visibility(step.positions, pos, self.lookback(), S, self.spec.sliding_window)[:, :, 0]
        out, _ = attention.decode(q, ks, vs, visible, q_sink=self.sink_queries(q, step), sink_slots=S,
                                  scores=self.spec.scores)
        return out

    def advance_decode(self) -> None:
        """Nothing: a ring's slots are a function of positions; it counts no held slots."""
