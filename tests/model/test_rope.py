"""Rotary embeddings: rotations compose, scores depend on relative position, scaling variants."""

from __future__ import annotations

import math

import torch
from conftest import DEVICE
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.model.config import RopeConfig
from kvcache.model.rope import apply_rope, inverse_frequencies, rope_angles

D = 16
# Frequencies are computed on the CPU (as the model computes them); the rotations run on the test device.
INV = inverse_frequencies(RopeConfig(theta=10000.0), D)


def _rotate(x, pos):
    cos, sin = rope_angles(INV.to(DEVICE), torch.tensor([pos], device=DEVICE), torch.float32)
    return apply_rope(x, cos[0], sin[0])


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 5000), st.integers(-2000, 2000))
def test_rotations_compose(a, b):
    x = torch.randn(D, generator=torch.Generator().manual_seed(a)).to(DEVICE)
    assert torch.allclose(_rotate(_rotate(x, a), b), _rotate(x, a + b), atol=2e-3)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 3000), st.integers(0, 3000), st.integers(0, 300))
def test_scores_depend_on_distance_only(p, q, shift):
    g = torch.Generator().manual_seed(p + q)
    x, y = torch.randn(D, generator=g).to(DEVICE), torch.randn(D, generator=g).to(DEVICE)
    s1 = _rotate(x, p) @ _rotate(y, q)
    s2 = _rotate(x, p + shift) @ _rotate(y, q + shift)
    assert abs(s1 - s2) < 2e-3
    # and the rotation keeps norms
    assert torch.allclose(_rotate(x, p).norm(), x.norm(), rtol=1e-5)


def test_default_frequencies():
    expected = [10000.0 ** (-2 * i / D) for i in range(D // 2)]
    assert torch.allclose(INV, torch.tensor(expected), rtol=1e-6)


def test_linear_scaling_divides_every_frequency():
    scaled = inverse_frequencies(RopeConfig(theta=10000.0, rope_type="linear", factor=4.0), D)
    assert torch.allclose(scaled, INV / 4.0)


def test_llama3_scaling_bands():
    rope = RopeConfig(theta=10000.0, rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                      high_freq_factor=4.0, original_max_position_embeddings=32)
    scaled = inverse_frequencies(rope, D)
    wavelen = 2 * math.pi / INV
    high = wavelen < 32 / 4  # short wavelengths: kept
    low = wavelen > 32 / 1  # long wavelengths: slowed down by factor
    mid = ~high & ~low
    assert high.any() and low.any() and mid.any()
    assert torch.equal(scaled[high], INV[high])
    assert torch.allclose(scaled[low], INV[low] / 8.0)
    assert bool(((scaled[mid] < INV[mid]) & (scaled[mid] > INV[mid] / 8.0)).all())


def test_angles_computed_in_fp32_for_low_precision():
    pos = torch.tensor([[30000]], device=DEVICE)
    cos16, sin16 = rope_angles(INV.to(DEVICE), pos, torch.bfloat16)
    cos32, sin32 = rope_angles(INV.to(DEVICE), pos, torch.float32)
    assert cos16.dtype == torch.bfloat16 and cos16.shape == (1, 1, D)
    # bf16 rounding of the result only (~4e-3), not of the angle (which would be off by radians)
    assert (cos16.float() - cos32).abs().max() < 1e-2
    assert (sin16.float() - sin32).abs().max() < 1e-2
