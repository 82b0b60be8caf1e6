"""A fixed orthogonal rotation of a head's channels, for codes kept per token.

A key or value has a few channels far larger than the rest; a per-token range spends its levels
on them and codes the others coarsely. Rotated by a random-signed Hadamard matrix, every
coordinate is a ±1/sqrt(n) mix of all channels, so the large ones are spread over the head and
the range shrinks to the vector's norm (QuaRot, and vLLM's TurboQuant, rotate for this reason).
Since the rotation is orthogonal, q . k = (q R) . (k R) and sum_s p_s v_s = (sum_s p_s v_s R) R^T:
attention reads rotated codes by rotating the query once and the output once.

The matrix is the same on every machine and run (its signs come from a fixed seed, its entries are
±1/sqrt(n)), so codes stored by one process read back in another. A head_dim that is not a power
of two is covered by Hadamard blocks of the powers of two it sums to (96 = 64 + 32), one after the
other on the diagonal.
"""

from __future__ import annotations

import functools
import random

import torch

# The seed of the signs: part of the stored format (codes written under one seed read back only
# under it).
SEED = 0x5EED


def _hadamard(n: int) -> torch.Tensor:
    """Sylvester's n x n Hadamard matrix (n a power of two), entries ±1, float64."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h


@functools.cache
def _matrix(head_dim: int) -> torch.Tensor:
    blocks, left = [], head_dim
    while left:
        b = 1 << (left.bit_length() - 1)
        blocks.append(_hadamard(b) / b**0.5)
        left -= b
    rng = random.Random(SEED + head_dim)
    signs = torch.tensor([rng.choice((-1.0, 1.0)) for _ in range(head_dim)], dtype=torch.float64)
    return (signs[:, None] * torch.block_diag(*blocks)).float()


def rotation(head_dim: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The (head_dim, head_dim) float32 orthogonal matrix R: x is coded as x @ R and read back as
    (its reading) @ R.T. One tensor per head_dim and device, shared by every caller, made eagerly
    when a storage is built: a captured step reads it as a static address, like a parameter
    (generation/compiled.py), so a CUDA graph does not copy it in on each replay."""
    key = (head_dim, torch.device(device))
    if key not in _MADE:
        made = _matrix(head_dim).to(key[1])
        torch._dynamo.mark_static_address(made)
        _MADE[key] = made
    return _MADE[key]


_MADE: dict[tuple[int, torch.device], torch.Tensor] = {}
