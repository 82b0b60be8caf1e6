"""What each query may see, derived from positions: the one rule every attention path
(attention.py, the packed kernels, the training replay) masks by."""

from __future__ import annotations

import torch


def visibility(
    q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None, sinks: int = 0, limit: int | None = None
) -> torch.Tensor:
    """Which keys each query may see.

    q_pos: (B, T) absolute query positions; k_pos: (B, Hp, S) key positions, -1 for an empty slot
    (Hp is 1 when all heads share slots, else Hkv). Returns (B, Hp, T, S) bool: the key slot is
    filled, not in the future, and (with a window) not further back than ``window - 1``, except
    that the first ``sinks`` positions stay visible whatever the window. ``limit`` is a hard
    window that applies to sinks too (the model's own sliding window).
    """
    kp = k_pos.unsqueeze(2)
    qp = q_pos[:, None, :, None]
    mask = (kp >= 0) & (kp <= qp)
    if window is not None:
        recent = kp > qp - window
        mask &= (recent | (kp < sinks)) if sinks else recent
    if limit is not None:
        mask &= kp > qp - limit
    return mask
