"""Integer codes for quantized slot buffers: packing, and asymmetric quantization with fp16 scale
and zero point.

A group of numbers x (one token's channels, or one channel over a group of tokens) becomes codes

    q = round((x - zero) / scale),   q in [0, 2^bits - 1],   read back as q * scale + zero,

with ``zero`` the group's minimum rounded down to fp16 and ``scale`` = (max - zero) / (2^bits - 1)
rounded up to fp16. Rounding outward keeps every element inside the range the codes span, so each
comes back within scale / 2 (plus the rounding of the result to the model's dtype), and the min and
max map to codes 0 and 2^bits - 1. A constant group has scale 0 and comes back exactly.

Clipped ranges (``quantize(..., clip=...)``, ``KEY_CLIP``): with few levels, the min-max range spends
them on a group's extremes. Each group may instead take the range [min + a r, max - b r] (r =
max - min) of the candidate (a, b) pairs, min-max included, whose codes reconstruct the group with
the least squared error (ties: the earlier candidate, min-max first); elements outside it take
code 0 or 2^bits - 1. The codes and their meaning are unchanged (q * scale + zero), so the error
is never above min-max's, but an element may then come back further than scale / 2 from itself.
On the bundled model's 2-bit per-channel key groups this halves the error (docs/quantized.md).

Packing: at 1, 2, 4 and 8 bits ``8 // bits`` codes share a byte; element ``per * i + j`` of a row
sits in bits ``[j * bits, (j + 1) * bits)`` of byte i (int4: element 2i in the low nibble). Other
widths are split into bit planes of those widths (``planes``: 3 = 2 + 1, 5 = 4 + 1), one after the
other along the row, each of n bytes holding element ``j * n + i`` in lane j of byte i: a 3-bit
row of D codes is D / 4 bytes of each code's low two bits (byte i: elements i, i + D/4, i + D/2,
i + 3D/4), then D / 8 bytes of its third bit. Each lane of a plane is then a contiguous run of
the row, so a plane reads back as machine words, up to eight codes per shift and mask
(``unpack``); the 8-, 4- and 2-bit layout stays interleaved, as the Triton kernel and stored
prefixes read it. A row fills whole bytes when D * bits is a multiple of 8, which then holds for
every plane too.
"""

from __future__ import annotations

import torch

BITS = (2, 3, 4, 5, 8)
# Widths the CUDA decode kernel (kernels/triton_decode.py) reads: one plane of codes per byte.
# The split widths (3, 5) are attended by the blocked path everywhere.
KERNEL_BITS = (2, 4, 8)
FP16_MAX = 65504.0
# Clipped-range candidates for per-channel key groups (KIVI; fraction of the range cut off below,
# above) per code width; min-max, (0, 0), is always tried first. Widths not listed, keys per token
# and values quantize over the min-max range: clipping 2-bit values too halved their error but
# cost agreement, and finer cuts cost prefill time (docs/quantized.md).
_CUTS = (0.0, 0.1, 0.2, 0.3)
# At 3 bits finer cuts pay more: on SmolLM2-135M, KIVI's 3-bit top-1 agreement with dense went from
# 92.3% (min-max, keys with a scale each: KEY_TOKEN_SCALE) to 93.4% with these, 93.2% with the
# 2-bit ones (docs/quantized.md).
_FINE_CUTS = (0.0, 0.05, 0.1)
KEY_CLIP: dict[int, tuple[tuple[float, float], ...]] = {
    2: tuple((a, b) for a in _CUTS for b in _CUTS if a or b),
    3: tuple((a, b) for a in _FINE_CUTS for b in _FINE_CUTS if a or b),
}


# Widths whose per-channel key groups also take a scale per token (``quantize_scaled``): at 2 bits
# it takes the bundled model's KL against dense from 0.018 to 0.012 at no cost in bytes (the scale
# lives where a per-channel key's unread per-token scale was); at 3 bits SmolLM2-135M's top-1
# agreement from 91.3% to 92.3%. At 4 bits it gave 96.7% against 96.8% there: 4, 5 and 8 bits are
# unchanged.
KEY_TOKEN_SCALE = (2, 3)
# Per-token value groups (channel groups per head) per code width, when head_dim allows (KIVI's
# groups of 32 channels at head_dim 128); widths not listed keep one group over the head.
VALUE_GROUPS: dict[int, int] = {2: 4}
# The smallest token scale (fp16's smallest normal): a scale is positive, so its negation marks.
MIN_TOKEN_SCALE = 2.0**-14


def key_clip(bits: int) -> tuple[tuple[float, float], ...]:
    """The clipped ranges a storage of ``bits``-bit codes searches for per-channel key groups
    (``KEY_CLIP``; empty: min-max)."""
    return KEY_CLIP.get(bits, ())


def levels(bits: int) -> int:
    return 2**bits - 1


def planes(bits: int) -> tuple[tuple[int, int], ...]:
    """The bit planes a ``bits``-bit code is packed in: (width, shift) pairs, the widest (and lowest) first."""
    if bits in (1, 2, 4, 8):
        return ((bits, 0),)
    out, shift = [], 0
    for width in (4, 2, 1):
        if bits & width:
            out.append((width, shift))
            shift += width
    return tuple(out)


def _pack_plane(q: torch.Tensor, bits: int, lanes_of: int = 0) -> torch.Tensor:
    """Codes (..., D) below 2^bits, ``8 // bits`` a byte: element ``per * i + j`` in lane j of byte
    i, or with ``lanes_of`` n (a plane of a split width) element ``j * n + i``."""
    per = 8 // bits
    if per == 1:
        return q
    q = q.unflatten(-1, (per, -1)).movedim(-2, -1) if lanes_of else q.unflatten(-1, (-1, per))
    out = q[..., 0].clone()
    for j in range(1, per):
        out |= q[..., j] << (j * bits)
    return out


def _unpack_plane(c: torch.Tensor, bits: int, lanes_of: int = 0) -> torch.Tensor:
    per = 8 // bits
    if per == 1:
        return c
    mask = levels(bits)
    return torch.stack([(c >> (j * bits)) & mask for j in range(per)], -2 if lanes_of else -1).flatten(-2)


def plane_bytes(bits: int, head_dim: int) -> list[tuple[int, int, int, int]]:
    """(width, shift, first byte, bytes) of each plane of a row of ``head_dim`` codes."""
    out, at = [], 0
    for width, shift in planes(bits):
        n = head_dim * width // 8
        out.append((width, shift, at, n))
        at += n
    return out


def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """q: (..., D) uint8 codes below 2^bits -> (..., D * bits / 8) uint8."""
    parts = plane_bytes(bits, q.shape[-1])
    if len(parts) == 1:
        return _pack_plane(q, bits)
    return torch.cat([_pack_plane((q >> shift) & levels(width), width, n) for width, shift, _, n in parts], -1)


# Words a split width's planes are read in, widest first (``unpack``).
_WORDS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


def unpack(c: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of ``pack``: (..., D * bits / 8) uint8 -> (..., D) uint8."""
    D = c.shape[-1] * 8 // bits
    parts = plane_bytes(bits, D)
    if len(parts) == 1:
        return _unpack_plane(c, bits)
    # One word size for every plane: the largest that divides each plane's bytes (then each
    # plane starts at a whole word of its row too).
    size, word = next((size, t) for size, t in _WORDS if all(n % size == 0 for *_, n in parts))
    out = None
    for width, shift, at, n in parts:
        lanes = _plane_lanes(_words(c[..., at : at + n], word), width, shift)
        out = lanes if out is None else out.bitwise_or_(lanes)
    return out.view(torch.uint8)


def _words(x: torch.Tensor, word: torch.dtype) -> torch.Tensor:
    """x (..., n) uint8 viewed as ``word``s, copied first where its offset or strides are not
    whole words (and when compiling: the compiler fuses the copy, and cannot trace the offset)."""
    size = torch.iinfo(word).bits // 8
    aligned = not torch.compiler.is_compiling() and x.stride(-1) == 1 and x.storage_offset() % size == 0 and all(
        s % size == 0 for s in x.stride()[:-1])
    return (x if aligned else x.clone(memory_format=torch.contiguous_format)).view(word)


def _plane_lanes(words: torch.Tensor, width: int, shift: int) -> torch.Tensor:
    """A split width's plane (..., n / size) read as words -> its codes' bits at ``shift`` and up,
    (..., D / size) of the same word: byte i of lane j is element ``j * n + i``.
    Each lane is a contiguous run of the row, so one shift of the plane's words by a constant
    extracts a lane of several bytes at once, and one mask clears the other lanes' bits (lane by
    lane over bytes took a dozen strided operations, 2-3x the time; shifting by a tensor of
    shifts, about 1.3x)."""
    per_byte = (1 << (8 * words.element_size())) // 255  # 0x0101...01 of the word's size
    # Lane j's bits end up at [shift, shift + width) of each byte.
    moved = [words >> d if d >= 0 else words << -d for d in (j * width - shift for j in range(8 // width))]
    return torch.stack(moved, -2).flatten(-2).bitwise_and_((levels(width) << shift) * per_byte)


def _fp16(x: torch.Tensor, up: bool) -> torch.Tensor:
    """x (float32) rounded to fp16 toward +inf (``up``) or -inf, within fp16's finite range."""
    x = x.clamp(-FP16_MAX, FP16_MAX)
    h = x.half()
    wrong = h.float() < x if up else h.float() > x
    target = torch.full_like(h, float("inf") if up else float("-inf"))
    return torch.where(wrong, torch.nextafter(h, target), h)


def _range(lo: torch.Tensor, hi: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp16 scale and zero point of the range [lo, hi] (float32), rounded outward: the scale is
    the smallest fp16 whose ``levels(bits)`` steps cover hi - zero, on every device. (CUDA divides
    by a Python number as a multiplication by its reciprocal, an ulp off the CPU's division, which
    rounded up can give the next fp16: then a round trip would not give back its codes.)"""
    zero = _fp16(lo, up=False)
    span, n = hi - zero.float(), levels(bits)
    scale = _fp16(span / n, up=True)
    # fp16 times n < 256 is exact in float32, so this test is the same everywhere.
    below = torch.nextafter(scale, torch.full_like(scale, float("-inf")))
    return torch.where(below.float() * n >= span, below, scale), zero


def _codes(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """float32 codes of x (float32) under fp16 ``scale`` and ``zero``, in [0, 2^bits - 1]."""
    s = scale.float()
    return ((x - zero.float()) / torch.where(s > 0, s, 1.0)).round_().clamp_(0, levels(bits))


def _clipped(x: torch.Tensor, bits: int, dim: int, lo: torch.Tensor, hi: torch.Tensor, valid: torch.Tensor | None,
             clip) -> tuple[torch.Tensor, torch.Tensor]:
    """Per group, the range among min-max and the ``clip`` candidates whose codes reconstruct x
    (float32) with the least squared error over ``dim`` (``valid`` elements only)."""
    r = hi - lo
    best_lo, best_hi, best = lo, hi, None
    for a, b in ((0.0, 0.0), *clip):
        c_lo, c_hi = (lo, hi) if a == b == 0 else (lo + a * r, hi - b * r)
        scale, zero = _range(c_lo, c_hi, bits)
        err = (_codes(x, scale, zero, bits).mul_(scale.float()).add_(zero.float()) - x).square_()
        if valid is not None:
            err = err.masked_fill_(~valid, 0.0)
        err = err.sum(dim, keepdim=True)
        if best is None:
            best = err
            continue
        better = err < best
        best = torch.where(better, err, best)
        best_lo, best_hi = torch.where(better, c_lo, best_lo), torch.where(better, c_hi, best_hi)
    return best_lo, best_hi


def quantize(x: torch.Tensor, bits: int, dim: int, valid: torch.Tensor | None = None, clip=()
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize x over dimension ``dim`` (the group). Returns unpacked codes (x's shape, uint8)
    and fp16 scale and zero with ``dim`` kept as size 1. ``valid`` (broadcastable to x, bool)
    leaves elements out of the range (the missing slots of a partial group); their codes are 0.
    ``clip``: (a, b) pairs, clipped ranges searched besides min-max (module docstring)."""
    x = x.float()
    lo_in, hi_in = (x, x) if valid is None else (x.masked_fill(~valid, float("inf")), x.masked_fill(~valid, float("-inf")))
    lo = lo_in.amin(dim, keepdim=True)
    hi = hi_in.amax(dim, keepdim=True)
    if valid is not None:
        # A group with no valid element: any finite range will do.
        empty = torch.isinf(lo)
        lo, hi = lo.masked_fill(empty, 0.0), hi.masked_fill(empty, 0.0)
    if clip:
        lo, hi = _clipped(x, bits, dim, lo, hi, valid, clip)
    scale, zero = _range(lo, hi, bits)
    q = _codes(x, scale, zero, bits)
    if valid is not None:
        q = q.masked_fill(~valid, 0)
    return q.to(torch.uint8), scale, zero


def quantize_scaled(x: torch.Tensor, bits: int, clip=(), given: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """Per-channel codes of a group of keys x (..., G, D) (G slots, D channels) with a scale per
    key on top: each key is read back as ``(q * scale + zero) * t``, scale and zero per channel
    (..., 1, D), t per key (..., G, 1), all fp16.

    Each key is divided by its root mean square (rounded to fp16) before the group is quantized
    per channel (``quantize`` over the G slots, with ``clip``), so that keys of large norm do not
    widen every channel's range; then t is refitted per key to the least-squares factor of its
    decoded codes (positive, else the root mean square). t is at least ``MIN_TOKEN_SCALE``.

    ``given`` (..., G, 1): a key whose entry is positive keeps that scale, and is divided by it
    (a key read back from codes, sealed again with new keys: it then is its old codes' reading,
    which a range that the new keys did not widen gives back, instead of drifting each time).
    Returns codes (x's shape, uint8), scale, zero and t."""
    x = x.float()
    rms = x.square().mean(-1, keepdim=True).sqrt().clamp_(MIN_TOKEN_SCALE, FP16_MAX).half().float()
    keep = None if given is None else given.float() > 0
    div = rms if keep is None else torch.where(keep, given.float(), rms)
    q, scale, zero = quantize(x / div, bits, dim=-2, clip=clip)
    u = q.float() * scale.float() + zero.float()
    fit = (x * u).sum(-1, keepdim=True) / u.square().sum(-1, keepdim=True)
    t = torch.where(torch.isfinite(fit) & (fit > 0), fit, rms).clamp_(MIN_TOKEN_SCALE, FP16_MAX)
    if keep is not None:
        t = torch.where(keep, given.float(), t)
    return q, scale, zero, t.half()


# Elements encoded or decoded per token at a time: each token is coded on its own, so a long
# chunk goes in slices of tokens, and its float32 temporaries stay about 1 MiB each instead of
# following the chunk (same codes, same values).
SLICE_ELEMENTS = 2**18


def _token_slices(x: torch.Tensor) -> list[slice]:
    """Slices of x's token dimension (the one before the last) of about ``SLICE_ELEMENTS``."""
    if x.dim() < 2 or x.numel() <= SLICE_ELEMENTS:
        return [slice(None)]
    T = x.shape[-2]
    step = max(1, SLICE_ELEMENTS * T // x.numel())
    return [slice(t, t + step) for t in range(0, T, step)]


def encode_tokens(x: torch.Tensor, bits: int, group: int, clip=()) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token codes: x (..., D) in groups of ``group`` channels -> packed codes
    (..., D * bits / 8) uint8 and meta (..., 2 * D / group) fp16 (the scales, then the zeros).
    ``clip``: as ``quantize``'s. Long inputs are coded a slice of tokens at a time."""
    parts = _token_slices(x)
    if len(parts) > 1:
        D = x.shape[-1]
        codes = x.new_empty(x.shape[:-1] + (D * bits // 8,), dtype=torch.uint8)
        meta = x.new_empty(x.shape[:-1] + (2 * (D // group),), dtype=torch.float16)
        for t in parts:
            codes[..., t, :], meta[..., t, :] = encode_tokens(x[..., t, :], bits, group, clip)
        return codes, meta
    g = x.unflatten(-1, (-1, group))  # (..., n, group)
    q, scale, zero = quantize(g, bits, dim=-1, clip=clip)
    return pack(q.flatten(-2), bits), torch.cat((scale, zero), -2).flatten(-2)


def decode_tokens(c: torch.Tensor, meta: torch.Tensor, bits: int, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of ``encode_tokens``: (..., D) at ``dtype``. Long inputs a slice of tokens at a time."""
    parts = _token_slices(c)
    if len(parts) > 1:
        D = c.shape[-1] * 8 // bits
        out = torch.empty(c.shape[:-1] + (D,), dtype=dtype, device=c.device)
        for t in parts:
            out[..., t, :] = decode_tokens(c[..., t, :], meta[..., t, :], bits, dtype)
        return out
    q = unpack(c, bits)
    scale, zero = meta.float().unflatten(-1, (2, -1, 1)).unbind(-3)  # (..., n, 1) each
    g = q.unflatten(-1, (scale.shape[-2], -1)).float().mul_(scale).add_(zero)
    return g.flatten(-2).to(dtype)
