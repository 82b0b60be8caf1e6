"""Slot buffers: where a layer cache keeps the bits of the tokens its policy decided to keep.

Every buffer has ``cache_length + 1`` slots. The last one is a scratch slot that absorbs the
writes of padding tokens, so a ragged chunk is written with one index operation and no
data-dependent shapes; attention never reads it. (A storage that ``grows`` may be built with
fewer slots than the cache's ``cache_length`` and given more as the cache fills: the dense
cache's, ``make_storage(slots=...)``.)

A policy decides which tokens stay, a storage how their bits are kept: ``make_storage`` builds
the storage named by ``CacheSpec.storage`` (see ``STORAGES`` and ``parse_storage``), and every
policy works with every one. The storages are the classes of this package's modules, one file each
(full.py, token.py, rotated.py, kivi.py, kivis.py), found here by their ``layout`` (nothing else lists them).

A storage class sets ``layout`` (the prefix of its names: ``full``, ``token8``, ``kivi4/32``),
``describe`` (what a name of it means, for ``kvcache.storages()``) and ``build`` (the storage
for a parsed name), and lists its ``buffers()``; ``Storage`` below is the contract every
storage keeps. Adding a storage is one file here, plus its kernel if attention reads it packed.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil
import re
from dataclasses import dataclass
from typing import Protocol

import torch

from ...quant.codes import BITS, KERNEL_BITS
from ..base import CacheSpec


class Storage(Protocol):
    """What a layer cache asks of its slot buffers (``storages/``: full, token, rtoken, kivi, kivis).

    ``pos`` (B, Hp, C + 1) holds each slot's absolute position, -1 when empty, in the
    narrowest integer type that holds the positions below the ``limit`` it was built with
    (positions.py: int16 for a dense cache's, int32 for an evicting one's); slot C is scratch.
    ``k.shape[2]`` is the slot count, C + 1. ``buffers()`` names every tensor that holds
    contents, each with the batch first (snapshots copy them). Invariants every storage keeps
    (tests/cache/storages/test_storage.py checks them for every registered storage):
      * ``view`` returns what attention reads. Full precision (``packed`` False): the buffers
        themselves, so writing into the view writes the cache. Quantized (``packed`` True):
        ``PackedKeys`` and ``PackedValues`` (quant/packed.py) that refer to the codes without
        copying them; attention reads them block by block, anything else asks for ``decoded()``.
      * ``roundtrip(k, v)`` is how a chunk attends its new tokens before they are placed. With
        ``exact_roundtrip`` it is exactly what ``view`` will return once they are stored, and
        storing a round-tripped value gives the codes the original gave, so a token is never
        degraded twice. (KIVI keys: returned at full precision, since their layout depends on
        where they are placed.)
      * ``settle`` and ``keep`` move tokens without changing their bits (the one exception: a
        KIVI key moved out of its per-channel group is re-quantized per token, once).
      * a rejected call changes nothing; ``reset`` empties every slot.
      * ``keeps_in_place``: the storage keeps more of its bits when a ``keep`` leaves kept
        slots where they are (``in_place`` says where each candidate goes then); others take
        candidates in any order.
      * ``grows``: every buffer is laid out per slot (dimension 2), and ``grow(slots)`` gives
        it more slots, keeping the ones it has (full, token); a storage whose buffers depend on
        the slot count (KIVI's key groups) has all its slots from the start.
    """

    pos: torch.Tensor
    k: torch.Tensor
    layout: str
    packed: bool
    exact_roundtrip: bool
    keeps_in_place: bool
    grows: bool

    @classmethod
    def build(cls, spec: CacheSpec, bits: int, group: int | None, per_head: bool = False,
              limit: int | None = None) -> Storage:
        """The storage of ``spec``'s slots for a name of this layout (``bits``, ``group`` as parsed),
        its slots holding positions below ``limit`` (None: any, up to int32's)."""

    @staticmethod
    def describe(bits: int) -> str:
        """What a name of this layout at ``bits`` bits means (``kvcache.storages()``)."""

    def buffers(self) -> dict[str, torch.Tensor]:
        """Every tensor holding contents, by name: the live buffers, batch first."""

    def write_slice(self, start: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """Write k, v (B, Hkv, T, D) at slots [start, start + T) of every row; positions (B, T)."""

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """Write token t of row b to slot ``slots[b, t]`` (B, T); padding goes to the scratch slot."""

    def empty_scratch(self) -> None:
        """Empty the scratch slot: position -1 and every buffer's contents zero. A chunk's
        ``write`` may send several tokens there (padding, tokens that do not survive), and a
        device's scatter keeps any one of them (CUDA's order is unspecified), so a chunk path
        empties it afterwards: then the state, and a snapshot of it, are the same on every device."""

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

    def grow(self, slots: int) -> None:
        """Hold ``slots`` slots (no fewer than now) and the scratch slot after them: the slots
        held keep their contents, the new ones are empty (a storage that ``grows``)."""

    def reset(self) -> None:
        """Empty every slot."""

    def nbytes(self) -> int:
        """Bytes held by the buffers."""


# The layout each plain width names: measured best at that width (docs/policies/storage.md).
BEST = {8: "token", 5: "kivi", 4: "kivi", 3: "kivi", 2: "kivi"}


def _discover() -> dict[str, type]:
    """The storage classes of the ``storages`` package, by layout."""
    found = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{__name__}.{info.name}")
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ == module.__name__ and "layout" in vars(cls):
                if cls.layout in found:
                    raise TypeError(f"storages {found[cls.layout].__name__} and {cls.__name__} both name layout {cls.layout!r}")
                found[cls.layout] = cls
    return found


def _kernel_note(cls: type, bits: int) -> str:
    """What a storage's description says of the kernel a CUDA decode step uses, where it is not
    the Triton kernel."""
    why = cls.blocked_because or (None if bits in KERNEL_BITS else f"it reads {'/'.join(map(str, KERNEL_BITS))}-bit codes, "
                                  f"one plane per byte, and {bits}-bit codes are split into two")
    return f". On CUDA a decode step over it takes the blocked kernel, not the Triton one: {why}" if why else ""


LAYOUTS: dict[str, type] = _discover()
# Quantized layouts: names carry their width (``token8``, ``kivi4/32``).
_QUANTIZED = sorted(name for name, cls in LAYOUTS.items() if cls.packed)

STORAGES = {
    "full": LAYOUTS["full"].describe(16),
    **{f"int{b}": f"{b}-bit codes in the layout of the best quality at {b} bits ({BEST[b]}{b})"
       + _kernel_note(LAYOUTS[BEST[b]], b) for b in sorted(BITS, reverse=True)},
    **{f"{layout}{b}": LAYOUTS[layout].describe(b) + _kernel_note(LAYOUTS[layout], b)
       for layout in _QUANTIZED for b in sorted(BITS, reverse=True)},
}

_NAME = re.compile(r"([a-z]+)(\d+)?(?:/(\d+))?")


@dataclass(frozen=True)
class StorageKind:
    """A parsed storage name. ``group``: channels per scale (token layout; None: the whole head)
    or slots per key group (kivi)."""

    layout: str  # a key of LAYOUTS: "full", "token" or "kivi"
    bits: int = 16
    group: int | None = None


def parse_storage(name: str) -> StorageKind:
    """``"int4"`` -> the best 4-bit layout; ``"kivi2/32"``: KIVI at 2 bits, key groups of 32 slots;
    ``"token8/64"``: per-token 8-bit codes in groups of 64 channels. Raises ValueError naming
    what is supported."""
    m = _NAME.fullmatch(name) if isinstance(name, str) else None
    layout = None if m is None else m.group(1)
    if m is not None and layout == "full" and m.group(2) is None and m.group(3) is None:
        return StorageKind("full")
    if m is None or m.group(2) is None or (layout != "int" and layout not in _QUANTIZED):
        raise ValueError(
            f"unknown storage {name!r}; available: {', '.join(STORAGES)}, each quantized one optionally with "
            "/<group> (kivi: slots per key group; token: channels per scale), e.g. 'kivi4/32'"
        )
    bits, group = int(m.group(2)), m.group(3)
    if bits not in BITS:
        raise ValueError(f"unknown storage {name!r}: unsupported bits {bits}; supported: {', '.join(map(str, BITS))}")
    layout = BEST[bits] if layout == "int" else layout
    if group is not None and int(group) <= 0:
        raise ValueError(f"storage {name!r}: the group size must be a positive integer, got {group}")
    group = getattr(LAYOUTS[layout], "default_group", None) if group is None else int(group)
    return StorageKind(layout, bits, group)


def check_storage(name: str, head_dim: int) -> StorageKind:
    """``parse_storage``, then the checks that need the model's head size: raises ValueError
    before any buffer is allocated."""
    kind = parse_storage(name)
    check = getattr(LAYOUTS[kind.layout], "check", None)
    if check is not None:
        check(name, kind.bits, kind.group, head_dim)
    return kind


def in_place(index: torch.Tensor, stored: int, live: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Where an evicting cache's ``keep`` puts its candidates when the storage prefers its kept
    slots to stay where they are (``Storage.keeps_in_place``: KIVI, whose per-channel key
    groups survive only for keys that do not move).

    index: (B, Hp, C) the candidates to keep, in rank order; candidates [0, stored) are slots
    [0, stored). live: (B, Hp, 1) long, how many of the ranks are kept (the slots [0, live)
    they must fill; default C): ranks from ``live`` on are placed after them in rank order.
    A kept rank whose candidate is a slot below ``live`` stays in that slot; the other kept
    ranks fill the slots below ``live`` left free, in rank and slot order.

    Returns ``placed`` (B, Hp, C), the candidate for each slot (what ``keep`` takes as its
    index, and what the cache gathers its statistics by), and ``rank`` (B, Hp, C), each slot's
    rank in ``index``. With stored 0 every candidate is new: ``index`` itself, in rank order.
    """
    B, Hp, C = index.shape
    ranks = torch.arange(C, device=index.device).expand(B, Hp, C)
    if not stored:
        return index, ranks
    live = torch.full((B, Hp, 1), C, dtype=torch.long, device=index.device) if live is None else live
    kept = ranks < live
    stays = kept & (index < torch.minimum(live, torch.tensor(stored, device=index.device)))
    # Slot of each staying rank; the others aim at a spare column C.
    target = torch.where(stays, index, C)
    taken = torch.zeros(B, Hp, C + 1, dtype=torch.bool, device=index.device).scatter_(2, target, True)[..., :C]
    # Free slots below ``live`` in slot order, then the slots from ``live`` on.
    slot = ranks
    free_key = torch.where(taken, 2 * C, torch.where(slot < live, slot, C + slot))
    free = free_key.argsort(dim=-1, stable=True)
    # Moving ranks: the kept ones in rank order, then the dropped ones.
    move_key = torch.where(stays, 2 * C, ranks)
    movers = move_key.argsort(dim=-1, stable=True)
    n_move = C - stays.sum(-1, keepdim=True)
    slot_of_rank = target.clone()
    slot_of_rank.scatter_(2, movers, torch.where(ranks < n_move, free, target.gather(2, movers)))
    placed = torch.empty_like(index).scatter_(2, slot_of_rank, index)
    rank = torch.empty_like(index).scatter_(2, slot_of_rank, ranks.contiguous())
    return placed, rank


def make_storage(spec: CacheSpec, per_head: bool = False, limit: int | None = None,
                 slots: int | None = None) -> Storage:
    """The slot buffers named by ``spec.storage``; ``per_head``: one position per K/V head;
    ``limit``: every position a slot will hold is below it (a cache that keeps every token: its
    ``cache_length``), so positions take a narrower type (positions.py); None: any position.
    ``slots``: where the layout ``grows``, the slots to allocate now (at most ``cache_length``;
    ``grow`` adds the others when they are needed); None, or a layout that does not grow: all."""
    kind = check_storage(spec.storage, spec.head_dim)
    cls = LAYOUTS[kind.layout]
    if slots is not None and cls.grows:
        spec = dataclasses.replace(spec, cache_length=min(slots, spec.cache_length))
    store = cls.build(spec, kind.bits, kind.group, per_head, limit)
    if spec.scores is not None and store.packed and not store.exact_roundtrip:
        # A chunk over such a layout is attended by the storage's own kernel (its keys change layout
        # as a group fills), which applies no soft cap or sink logits.
        raise ValueError(f"storage {spec.storage!r} ({kind.layout}) attends a chunk with its own kernel, which "
                         "implements neither soft-capping nor sink logits, which this model's attention uses; use "
                         "a per-token layout (int8, token8, token4, token2) or full")
    return store
