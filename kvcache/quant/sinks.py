"""Packed views whose first positions are also held at full precision (attention sinks).

The first tokens of a sequence take a large share of every query's attention, so their
quantization error reaches every step. A storage that keeps them (``kivis``) hands attention
these views: the slots holding positions below ``n`` read the full-precision copy, every other
slot its codes, as the parent view reads them. Shapes as in packed.py; Hp is 1 when the K/V
heads of a row share slots and H when a policy places tokens per head.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .packed import PackedKeys, PackedValues, _any


def sink_entries(pos: torch.Tensor, n: int) -> torch.Tensor:
    """(B, Hp, S) long: the entry of the full-precision copy each slot reads, its position where
    that is in [0, n), else n (an entry no slot reads)."""
    return torch.where((pos >= 0) & (pos < n), pos, n).long()


def _widened(view, cls, **extra):
    """``view`` (a PackedKeys or PackedValues) as ``cls``, with ``extra`` fields."""
    return cls(**{f.name: getattr(view, f.name) for f in dataclasses.fields(view)}, **extra)


def _hits(entry: torch.Tensor, s0: int, s1: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Entries (B, Hp, m) of slots [s0, s1) and whether each is a sink."""
    e = entry[:, :, s0:s1]
    return e, e < n


def _copies_over(out: torch.Tensor, sink: torch.Tensor, entry: torch.Tensor, s0: int, s1: int) -> torch.Tensor:
    """``out`` (B, H, m, D), slots [s0, s1) as the parent view decodes them, with each sink slot's
    row taken from its full-precision copy ``sink`` (B, H, n + 1, D)."""
    e, hit = _hits(entry, s0, s1, sink.shape[2] - 1)
    if not _any(hit):
        return out
    B, H, m, D = out.shape
    rows = sink.gather(2, e.expand(B, H, m)[..., None].expand(B, H, m, D))
    return torch.where(hit[..., None], rows.to(out.dtype), out)


class _Copies:
    """What both sink views share: the count of sinks ``n`` and ``decode`` (the parent view's
    rows, with the sinks' copies laid over them). ``sink`` and ``entry`` are their fields."""

    sink: torch.Tensor
    entry: torch.Tensor

    @property
    def n(self) -> int:
        return self.sink.shape[2] - 1

    def decode(self, s0: int, s1: int) -> torch.Tensor:
        return _copies_over(super().decode(s0, s1), self.sink, self.entry, s0, s1)


@dataclass(eq=False)
class SinkKeys(_Copies, PackedKeys):
    """Keys as ``PackedKeys`` reads them, but where ``entry`` names a sink.

    sink:  (B, H, n + 1, D) model dtype: entry p holds position p's key; entry n is unused.
    entry: (B, Hp, S) long, from ``sink_entries``.
    """

    sink: torch.Tensor | None = None
    entry: torch.Tensor | None = None

    def scores(self, q: torch.Tensor, q_pos: torch.Tensor | None, s0: int, s1: int,
               work: torch.Tensor | None = None, present: tuple[bool, bool, bool] | None = None) -> torch.Tensor:
        """As ``PackedKeys.scores``; a sink's score from its full-precision key."""
        out = super().scores(q, q_pos, s0, s1, work, present)
        e, hit = _hits(self.entry, s0, s1, self.n)
        if not _any(hit):
            return out
        B, H, R, m = out.shape
        per_entry = q @ self.sink.float().transpose(-1, -2)  # (B, H, R, n + 1)
        return torch.where(hit.unsqueeze(2), per_entry.gather(-1, e.unsqueeze(2).expand(B, H, R, m)), out)


@dataclass(eq=False)
class SinkValues(_Copies, PackedValues):
    """Values as ``PackedValues`` reads them, but where ``entry`` names a sink (fields as
    ``SinkKeys``')."""

    sink: torch.Tensor | None = None
    entry: torch.Tensor | None = None

    def mix(self, p: torch.Tensor, s0: int, s1: int, q_pos: torch.Tensor | None = None,
            work: torch.Tensor | None = None, present: tuple[bool, bool, bool] | None = None) -> torch.Tensor:
        """As ``PackedValues.mix``; a sink's weight on its full-precision value: the weights of
        the sink slots gathered onto their entries, then one (R, n) @ (n, D) product."""
        e, hit = _hits(self.entry, s0, s1, self.n)
        if not _any(hit):
            return super().mix(p, s0, s1, q_pos, work, present)
        hit = hit.unsqueeze(2)  # (B, Hp, 1, m)
        out = super().mix(torch.where(hit, 0.0, p), s0, s1, q_pos, work, present)
        w = p.new_zeros(p.shape[:3] + (self.n + 1,))
        w.scatter_add_(-1, e.unsqueeze(2).expand_as(p), torch.where(hit, p, 0.0))
        return out + w[..., : self.n] @ self.sink[:, :, : self.n].float()


def with_sinks(keys: PackedKeys, values: PackedValues, pos: torch.Tensor, k_sink: torch.Tensor,
               v_sink: torch.Tensor) -> tuple[SinkKeys, SinkValues]:
    """The views ``keys``, ``values`` of slots holding ``pos`` (B, Hp, S), reading the positions
    below ``k_sink.shape[2] - 1`` from ``k_sink``, ``v_sink`` (B, H, n + 1, D)."""
    entry = sink_entries(pos, k_sink.shape[2] - 1)
    return _widened(keys, SinkKeys, sink=k_sink, entry=entry), _widened(values, SinkValues, sink=v_sink, entry=entry)
