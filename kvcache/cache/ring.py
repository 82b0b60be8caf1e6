"""Caches whose kept set depends on positions alone (window, sink) keep tokens in a ring.

The token at position p always lives in slot ``slot(p)``, so the decode step is an append at a
slot known on the host, exactly like dense: no scoring, no search for a victim, no move. A
multi-token chunk still attends over the kept slots plus the chunk (earlier queries of the chunk
may need keys a later token of the chunk will overwrite); afterwards only the chunk tokens that
survive are written, each to its slot.
"""

from __future__ import annotations

import torch

from .. import attention
from .base import Step
from .candidates import Candidates
from .evicting import PROTECTED, EvictingCache


class RingCache(EvictingCache):
    """An evicting cache whose slots are a function of positions (see module docstring)."""

    # The ring keeps the newest tokens and is always full: batched eviction has nothing to batch.
    supports_reserve = False

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
        if step.static:
            return self.decode_static(q, k, v, step)
        if step.decode:
            return self._decode(q, k, v, step)
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
        new_k, new_v = c.keys[:, :, stored:], c.values[:, :, stored:]
        keep = step.valid & self._survives(step.positions, step.newest[:, None])
        # new_k, new_v are the chunk as attended (read back from its codes by a quantized storage,
        # whose encoding of a read-back value gives the same codes).
        # Tokens that do not survive go to the scratch slot, so one scatter writes the chunk.
        slots = torch.where(keep, self.slot(step.positions), C)
        self.storage.write(slots, new_k, new_v, step.positions)
        self.storage.pos[:, :, C] = -1

    def _decode(self, q, k, v, step: Step) -> torch.Tensor:
        C = self.spec.cache_length
        store = self.storage
        if step.uniform:
            # Every row is at the same position, known on the host: a plain slice write, no index math on tensors.
            p, S = step.start0, self.sinks()
            store.write_slice(p if p < S else S + (p - S) % (C - S), k, v, step.positions)
        else:
            store.write(self.slot(step.start).to(k.device)[:, None], k, v, step.positions)
        span = min(C, step.span_end)
        ks, vs, pos = store.view(span)
        if step.min_start + 1 >= C and self.spec.window is None and not store.packed:
            # Every slot holds one of each row's newest positions: the dense decode call applies,
            # once the keys are as the policy wants them scored. (Packed keys are not rewritten:
            # the decode call below scores renumbered sinks with the rotated query instead.)
            self._prepare_full(ks, step)
            return attention.masked(q, ks, vs, step.positions, pos, all_visible=True)
        visible = attention.visibility(step.positions, pos, self.window(), self.sinks(), self.spec.window)[:, :, 0]
        q_sink = self._sink_queries(q, step)
        out, _ = attention.decode(q, ks, vs, visible, q_sink=q_sink, sink_slots=self.sinks())
        return out

    def decode_static(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: Step) -> torch.Tensor:
        # The token goes to its position's slot; every slot is attended with the policy's
        # visibility mask (empty slots hidden), and renumbered sinks are scored by the rotated
        # query (a bias on their columns), so no slot is modified for scoring.
        self.storage.write(self.slot(step.positions), k, v, step.positions)
        ks, vs, pos = self.storage.view(self.spec.cache_length)
        visible = attention.visibility(step.positions, pos, self.window(), self.sinks(), self.spec.window)[:, :, 0]
        out, _ = attention.decode(q, ks, vs, visible, q_sink=self._sink_queries(q, step), sink_slots=self.sinks())
        return out

    def _prepare_full(self, ks: torch.Tensor, step: Step) -> None:
        """Adjust the attended keys ``ks`` (B, Hkv, C, D) of a decode step over full rows (in place)."""
