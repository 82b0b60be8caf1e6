"""Stored positions: each slot's absolute position in the narrowest signed integer type that holds it.

A storage keeps one position per slot (and per K/V head where a policy places tokens per head),
-1 for an empty slot. A cache that keeps every token (dense) holds positions below its
``cache_length`` only, so its slots take ``int16`` (or ``int8`` for a cache of at most 128
slots); a cache that evicts keeps absolute positions that grow without bound, so its slots take
``int32``, and a row may see at most ``MAX_POSITIONS`` tokens (``KVCache.begin`` refuses more).

Only stored values are narrow: indices into buffers (scatter, gather, a step's slots) stay
``int64``, as torch's indexing needs, and comparing a stored position with a query's promotes.
A snapshot or prefix store written when slots held ``int64`` positions still restores: its
positions are converted, after checking that they fit (``narrow``).
"""

from __future__ import annotations

import torch

# The signed integer types a slot's position may take, narrowest first.
DTYPES = (torch.int8, torch.int16, torch.int32)
# The most tokens a row of any cache may see: its positions are [0, MAX_POSITIONS).
MAX_POSITIONS = torch.iinfo(torch.int32).max


def position_dtype(limit: int | None = None) -> torch.dtype:
    """The narrowest of ``DTYPES`` holding -1 and every position below ``limit`` (a slot of a
    cache whose rows hold at most ``limit`` tokens); None: any position up to ``MAX_POSITIONS``."""
    if limit is None:
        return torch.int32
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
        raise ValueError(f"a position limit must be a non-negative int or None, got {limit!r}")
    for dtype in DTYPES:
        if limit - 1 <= torch.iinfo(dtype).max:
            return dtype
    raise ValueError(f"positions below {limit} do not fit int32 (at most {MAX_POSITIONS} tokens per row)")


def empty(shape: tuple[int, ...], limit: int | None, device: torch.device | str | None = None) -> torch.Tensor:
    """A buffer of empty slots (-1) of ``shape`` for positions below ``limit`` (``position_dtype``)."""
    return torch.full(shape, -1, dtype=position_dtype(limit), device=device)


def fits(t: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether every value of the integer tensor ``t`` lies in ``dtype``'s range (a host read)."""
    if t.dtype == dtype or t.numel() == 0:
        return True
    info = torch.iinfo(dtype)
    return bool(((t >= info.min) & (t <= info.max)).all())


def narrow(t: torch.Tensor, dtype: torch.dtype, what: str) -> torch.Tensor:
    """``t`` (positions of any integer type: an older snapshot's int64) as ``dtype``; raises
    ValueError naming ``what`` if a value does not fit."""
    if t.dtype == dtype:
        return t
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise ValueError(f"{what} must hold integers, got {t.dtype}")
    if not fits(t, dtype):
        raise ValueError(f"{what} holds positions outside {dtype} ({int(t.min())}..{int(t.max())}), "
                         f"more than this cache's slots can hold")
    return t.to(dtype)
