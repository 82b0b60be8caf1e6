"""Packing of codes at every supported width (kvcache/quant/codes.py): the documented byte layout,
and the float conversion attention reads blocks through (quant/packed.py ``as_float``)."""

from __future__ import annotations

import pytest
import torch

from kvcache.quant.codes import BITS, pack, planes, unpack
from kvcache.quant.packed import as_float


@pytest.mark.parametrize("bits", BITS)
def test_pack_round_trips_and_fills_whole_bytes(bits):
    g = torch.Generator().manual_seed(bits)
    q = torch.randint(0, 2**bits, (2, 3, 5, 64), generator=g, dtype=torch.uint8)
    c = pack(q, bits)
    assert c.dtype == torch.uint8 and c.shape == (2, 3, 5, 64 * bits // 8)
    assert torch.equal(unpack(c, bits), q)
    # A work buffer wider and longer than the block, holding garbage: only the block is written.
    work = torch.full((2, 3, 8, 128), 7.5)
    assert torch.equal(as_float(c, bits, work), q.float())
    assert torch.equal(as_float(c, bits), q.float())


def test_planes_split_widths_that_do_not_divide_a_byte():
    assert planes(8) == ((8, 0),) and planes(4) == ((4, 0),) and planes(2) == ((2, 0),)
    assert planes(3) == ((2, 0), (1, 2))
    assert planes(5) == ((4, 0), (1, 4))
    assert sum(w for w, _ in planes(7)) == 7


def test_three_bit_rows_hold_the_low_bits_then_the_high_bit():
    """A 3-bit row of D codes: D / 4 bytes of each code's two low bits (byte i: elements i, i + D/4,
    i + D/2, i + 3D/4, lowest first), then D / 8 bytes of its third bit (byte i: elements i + j D/8)."""
    q = torch.tensor([[5, 2, 7, 0, 1, 6, 3, 4]], dtype=torch.uint8)
    c = pack(q, 3)
    low = [int(x) & 3 for x in q[0]]
    high = [int(x) >> 2 for x in q[0]]
    want = [sum(low[2 * j] << (2 * j) for j in range(4)), sum(low[2 * j + 1] << (2 * j) for j in range(4)),
            sum(high[j] << j for j in range(8))]
    assert c.tolist() == [want]


def test_five_bit_rows_hold_nibbles_then_the_fifth_bit():
    q = torch.arange(1, 33, 2, dtype=torch.uint8)[None].repeat(2, 1)  # 16 odd codes, 1..31
    c = pack(q, 5)
    assert c.shape == (2, 10)
    low, high = q & 15, q >> 4
    assert torch.equal(c[:, :8], low[:, :8] | (low[:, 8:] << 4))
    assert torch.equal(c[:, 8:], sum(high[:, 2 * j : 2 * j + 2] << j for j in range(8)).to(torch.uint8))


@pytest.mark.parametrize("bits", [3, 5])
def test_unpack_reads_any_strides(bits):
    """A block of rows sliced anywhere (odd offsets, a size-1 dimension of odd stride) unpacks as
    its contiguous copy does."""
    gen = torch.Generator().manual_seed(4)
    D = 32
    rows = torch.randint(0, 2**bits, (3, 7, D), generator=gen).to(torch.uint8)
    packed = pack(rows, bits)
    Db = packed.shape[-1]
    flat = torch.cat([torch.zeros(3, dtype=torch.uint8), packed.flatten()])
    odd = torch.as_strided(flat, (3, 1, 7, Db), (7 * Db, 3, Db, 1), 3)  # offset 3: not a whole word
    assert torch.equal(unpack(odd, bits), rows.unsqueeze(1))
    assert torch.equal(unpack(packed[:, 2:5], bits), rows[:, 2:5])
