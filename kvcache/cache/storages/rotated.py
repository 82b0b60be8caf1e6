"""``rtoken<bits>[/<group>]``: per-token codes (token.py) of keys and values turned by a fixed
orthogonal rotation first (quant/rotation.py: a random-signed Hadamard matrix).

A per-token range spends its levels on a head's few large channels (keys have several, of fixed
sign); rotated, every coordinate mixes all channels and the range follows the vector's norm.
Attention reads the rotated codes by rotating the query once and the output once, so bytes and the
block-by-block reads stay the token layout's. Everything else is ``TokenStorage``'s: a token's bits
never depend on its slot or neighbours, a chunk attends exactly what is stored, the cache grows,
and no full-precision residual is held, so it suits the models and caches KIVI does not (a scores
rule such as soft-capping, short caches). At the same bytes (docs/quantized.md) the rotation takes
per-token top-1 agreement with dense on SmolLM2-135M from 81.5-83.2% to 86.2-89.1% at 4 bits and
from 59-63% to 70-75% at 3 bits, and on Gemma 3 270M from 31% to 69% at 4 bits; on the bundled
model, whose keys have no large channels, it changes nothing.
"""

from __future__ import annotations

import dataclasses

import torch

from ...quant.codes import decode_tokens, encode_tokens
from ...quant.packed import PackedKeys, PackedValues
from ...quant.rotation import rotation
from ..base import CacheSpec
from .token import TokenStorage


class RotatedTokenStorage(TokenStorage):
    """``TokenStorage`` whose codes are of k @ R and v @ R, R (D, D) from ``rotation``: buffers,
    shapes and bytes as ``TokenStorage``'s (the rotation is a constant of head_dim, not state)."""

    layout = "rtoken"
    blocked_because = "it does not rotate the query and the output"

    @staticmethod
    def describe(bits: int) -> str:
        return (f"{bits}-bit codes per token and K/V head for keys and values, after a fixed Hadamard rotation of "
                f"the head (spreads the large channels; same bytes as token{bits}); fp16 scales")

    def __init__(self, spec: CacheSpec, bits: int, per_head: bool = False, group: int | None = None,
                 limit: int | None = None) -> None:
        super().__init__(spec, bits, per_head, group, limit)
        rotation(self.head_dim, self.k.device)  # made here, eagerly, so that a compiled step only reads it

    @property
    def rotation(self) -> torch.Tensor:
        """R (D, D) float32 on the buffers' device: one per process and device, shared by every
        layer and cache, so not counted in ``nbytes`` (16 KiB at head_dim 64)."""
        return rotation(self.head_dim, self.k.device)

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, H, T, D) rotated, then coded per token (``TokenStorage.encode``)."""
        return encode_tokens(x.float() @ self.rotation, self.bits, self.group)

    def decode(self, codes: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
        """Inverse of ``encode``: (B, H, T, D) at the model's dtype."""
        return (decode_tokens(codes, meta, self.bits, torch.float32) @ self.rotation.T).to(self.dtype)

    def view(self, span: int) -> tuple[PackedKeys, PackedValues, torch.Tensor]:
        keys, values, pos = super().view(span)
        # Batch first like every field of a view (``rows`` slices them all), without a copy.
        r = self.rotation.expand(self.k.shape[0], 1, *self.rotation.shape)
        return dataclasses.replace(keys, rotation=r), dataclasses.replace(values, rotation=r), pos
