"""Rotary position embeddings (RoPE) and their frequency-scaling variants.

Keys are rotated once, at their absolute position, before they enter the cache. Rotations compose
(R(a) R(b) = R(a + b)), so a policy that renumbers positions can move a stored key from position p
to position p' with a single rotation by p' - p, computed from the stored position rather than by
accumulating rotations on already-rotated keys.
"""

from __future__ import annotations

import math

import torch

from .config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int, *, long: bool = False) -> torch.Tensor:
    """(head_dim // 2,) float32 angular frequencies, scaled as ``rope.rope_type`` prescribes
    (longrope: with its short factors, or with ``long`` its long ones)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
    if rope.rope_type == "longrope":
        if len(rope.short_factor) != head_dim // 2:
            raise ValueError(f"longrope lists {len(rope.short_factor)} factors for head_dim {head_dim}; it needs "
                             f"{head_dim // 2}, one per frequency")
        factors = torch.tensor(rope.long_factor if long else rope.short_factor, dtype=torch.float32)
        return 1.0 / (factors * rope.theta**exponents)
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_scale(inv_freq, rope)
    if rope.rope_type == "yarn":
        return _yarn_scale(inv_freq, rope, head_dim)
    return inv_freq


def _yarn_scale(inv_freq: torch.Tensor, rope: RopeConfig, head_dim: int) -> torch.Tensor:
    # YaRN: dimensions that turn many times over the original context keep their frequency
    # (extrapolation), those that turn less than once are slowed by ``factor`` (interpolation),
    # and a linear ramp over the dimensions between blends the two. The ramp's ends are the
    # dimensions at which a frequency makes beta_fast and beta_slow turns over the context.
    def dimension(turns: float) -> float:
        context = rope.original_max_position_embeddings
        return head_dim * math.log(context / (turns * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = dimension(rope.beta_fast), dimension(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width would divide by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    # ramp 0: keep the frequency; ramp 1: interpolate it.
    return inv_freq * (1 - ramp) + inv_freq / rope.factor * ramp


def _llama3_scale(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    # Long wavelengths are slowed down by `factor`, short ones kept, and the band between is
    # interpolated smoothly (Llama 3.1 recipe).
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_angles(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for ``positions`` (any shape P), each of shape (*P, head_dim), in ``dtype``.

    Angles are computed in float32 whatever ``dtype`` is, so low-precision models do not lose
    phase accuracy at large positions.
    """
    freqs = positions.to(torch.float32).unsqueeze(-1) * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (..., head_dim) by angles broadcastable to it (the half-split pairing of HF Llama)."""
    return x * cos + rotate_half(x) * sin


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) over the halves of the last dimension: the sine term of a rotation."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
