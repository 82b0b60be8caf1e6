"""The fixed rotation of rotated per-token codes (kvcache/quant/rotation.py)."""

from __future__ import annotations

import pytest
import torch

from kvcache.quant.rotation import rotation


@pytest.mark.parametrize("D", [16, 64, 128, 96, 80])
def test_the_rotation_is_orthogonal(D):
    R = rotation(D)
    assert R.shape == (D, D) and R.dtype == torch.float32
    assert torch.allclose(R @ R.T, torch.eye(D), atol=1e-6)


def test_the_rotation_is_a_signed_hadamard_matrix_made_once():
    """Entries ±1/sqrt(D) (exact at D = 64), the same tensor on every call: codes written by one
    cache read back in another, and a captured step reads one static tensor."""
    R = rotation(64)
    assert torch.equal(R.abs(), torch.full((64, 64), 1 / 8))
    assert rotation(64) is R and rotation(64, "cpu") is R
    # Not the plain Sylvester matrix: the rows carry signs (its first row would be all positive).
    assert not bool((R[0] > 0).all()) or not bool((R[1] > 0).all())


def test_a_head_dim_that_is_no_power_of_two_takes_hadamard_blocks():
    R = rotation(96)
    assert torch.equal(R[:64, 64:], torch.zeros(64, 32)) and torch.equal(R[64:, :64], torch.zeros(32, 64))
    assert torch.allclose(R[:64, :64].abs(), torch.full((64, 64), 1 / 8))


def test_rotation_spreads_one_large_channel_over_the_head():
    x = torch.zeros(64)
    x[5] = 10.0
    y = x @ rotation(64)
    assert torch.allclose(y.abs(), torch.full((64,), 10 / 8))
