"""Quantized slot buffers: keys and values kept as 8-bit or 4-bit integer codes.

Scheme: asymmetric (min/max) quantization per token, per K/V head, per group of ``group_size``
elements along head_dim (default: the whole head, one group). A group x becomes codes
q = round((x - min) / scale) in [0, 2^bits - 1] with scale = (max - min) / (2^bits - 1), and is
read back as q * scale + min, so every element is within scale / 2 of its original value.

Why this scheme (measured on Gaussian, offset and outlier-channel data, see docs/policies/storage.md):
  * per token, because a policy writes, moves and evicts whole tokens: a token's bits must not
    depend on its neighbours (per-channel key scales, as in KIVI, would need groups of tokens);
  * asymmetric, because at equal bytes it beats symmetric (absmax) quantization on every
    distribution tried: it uses all 2^bits levels and follows a group whose mean is not zero,
    which is common for keys with large fixed-sign channels;
  * one group per head by default: every extra group costs 8 more bytes per token and head
    (0.5 bit per element for groups of 64 at head_dim 128), and lowered the error by less than
    the ~2x that half a bit should buy (1.24x on Gaussian data), except on heavy-outlier keys;
  * float32 scale and offset, so the scale/2 error bound holds for any model dtype and no
    scale underflows (float16 would save 4 bytes per group).

Attention runs over a dequantized copy of the slots it reads (``view``), at the model's dtype:
O(span) extra memory per layer call, freed right after.
"""

from __future__ import annotations

import torch

from .base import CacheSpec

BITS = {"int8": 8, "int4": 4}


class QuantizedStorage:
    """Keys and values as integer codes plus a float32 scale and offset per group.

    k, v:         (B, Hkv, C + 1, D * bits / 8) uint8 codes; int4 packs two codes per byte
                  (element 2i in the low nibble, 2i + 1 in the high one).
    k_meta, v_meta: (B, Hkv, C + 1, 2 * G) float32, G = D / group_size: G scales then G offsets.
    pos:          (B, Hp, C + 1) long, -1 for an empty slot (as in ``FullStorage``).
    ``k.shape[2]`` is the slot count, as for ``FullStorage``.
    """

    def __init__(self, spec: CacheSpec, bits: int, per_head: bool = False, group_size: int | None = None) -> None:
        B, H, C, D = spec.batch_size, spec.num_kv_heads, spec.cache_length, spec.head_dim
        group = D if group_size is None else group_size
        if bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {bits}")
        # Pairs of int4 codes share a byte, so a group must not end inside one.
        if group <= 0 or D % group or (bits == 4 and group % 2):
            raise ValueError(f"group_size must divide head_dim ({D}){' and be even' if bits == 4 else ''}, got {group}")
        self.bits, self.group, self.dtype = bits, group, spec.dtype
        dev = spec.device
        self.k = torch.zeros(B, H, C + 1, D * bits // 8, dtype=torch.uint8, device=dev)
        self.v = torch.zeros_like(self.k)
        self.k_meta = torch.zeros(B, H, C + 1, 2 * (D // group), dtype=torch.float32, device=dev)
        self.v_meta = torch.zeros_like(self.k_meta)
        self.pos = torch.full((B, H if per_head else 1, C + 1), -1, dtype=torch.long, device=dev)

    # ----- codes -------------------------------------------------------------------------------
    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: (B, H, T, D) -> codes (B, H, T, D * bits / 8) uint8, meta (B, H, T, 2G) float32."""
        levels = 2**self.bits - 1
        g = x.float().unflatten(-1, (-1, self.group))  # (B, H, T, G, group)
        lo = g.amin(-1, keepdim=True)
        scale = (g.amax(-1, keepdim=True) - lo) / levels
        # A constant group has scale 0: every element is its offset, code 0.
        q = ((g - lo) / torch.where(scale > 0, scale, 1.0)).round_().clamp_(0, levels).to(torch.uint8).flatten(-2)
        if self.bits == 4:
            q = q[..., 0::2] | (q[..., 1::2] << 4)
        return q, torch.cat((scale, lo), -2).flatten(-2)

    def decode(self, q: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
        """Inverse of ``encode``: (B, H, T, D) at the model's dtype."""
        if self.bits == 4:
            q = torch.stack((q & 15, q >> 4), -1).flatten(-2)
        scale, lo = meta.unflatten(-1, (2, -1, 1)).unbind(-3)  # (B, H, T, G, 1) each
        # In place on the fresh float copy: the decode path runs this over the whole span every
        # step, and out-of-place broadcasting is about 10x slower on CPU.
        g = q.unflatten(-1, (-1, self.group)).float().mul_(scale).add_(lo)
        return g.flatten(-2).to(self.dtype)

    def roundtrip(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v (B, Hkv, T, D) as ``view`` would return them once stored."""
        return self.decode(*self.encode(k)), self.decode(*self.encode(v))

    def _encoded(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The new tokens' (k codes, v codes, k meta, v meta), in the order of ``_buffers``."""
        kq, km = self.encode(k)
        vq, vm = self.encode(v)
        return kq, vq, km, vm

    def _buffers(self) -> tuple[torch.Tensor, ...]:
        return self.k, self.v, self.k_meta, self.v_meta

    # ----- the FullStorage interface -----------------------------------------------------------
    def write_slice(self, start: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """Write k, v: (B, Hkv, T, D) at slots [start, start + T) of every row; positions: (B, T)."""
        stop = start + k.shape[2]
        for buf, new in zip(self._buffers(), self._encoded(k, v)):
            buf[:, :, start:stop] = new
        self.pos[:, :, start:stop] = positions.unsqueeze(1)

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """Write token t of row b to slot ``slots[b, t]`` (shared by heads); positions: (B, T)."""
        B, H, T, _ = k.shape
        for buf, new in zip(self._buffers(), self._encoded(k, v)):
            buf.scatter_(2, slots[:, None, :, None].expand(B, H, T, buf.shape[-1]), new)
        Hp = self.pos.shape[1]
        self.pos.scatter_(2, slots.unsqueeze(1).expand(B, Hp, T), positions.unsqueeze(1).expand(B, Hp, T))

    def settle(self, dst: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """Move the token in the scratch slot to slot ``dst`` (B, Hp, 1) and empty the scratch
        slot (see FullStorage.settle). Codes move as they are: a moved token is not re-quantized."""
        B, H, C1 = self.k.shape[:3]
        for buf in self._buffers():
            index = dst.unsqueeze(-1).expand(B, H, 1, buf.shape[-1])
            # A scatter may not read from the buffer it writes: copy the scratch slot first.
            buf.scatter_(2, index, buf[:, :, C1 - 1 :].clone())
        self.pos.scatter_(2, dst, positions.unsqueeze(1).expand_as(dst))
        self.pos[:, :, C1 - 1] = -1

    def keep(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, index: torch.Tensor, stored: int = 0) -> None:
        """Fill slots [0, C) with candidates ``index`` (B, Hp, C) picked from k, v (B, Hkv, N, D),
        pos (B, Hp, N). Candidates [0, stored) are this storage's slots [0, stored): their codes
        are taken as they are, so a token that survives many evictions is quantized once."""
        B, H = self.k.shape[:2]
        C = index.shape[-1]
        new = self._encoded(k[:, :, stored:], v[:, :, stored:])
        for buf, fresh in zip(self._buffers(), new):
            cand = torch.cat((buf[:, :, :stored], fresh), dim=2)
            buf[:, :, :C] = cand.gather(2, index.expand(B, H, C).unsqueeze(-1).expand(B, H, C, buf.shape[-1]))
        self.pos[:, :, :C] = pos.gather(2, index)

    def view(self, span: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The first ``span`` slots, dequantized: k, v (B, Hkv, span, D) and pos (B, Hp, span)."""
        k = self.decode(self.k[:, :, :span], self.k_meta[:, :, :span])
        v = self.decode(self.v[:, :, :span], self.v_meta[:, :, :span])
        return k, v, self.pos[:, :, :span]

    def reset(self) -> None:
        self.pos.fill_(-1)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self._buffers(), self.pos))
