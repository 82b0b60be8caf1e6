"""``full``: keys and values at the model's precision, exact."""

from __future__ import annotations

import torch

from .. import positions as _positions
from ..base import CacheSpec
from ..slots import put, widen


class FullStorage:
    """Keys and values at the model's precision, with the absolute position of each slot.

    k, v: (B, Hkv, C + 1, D); pos: (B, Hp, C + 1), -1 for an empty slot, where Hp is 1 when
    all K/V heads of a row share slots and Hkv when a policy places tokens per head; in the
    narrowest integer type holding positions below ``limit`` (positions.py; None: int32).
    """

    layout = "full"
    packed = False
    exact_roundtrip = True
    # Slots hold what they are given, wherever it lands.
    keeps_in_place = False
    # Every buffer is laid out per slot, so more slots can be added (``grow``).
    grows = True

    @staticmethod
    def describe(bits: int | None = None) -> str:
        return "keys and values at the model's dtype (exact)"

    @classmethod
    def build(cls, spec: CacheSpec, bits: int, group: int | None, per_head: bool = False,
              limit: int | None = None) -> FullStorage:
        return cls(spec, per_head, limit)

    def __init__(self, spec: CacheSpec, per_head: bool = False, limit: int | None = None) -> None:
        B, H, C, D = spec.batch_size, spec.num_kv_heads, spec.cache_length, spec.head_dim
        self.k = torch.zeros(B, H, C + 1, D, dtype=spec.dtype, device=spec.device)
        self.v = torch.zeros_like(self.k)
        self.pos = _positions.empty((B, H if per_head else 1, C + 1), limit, spec.device)

    def grow(self, slots: int) -> None:
        """Hold ``slots`` slots (at least C) and the scratch slot after them: slots [0, C) keep
        their contents, the new ones are empty."""
        self.k, self.v, self.pos = widen(self.k, slots, 0), widen(self.v, slots, 0), widen(self.pos, slots, -1)

    def write_slice(self, start: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """Write k, v: (B, Hkv, T, D) at slots [start, start + T) of every row; positions: (B, T)."""
        stop = start + k.shape[2]
        self.k[:, :, start:stop] = k
        self.v[:, :, start:stop] = v
        self.pos[:, :, start:stop] = positions.unsqueeze(1)

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """Write token t of row b to slot ``slots[b, t]`` (shared by heads); positions: (B, T)."""
        slots = slots.unsqueeze(1)  # (B, 1, T): every head's
        put(self.k, slots, k)
        put(self.v, slots, v)
        put(self.pos, slots, positions.to(self.pos.dtype).unsqueeze(1))

    def empty_scratch(self) -> None:
        """Slot C: position -1, keys and values zero (see the Storage protocol)."""
        self.k[:, :, -1] = 0
        self.v[:, :, -1] = 0
        self.pos[:, :, -1] = -1

    def settle(self, dst: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """Move the token that ``write_slice(C, k, v, positions)`` put in the scratch slot C to
        slot ``dst`` (B, Hp, 1), and empty the scratch slot. k, v: (B, Hkv, 1, D); positions: (B, 1).

        The scratch slot holds exactly k and v, so they are put from the arguments: a write may
        not read from the buffer it writes."""
        put(self.k, dst, k.to(self.k.dtype))
        put(self.v, dst, v.to(self.v.dtype))
        put(self.pos, dst, positions.to(self.pos.dtype).unsqueeze(1))
        self.pos[:, :, -1] = -1

    def keep(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, index: torch.Tensor, stored: int = 0) -> None:
        """Fill slots [0, C) with candidates ``index`` (B, Hp, C) picked from k, v (B, Hkv, N, D), pos (B, Hp, N).

        ``stored``: candidates [0, stored) are this storage's slots [0, stored). Full precision
        needs no such hint (k, v hold their exact bits); a quantized storage reuses their codes.
        """
        B, H, _, D = k.shape
        C = index.shape[-1]
        gather = index.expand(B, H, C).unsqueeze(-1).expand(B, H, C, D)
        self.k[:, :, :C] = k.gather(2, gather)
        self.v[:, :, :C] = v.gather(2, gather)
        self.pos[:, :, :C] = pos.gather(2, index)

    def view(self, span: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The first ``span`` slots: k, v (B, Hkv, span, D) and pos (B, Hp, span)."""
        return self.k[:, :, :span], self.v[:, :, :span], self.pos[:, :, :span]

    def roundtrip(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v (B, Hkv, T, D) as ``view`` would return them once stored: unchanged here."""
        return k, v

    def buffers(self) -> dict[str, torch.Tensor]:
        return {"k": self.k, "v": self.v, "pos": self.pos}

    def reset(self) -> None:
        self.pos.fill_(-1)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers().values())
