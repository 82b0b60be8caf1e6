"""``kivis<bits>[/<group>]``: KIVI (kivi.py) with the first ``SINKS`` positions of every row also
kept at full precision, and read from there wherever a policy keeps them.

The first tokens of a sequence (attention sinks) take a large share of every query's attention,
so their quantization error reaches every step. On SmolLM2-135M, keeping 4 of them exact takes
KIVI's top-1 agreement with dense from 94.8-95.1% to 95.8-96.8% at 4 bits and from 70-76% to
80-85% at 2 bits, for 0.04 bits per element (docs/quantized.md; on Gemma 3 270M it pays little).
The copy is taken when a token is written, by position, so it follows the token through a
policy's moves; the slot keeps its codes as KIVI makes them (unread while the token is a sink).
"""

from __future__ import annotations

import torch

from ...quant.packed import PackedKeys, PackedValues, after
from ...quant.sinks import sink_entries, with_sinks
from ..base import CacheSpec
from .kivi import KiviStorage

# Positions kept at full precision: StreamingLLM's four attention sinks.
SINKS = 4


class KiviSinkStorage(KiviStorage):
    """``KiviStorage`` plus ``k_sink``, ``v_sink`` (B, Hkv, SINKS + 1, D) at the model's dtype:
    entry p holds the key and value of position p < SINKS as written (entry SINKS absorbs every
    other token's write and is kept zero)."""

    layout = "kivis"
    blocked_because = "it does not read the full-precision sinks"

    @staticmethod
    def describe(bits: int) -> str:
        return (f"KIVI, {bits}-bit (kivi{bits}), with the first {SINKS} positions of every row also kept at full "
                "precision and read from there (attention sinks)")

    def __init__(self, spec: CacheSpec, bits: int, per_head: bool = False, group: int = 64,
                 limit: int | None = None) -> None:
        super().__init__(spec, bits, per_head, group, limit)
        B, H, D = spec.batch_size, spec.num_kv_heads, spec.head_dim
        self.k_sink = torch.zeros(B, H, SINKS + 1, D, dtype=spec.dtype, device=spec.device)
        self.v_sink = torch.zeros_like(self.k_sink)
        # The last roundtrip's values, read back and as given: an evicting cache keeps the chunk it
        # attended (read back), and its sinks' copies are taken from the values as given.
        self._given: tuple[torch.Tensor, torch.Tensor] | None = None

    def _hold(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """Copy the tokens of k, v (B, Hkv, T, D) at positions (B, T) or (B, Hp, T) below SINKS
        (negative: no token) into their entries."""
        pos = positions if positions.dim() == 3 else positions[:, None]
        B, H, T, D = k.shape
        entry = sink_entries(pos.to(k.device), SINKS).expand(B, H, T)[..., None].expand(B, H, T, D)
        for buf, x in ((self.k_sink, k), (self.v_sink, v)):
            buf.scatter_(2, entry, x.to(buf.dtype))
            # Every other token landed in the spare entry, in an order a device may not fix.
            buf[:, :, SINKS] = 0

    def write_slice(self, start: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        super().write_slice(start, k, v, positions)
        # KIVI writes a slice through ``write`` (which holds the copies), except at the scratch
        # slot, where a scoring policy's decode step stages its token per token.
        if start == self.pos.shape[2] - 1:
            self._hold(k, v, positions)

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        super().write(slots, k, v, positions)
        # Padding (sent to the scratch slot) holds no token.
        real = slots.to(positions.device) < self.pos.shape[2] - 1
        self._hold(k, v, torch.where(real, positions, -1))

    def roundtrip(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k_read, v_read = super().roundtrip(k, v)
        self._given = (v_read, v)
        return k_read, v_read

    def keep(self, k, v, pos: torch.Tensor, index: torch.Tensor, stored: int = 0) -> None:
        super().keep(k, v, pos, index, stored)
        # The new candidates' copies (the stored ones hold theirs already): keys as given (KIVI's
        # roundtrip leaves them at full precision), values as given to the roundtrip, if these
        # are what it returned.
        new_v = after(v, stored)
        if self._given is not None and _same(new_v, self._given[0]):
            new_v = self._given[1]
        self._given = None
        self._hold(after(k, stored), new_v, pos[:, :, stored:])

    def view(self, span: int) -> tuple[PackedKeys, PackedValues, torch.Tensor]:
        keys, values, pos = super().view(span)
        keys, values = with_sinks(keys, values, pos, self.k_sink, self.v_sink)
        return keys, values, pos

    def buffers(self) -> dict[str, torch.Tensor]:
        return {**super().buffers(), "k_sink": self.k_sink, "v_sink": self.v_sink}

    def reset(self) -> None:
        super().reset()
        self._given = None
        self.k_sink.zero_()
        self.v_sink.zero_()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a and b are views of the same elements (a slice of all of b, or b itself)."""
    return (a.data_ptr(), a.shape, a.stride()) == (b.data_ptr(), b.shape, b.stride())
