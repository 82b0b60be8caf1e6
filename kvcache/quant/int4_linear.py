"""Linear layers over 4-bit weights: each row's input channels in groups of 32, each group with
its own scale and zero point, multiplied by torch's packed int4 CPU kernel.

A group x (32 weights of one output row) becomes codes

    q = round((x - lo) / s),   s = (hi - lo) / 15,   q in [0, 15],

lo and hi the group's minimum and maximum. The kernel reads a code back as (q - 8) * scale + zero
with scale = s and zero = lo + 8 s, both held in bfloat16, and multiplies bfloat16 inputs with
float32 sums into a bfloat16 result. So a weight comes back within s / 2 of itself plus the
bfloat16 rounding of its scale and zero (each within 2^-8 of itself, the scale's counted
|q - 8| <= 8 times), and a decode step's inputs and outputs of the layer are rounded to
bfloat16: the layer is an approximation of the float one, measured in docs/gguf.md. A
prefill's rows multiply the same dequantized weights in their own dtype.

Why these groups: GGUF's Q4_1 blocks are exactly min-max groups of 32 input channels (codes 0
and 15 in every block that is not constant), so quantizing the dequantized weights of a Q4_1
file gives back the file's own codes, and only its fp16 scales and minimums are rounded to
bfloat16. Q4_0 blocks (d (q - 8), no minimum) come back as their own codes too where they hold
codes 0 and 15; others are quantized afresh over their own smaller range.

Where the codes live: the kernel takes them in a layout of its own, which depends on the CPU's
vector width; it reads each weight once per call, so a one-token step reads 8x fewer bytes than
from float32 weights. For many rows at once (a prefill) dequantizing to float and calling
``F.linear`` is faster, and dequantizing reads the same bytes: where the kernel's layout is
blocks of B rows with the codes of one input channel side by side in a fixed order of the
block's rows (``_nibble_of_row``, found by packing probes and checked on the layer's own codes), the
codes are held once, in the kernel's layout; otherwise a portable copy is kept beside it. The
state dict holds the portable layout, ``codes`` (out_features, in_features / 2) uint8, two codes
a byte, input channel 2i in the low nibble, whatever the CPU.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

GROUP = 32
# Rows per call at or below which the packed kernel runs; above it the weights are dequantized
# for the call and multiplied by F.linear in the input's dtype (the kernel's time grows with the
# rows, while dequantizing costs one pass over the weights whatever the rows).
KERNEL_MAX_ROWS = 8


class Int4Linear(nn.Module):
    """y = x W^T + b with W (out_features, in_features) held as 4-bit codes (module docstring).

    x (..., in_features) of any float dtype; y (..., out_features) in x's dtype. Build one with
    ``Int4Linear.quantize(linear)``; CPU only (the kernel is torch's CPU int4 matmul)."""

    def __init__(self, codes: torch.Tensor, scales_zeros: torch.Tensor, bias: torch.Tensor | None,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        out_features, half = codes.shape
        self.in_features, self.out_features = 2 * half, out_features
        self.dtype = dtype  # the float layer's, which ``weight`` comes back in
        self.register_buffer("scales_zeros", scales_zeros)  # (in / GROUP, out, 2) bfloat16
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        # Both rebuilt from the state dict's portable codes (``_load_from_state_dict``).
        self.register_buffer("kernel_codes", None, persistent=False)  # (out, in / 2) uint8, the kernel's layout
        self.register_buffer("portable", None, persistent=False)  # the portable codes, where kept
        self._set_codes(codes)

    def _set_codes(self, codes: torch.Tensor) -> None:
        """Hold ``codes`` (out, in / 2) uint8, portable layout: in the kernel's layout, and as
        they are only where that layout is not one ``unpacked`` can read."""
        self.kernel_codes = _kernel_layout(codes)
        self.nibble_of_row = _nibble_of_row(self.out_features)
        self.portable = None
        if self.nibble_of_row is None or not torch.equal(self.unpacked(), _unpack(codes)):
            self.nibble_of_row, self.portable = None, codes

    @property
    def codes(self) -> torch.Tensor:
        """The codes (out_features, in_features / 2) uint8, portable layout (module docstring)."""
        if self.portable is not None:
            return self.portable
        q = self.unpacked()
        return q[:, 0::2] | (q[:, 1::2] << 4)

    def unpacked(self) -> torch.Tensor:
        """One code a byte: (out_features, in_features) uint8."""
        if self.portable is not None:
            return _unpack(self.portable)
        B = self.nibble_of_row.numel()
        bytes_ = self.kernel_codes.reshape(self.out_features // B, self.in_features, B // 2)
        low, high = bytes_ & 15, bytes_ >> 4
        if torch.equal(self.nibble_of_row, _halves(B)):  # rows [0, B/2) low, [B/2, B) high: torch's AVX layouts
            rows = torch.cat((low, high), -1)
        else:
            rows = torch.stack((low, high), -1).reshape(self.out_features // B, self.in_features, B)
            if not torch.equal(self.nibble_of_row, torch.arange(B)):  # rows in nibble order: no gather
                rows = rows[..., self.nibble_of_row]
        return rows.transpose(1, 2).reshape(self.out_features, self.in_features)

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "codes"] = self.codes

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs) -> None:
        codes = state_dict.get(prefix + "codes")
        if codes is None:
            missing_keys.append(prefix + "codes")
        elif codes.shape != (self.out_features, self.in_features // 2) or codes.dtype != torch.uint8:
            error_msgs.append(f"{prefix}codes: expected uint8 {(self.out_features, self.in_features // 2)}, "
                              f"got {codes.dtype} {tuple(codes.shape)}")
        else:
            self._set_codes(codes.contiguous())
        rest = {k: v for k, v in state_dict.items() if k != prefix + "codes"}
        super()._load_from_state_dict(rest, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)

    @classmethod
    def quantize(cls, linear: nn.Linear) -> Int4Linear:
        """The 4-bit version of ``linear`` (a CPU ``nn.Linear`` whose in_features is a multiple
        of 32 and out_features of 16, the kernel's tiles)."""
        w = linear.weight.detach()
        out_features, in_features = w.shape
        if w.device.type != "cpu":
            raise ValueError(f"int4 weights run on the CPU; this layer's weight is on {w.device}")
        if in_features % GROUP or out_features % 16:
            raise ValueError(
                f"int4 weights need in_features a multiple of {GROUP} and out_features of 16; "
                f"this layer is {in_features} -> {out_features}"
            )
        groups = w.float().reshape(out_features, in_features // GROUP, GROUP)
        lo = groups.amin(-1, keepdim=True)
        scale = (groups.amax(-1, keepdim=True) - lo) / 15
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round((groups - lo) / safe).clamp_(0, 15).to(torch.uint8).reshape(out_features, in_features)
        codes = q[:, 0::2] | (q[:, 1::2] << 4)
        zero = lo + 8 * scale
        scales_zeros = torch.stack((scale, zero), -1).squeeze(2).transpose(0, 1).to(torch.bfloat16).contiguous()
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(codes.contiguous(), scales_zeros, bias, w.dtype)

    @property
    def weight(self) -> torch.Tensor:
        """W (out_features, in_features) in the float layer's dtype, made at each access (for
        readers of a projection's weight, such as the critical policy's value norms)."""
        return self.dequantize(self.dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W (out_features, in_features) in ``dtype``, as the kernel reads it."""
        q = self.unpacked().reshape(self.out_features, -1, GROUP)
        scale, zero = self.scales_zeros.float().transpose(0, 1).unsqueeze(-1).unbind(-2)  # (out, in / GROUP, 1)
        # (q - 8) scale + zero, as q scale + (zero - 8 scale): one pass over the weights.
        w = torch.addcmul(zero - 8 * scale, q.float(), scale)
        return w.reshape(self.out_features, self.in_features).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu" or self.kernel_codes.device.type != "cpu":
            raise RuntimeError(f"int4 weights run on the CPU only; this layer's input is on {x.device} and its "
                               f"codes on {self.kernel_codes.device} (load the model with weights='full' there)")
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] > KERNEL_MAX_ROWS:
            y = F.linear(rows, self.dequantize(x.dtype))
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                rows.to(torch.bfloat16), self.kernel_codes, GROUP, self.scales_zeros
            ).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, group={GROUP}"


@functools.cache
def _halves(B: int) -> torch.Tensor:
    """The nibble of each row where a block's first B/2 rows are its bytes' low nibbles and the
    rest their high ones: row r < B/2 at nibble 2r, row B/2 + r at 2r + 1."""
    r = torch.arange(B // 2)
    return torch.cat((2 * r, 2 * r + 1))


def _unpack(codes: torch.Tensor) -> torch.Tensor:
    """(out, in / 2) uint8, two codes a byte -> (out, in) uint8, one a byte."""
    return torch.stack((codes & 15, codes >> 4), -1).reshape(codes.shape[0], -1)


def _pack_for_kernel(q: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)


def _kernel_layout(codes: torch.Tensor) -> torch.Tensor:
    """The kernel's own layout of ``codes`` (out, in / 2) uint8."""
    return _pack_for_kernel(_unpack(codes))


@functools.cache
def _nibble_of_row(out_features: int) -> torch.Tensor | None:
    """Where the kernel lays out a matrix of ``out_features`` rows in blocks of B rows, each
    block holding the B codes of input channel 0, then the B of channel 1, ..., always in the same
    order of the block's rows: (B,) int64, the position among a channel's B nibbles (low nibble
    of a byte first) of each row of the block. None where its layout is otherwise. Found by
    packing a matrix of 2 * GROUP input channels whose codes spell out each code's row and column,
    four bits a probe (``Int4Linear`` then checks the answer on each layer's own codes)."""
    n, k = out_features, 2 * GROUP
    rows = torch.arange(n).view(n, 1).expand(n, k)
    cols = torch.arange(k).view(1, k).expand(n, k)

    def spelled(index: torch.Tensor, size: int) -> torch.Tensor:
        out = torch.zeros(n * k, dtype=torch.int64)
        for shift in range(0, (size - 1).bit_length(), 4):
            out |= _unpack(_pack_for_kernel((index >> shift) & 15)).reshape(-1).long() << shift
        return out

    row_of, col_of = spelled(rows, n), spelled(cols, k)
    B = int((col_of != 0).nonzero()[0])
    if n % B:
        return None
    order = row_of[:B]
    expect_rows = (torch.arange(n // B).view(-1, 1, 1) * B + order.view(1, 1, B)).expand(n // B, k, B)
    expect_cols = torch.arange(k).view(1, k, 1).expand(n // B, k, B)
    if torch.equal(row_of.view(n // B, k, B), expect_rows) and torch.equal(col_of.view(n // B, k, B), expect_cols):
        return torch.argsort(order)
    return None


def quantize_model(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` inside the model's blocks (attention and MLP projections) by
    its ``Int4Linear``, in place; the embedding and the output head stay as they are. Returns
    the number of layers replaced. Every layer is checked before any is replaced, so a model
    with one layer the kernel cannot take is refused (ValueError naming it) and left as it was."""
    targets = []  # (name in the model, parent module, attribute, the linear layer)
    for i, block in enumerate(model.layers):
        for parent_name, parent in block.named_modules():
            for name, child in parent.named_children():
                if type(child) is nn.Linear:
                    targets.append((f"layers.{i}.{parent_name}.{name}".replace("..", "."), parent, name, child))
    for path, _, _, child in targets:
        out_features, in_features = child.weight.shape
        if in_features % GROUP or out_features % 16:
            raise ValueError(f"int4 weights need each projection's in_features to be a multiple of {GROUP} and "
                             f"out_features of 16; {path} is {in_features} -> {out_features}")
    for _, parent, name, child in targets:
        setattr(parent, name, Int4Linear.quantize(child))
    return len(targets)
