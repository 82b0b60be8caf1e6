"""Slot buffers: where a layer cache keeps the bits of the tokens its policy decided to keep.

Every buffer has ``cache_length + 1`` slots. The last one is a scratch slot that absorbs the
writes of padding tokens, so a ragged chunk is written with one index operation and no
data-dependent shapes; attention never reads it.

A policy decides which tokens stay, a storage how their bits are kept: ``make_storage`` builds
the storage named by ``CacheSpec.storage`` (see ``STORAGES`` and ``parse_storage``), and every
policy works with every one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol

import torch

from .base import CacheSpec
from ..quant.codes import BITS
from .quantized import KiviStorage, TokenStorage


class Storage(Protocol):
    """What a layer cache asks of its slot buffers (``FullStorage``, ``TokenStorage``, ``KiviStorage``).

    ``pos`` (B, Hp, C + 1) long holds each slot's absolute position, -1 when empty; slot C is
    scratch. ``k.shape[2]`` is the slot count, C + 1. Every tensor attribute is a buffer with the
    batch first (snapshots copy them). Invariants every storage keeps (tests/cache/test_storage.py
    checks them for every registered storage):
      * ``view`` returns what attention reads. Full precision (``packed`` False): the buffers
        themselves, so writing into the view writes the cache. Quantized (``packed`` True):
        ``PackedKeys`` and ``PackedValues`` (quant/packed.py) that refer to the codes without
        copying them; attention reads them block by block and anything else decodes them on use.
      * ``roundtrip(k, v)`` is how a chunk attends its new tokens before they are placed. With
        ``exact_roundtrip`` it is exactly what ``view`` will return once they are stored, and
        storing a round-tripped value gives the codes the original gave, so a token is never
        degraded twice. (KIVI keys: returned at full precision, since their layout depends on
        where they are placed.)
      * ``settle`` and ``keep`` move tokens without changing their bits (the one exception: a
        KIVI key moved out of its per-channel group is re-quantized per token, once).
      * a rejected call changes nothing; ``reset`` empties every slot.
    """

    pos: torch.Tensor
    k: torch.Tensor
    packed: bool
    exact_roundtrip: bool

    def write_slice(self, start: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """Write k, v (B, Hkv, T, D) at slots [start, start + T) of every row; positions (B, T)."""

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """Write token t of row b to slot ``slots[b, t]`` (B, T); padding goes to the scratch slot."""

    def settle(self, dst: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """Move the token staged in the scratch slot to slot ``dst`` (B, Hp, 1); empty the scratch slot."""

    def keep(self, k, v, pos: torch.Tensor, index: torch.Tensor, stored: int = 0) -> None:
        """Fill slots [0, C) with candidates ``index`` (B, Hp, C) of k, v (B, Hkv, N, D), pos (B, Hp, N);
        candidates [0, stored) are this storage's own slots [0, stored) (k, v as ``view`` gave
        them, with the new tokens appended)."""

    def view(self, span: int) -> tuple:
        """The first ``span`` slots: keys, values (B, Hkv, span, D) and pos (B, Hp, span)."""

    def roundtrip(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v (B, Hkv, T, D) as a chunk attends them before they are placed."""

    def reset(self) -> None:
        """Empty every slot."""

    def nbytes(self) -> int:
        """Bytes held by the buffers."""


class FullStorage:
    """Keys and values at the model's precision, with the absolute position of each slot.

    k, v: (B, Hkv, C + 1, D); pos: (B, Hp, C + 1) long, -1 for an empty slot, where Hp is 1 when
    all K/V heads of a row share slots and Hkv when a policy places tokens per head.
    """

    packed = False
    exact_roundtrip = True

    def __init__(self, spec: CacheSpec, per_head: bool = False) -> None:
        B, H, C, D = spec.batch_size, spec.num_kv_heads, spec.cache_length, spec.head_dim
        self.k = torch.zeros(B, H, C + 1, D, dtype=spec.dtype, device=spec.device)
        self.v = torch.zeros_like(self.k)
        self.pos = torch.full((B, H if per_head else 1, C + 1), -1, dtype=torch.long, device=spec.device)

    def write_slice(self, start: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """Write k, v: (B, Hkv, T, D) at slots [start, start + T) of every row; positions: (B, T)."""
        stop = start + k.shape[2]
        self.k[:, :, start:stop] = k
        self.v[:, :, start:stop] = v
        self.pos[:, :, start:stop] = positions.unsqueeze(1)

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """Write token t of row b to slot ``slots[b, t]`` (shared by heads); positions: (B, T)."""
        B, H, T, D = k.shape
        index = slots[:, None, :, None].expand(B, H, T, D)
        self.k.scatter_(2, index, k)
        self.v.scatter_(2, index, v)
        self.pos.scatter_(2, slots.unsqueeze(1).expand(B, self.pos.shape[1], T), positions.unsqueeze(1).expand(B, self.pos.shape[1], T))

    def settle(self, dst: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """Move the token that ``write_slice(C, k, v, positions)`` put in the scratch slot C to
        slot ``dst`` (B, Hp, 1), and empty the scratch slot. k, v: (B, Hkv, 1, D); positions: (B, 1).

        The scratch slot holds exactly k and v, so they are scattered from the arguments: a
        scatter may not read from the buffer it writes."""
        B, H, C1, D = self.k.shape
        index = dst.unsqueeze(-1).expand(B, H, 1, D)
        self.k.scatter_(2, index, k.to(self.k.dtype))
        self.v.scatter_(2, index, v.to(self.v.dtype))
        self.pos.scatter_(2, dst, positions.unsqueeze(1).expand_as(dst))
        self.pos[:, :, C1 - 1] = -1

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

    def reset(self) -> None:
        self.pos.fill_(-1)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.pos))


# The layout each plain width names: measured best at that width (docs/policies/storage.md).
BEST = {8: "token", 4: "kivi", 2: "kivi"}
# Slots per KIVI key group, when the name does not say.
KIVI_GROUP = 64

STORAGES = {
    "full": "keys and values at the model's dtype (exact)",
    **{f"int{b}": f"{b}-bit codes in the best layout at {b} bits ({BEST[b]}{b})" for b in sorted(BITS, reverse=True)},
    **{f"kivi{b}": f"KIVI, {b}-bit: keys per channel over groups of {KIVI_GROUP} slots (newest in full precision "
                   f"until their group fills), values per token; fp16 scales" for b in sorted(BITS, reverse=True)},
    **{f"token{b}": f"{b}-bit codes per token and K/V head for keys and values; fp16 scales"
       for b in sorted(BITS, reverse=True)},
}

_NAME = re.compile(r"(full)|(int|kivi|token)(\d+)(?:/(\d+))?")


@dataclass(frozen=True)
class StorageKind:
    """A parsed storage name. ``group``: channels per scale (token layout; None: the whole head)
    or slots per key group (kivi)."""

    layout: str  # "full", "token" or "kivi"
    bits: int = 16
    group: int | None = None


def parse_storage(name: str) -> StorageKind:
    """``"int4"`` -> the best 4-bit layout; ``"kivi2/32"``: KIVI at 2 bits, key groups of 32 slots;
    ``"token8/64"``: per-token 8-bit codes in groups of 64 channels. Raises ValueError naming
    what is supported."""
    m = _NAME.fullmatch(name) if isinstance(name, str) else None
    if m is None:
        raise ValueError(
            f"unknown storage {name!r}; available: {', '.join(STORAGES)}, each quantized one optionally with "
            "/<group> (kivi: slots per key group; token: channels per scale), e.g. 'kivi4/32'"
        )
    if m.group(1):
        return StorageKind("full")
    layout, bits, group = m.group(2), int(m.group(3)), m.group(4)
    if bits not in BITS:
        raise ValueError(f"unknown storage {name!r}: unsupported bits {bits}; supported: {', '.join(map(str, BITS))}")
    layout = BEST[bits] if layout == "int" else layout
    if group is not None and int(group) <= 0:
        raise ValueError(f"storage {name!r}: the group size must be a positive integer, got {group}")
    if layout == "kivi" and group is None:
        group = KIVI_GROUP
    return StorageKind(layout, bits, None if group is None else int(group))


def check_storage(name: str, head_dim: int) -> StorageKind:
    """``parse_storage``, then the checks that need the model's head size: raises ValueError
    before any buffer is allocated."""
    kind = parse_storage(name)
    if kind.layout == "full":
        return kind
    if head_dim * kind.bits % 8:
        raise ValueError(f"storage {name!r}: head_dim {head_dim} does not fill whole bytes of {kind.bits}-bit codes")
    if kind.layout == "token" and kind.group is not None and head_dim % kind.group:
        raise ValueError(
            f"storage {name!r}: a group of {kind.group} channels must divide head_dim ({head_dim}); "
            f"valid groups: {', '.join(str(g) for g in range(1, head_dim + 1) if head_dim % g == 0)}"
        )
    return kind


def make_storage(spec: CacheSpec, per_head: bool = False) -> Storage:
    """The slot buffers named by ``spec.storage``; ``per_head``: one position per K/V head."""
    kind = check_storage(spec.storage, spec.head_dim)
    if kind.layout == "full":
        return FullStorage(spec, per_head)
    if kind.layout == "token":
        return TokenStorage(spec, kind.bits, per_head, kind.group)
    return KiviStorage(spec, kind.bits, per_head, kind.group)
