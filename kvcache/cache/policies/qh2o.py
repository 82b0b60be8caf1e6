"""qh2o: quantization-aware H2O (Q-Hitter, Zhang et al., MLSys 2024, as keys_values scores it):
keep the tokens that are both heavy hitters and cheap to quantize.

A token's priority is a convex combination of its H2O score and its quantization error, each
min-max normalised over the row's K/V heads and candidates:

    weight * score + (weight - 1) / 2 * error + (1 - weight)

``error`` is the L2 error of the token's key plus that of its value, quantized per token at the
storage's width (or at ``bits`` over a full-precision storage), measured once, when the token
arrives. ``weight = 1`` is H2O; lower weights evict poorly quantized tokens first. The recent
tokens and sinks are kept as in H2O.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...quant.codes import BITS, decode_tokens, encode_tokens
from ..base import CacheSpec, Step
from ..candidates import Candidates
from ..evicting import PROTECTED
from ..options import option
from ..storages import parse_storage
from .h2o import H2OCache, H2OOptions

SCALES = ("minmax", "rank")


@dataclass(frozen=True)
class QH2OOptions(H2OOptions):
    weight: float = option(0.5, "share of the H2O score in the priority; the rest is the quantization error")
    bits: int = option(4, f"width the error is measured at when the storage is full precision ({', '.join(map(str, BITS))})")
    scale: str = option("minmax", "how score and error are put on [0, 1] over a row's candidates: min-max "
                        "(keys_values) or rank (their quantiles)", SCALES)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.weight <= 1.0:
            raise ValueError(f"weight must lie in [0, 1], got {self.weight}")
        if self.bits not in BITS:
            raise ValueError(f"bits must be one of {', '.join(map(str, BITS))}, got {self.bits}")


class QH2OCache(H2OCache):
    name = "qh2o"
    description = "quantization-aware H2O (Q-Hitter): heavy hitters that quantize well, per row and K/V head"
    Options = QH2OOptions

    def __init__(self, spec: CacheSpec, options: QH2OOptions) -> None:
        super().__init__(spec, options)
        kind = parse_storage(spec.storage)
        self.error_bits = options.bits if kind.layout == "full" else kind.bits

    @staticmethod
    def stat_names_for(options: QH2OOptions) -> tuple[str, ...]:
        return (*H2OCache.stat_names_for(options), "error")

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: Step) -> torch.Tensor:
        # Measured on the chunk as the model computed it: what the storage keeps is already
        # quantized. (B, Hkv, T), read by ``observe`` for the candidates this call brings.
        with torch.no_grad():
            self._arriving = self._error(k) + self._error(v)
        try:
            return super().attend(q, k, v, step)
        finally:
            self._arriving = None

    def observe(self, c: Candidates) -> None:
        super().observe(c)
        # Candidates at or after the chunk's first position arrived in this call: chunk index
        # ``position - first`` (every row's chunk holds consecutive positions).
        first = c.step.positions[:, None, :1]  # (B, 1, 1)
        index = (c.positions - first).clamp(0, c.step.num_tokens - 1)
        error = self._arriving.gather(-1, index.expand(-1, self._arriving.shape[1], -1))
        stat = c.stats["error"]
        stat.copy_(torch.where(c.positions >= first, error, stat))

    def _error(self, x: torch.Tensor) -> torch.Tensor:
        """(B, H, n, D) -> (B, H, n) L2 error of per-token quantization at ``error_bits``."""
        x = x.float()
        codes, meta = encode_tokens(x, self.error_bits, x.shape[-1])
        return (x - decode_tokens(codes, meta, self.error_bits, torch.float32)).norm(dim=-1)

    def priority(self, c: Candidates) -> torch.Tensor:
        w = self.options.weight
        protected = self.protected(c)
        ranked = (c.positions >= 0) & ~protected
        norm = _minmax if self.options.scale == "minmax" else _rank
        score = norm(self.heavy(c), ranked)
        error = norm(c.stats["error"], ranked)
        prio = w * score + (w - 1) / 2 * error + (1 - w)
        return prio.masked_fill(protected, PROTECTED)


def _minmax(x: torch.Tensor, ranked: torch.Tensor) -> torch.Tensor:
    """x (B, Hp, N) scaled to [0, 1] per row over its ranked entries (the others are ignored)."""
    lo = x.masked_fill(~ranked, float("inf")).amin(dim=(1, 2), keepdim=True)
    hi = x.masked_fill(~ranked, float("-inf")).amax(dim=(1, 2), keepdim=True)
    span = (hi - lo).clamp(min=torch.finfo(torch.float32).tiny)
    return torch.where(ranked, (x - lo) / span, 0.0)


def _rank(x: torch.Tensor, ranked: torch.Tensor) -> torch.Tensor:
    """x (B, Hp, N) replaced per row by its quantile among the ranked entries, in [0, 1] (ties
    broken by index; the others are 0). Unlike min-max, a heavy-tailed score (a few heavy
    hitters far above the rest) does not leave the bulk of candidates within a sliver of 0."""
    B = x.shape[0]
    flat = x.masked_fill(~ranked, float("inf")).flatten(1)
    order = torch.empty_like(flat, dtype=torch.long)
    order.scatter_(1, flat.argsort(dim=1, stable=True), torch.arange(flat.shape[1], device=x.device).expand(B, -1))
    count = ranked.flatten(1).sum(1, keepdim=True)
    q = order.float() / (count - 1).clamp(min=1).float()
    return torch.where(ranked, q.view_as(x), 0.0)
