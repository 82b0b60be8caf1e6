"""Linear layers over 4-bit weights: each row's input channels in groups of 32, each group with
its own scale and zero point, multiplied by torch's packed int4 CPU kernel.

A group x (32 weights of one output row) becomes codes

    q = round((x - lo) / s),   s = (hi - lo) / 15,   q in [0, 15],

lo and hi the group's minimum and maximum. The kernel reads a code back as (q - 8) * scale + zero
with scale = s and zero = lo + 8 s, both held in bfloat16, and multiplies bfloat16 inputs with
float32 sums. So a weight comes back within s / 2 of itself plus the bfloat16 rounding of its
scale and zero (each within 2^-8 of itself, the scale's counted |q - 8| <= 8 times), and the
layer's inputs and outputs are rounded to bfloat16: the layer is an approximation of the float one, measured in docs/gguf.md.

Why these groups: GGUF's Q4_1 blocks are exactly min-max groups of 32 input channels (codes 0
and 15 in every block that is not constant), so quantizing the dequantized weights of a Q4_1
file gives back the file's own codes, and only its fp16 scales and minimums are rounded to
bfloat16. Q4_0 blocks are symmetric (-8 d .. 7 d) and come back as the codes of their own min-max
range, an error of the same order.

Why two copies of the codes: the kernel takes its codes in a layout of its own that depends on
the CPU's vector width; it reads each weight once per call, which makes a one-token step read 8x
fewer bytes than float32 weights, but for many rows at once (a prefill) dequantizing to float and
calling ``F.linear`` is faster. ``codes`` (out_features, in_features / 2), two codes a byte, input
channel 2i in the low nibble, is the portable copy that dequantizing reads and the state dict
keeps; the kernel's copy is rebuilt from it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

GROUP = 32
# Rows per call at or below which the packed kernel runs; above it the weights are dequantized
# and multiplied in the input's dtype (on 2 cores the kernel's time grows with the rows, while
# dequantizing costs one pass over the weights whatever the rows).
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
        self.register_buffer("codes", codes)  # (out, in / 2) uint8
        self.register_buffer("scales_zeros", scales_zeros)  # (in / GROUP, out, 2) bfloat16
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.register_buffer("kernel_codes", _kernel_layout(codes), persistent=False)
        self.register_load_state_dict_post_hook(lambda module, _: module.rebuild_kernel_codes())

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

    def rebuild_kernel_codes(self) -> None:
        self.kernel_codes = _kernel_layout(self.codes)

    @property
    def weight(self) -> torch.Tensor:
        """W (out_features, in_features) in the float layer's dtype, made at each access (for
        readers of a projection's weight, such as the critical policy's value norms)."""
        return self.dequantize(self.dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W (out_features, in_features) in ``dtype``, as the kernel reads it."""
        q = torch.stack((self.codes & 15, self.codes >> 4), -1).reshape(self.out_features, -1, GROUP)
        scale, zero = self.scales_zeros.float().transpose(0, 1).unsqueeze(-1).unbind(-2)  # (out, in / GROUP, 1)
        # (q - 8) scale + zero, as q scale + (zero - 8 scale): one pass over the weights.
        w = torch.addcmul(zero - 8 * scale, q.float(), scale)
        return w.reshape(self.out_features, self.in_features).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] > KERNEL_MAX_ROWS:
            # The kernel's numbers: bfloat16 inputs, float32 sums, a bfloat16 result.
            y = F.linear(rows.to(torch.bfloat16).float(), self.dequantize()).to(torch.bfloat16).to(x.dtype)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                rows.to(torch.bfloat16), self.kernel_codes, GROUP, self.scales_zeros
            ).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, group={GROUP}"


def _kernel_layout(codes: torch.Tensor) -> torch.Tensor:
    """The kernel's own layout of ``codes`` (out, in / 2) uint8."""
    q = torch.stack((codes & 15, codes >> 4), -1).reshape(codes.shape[0], -1).to(torch.int32)
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)


def quantize_model(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` inside the model's blocks (attention and MLP projections) by
    its ``Int4Linear``, in place; the embedding and the output head stay as they are. Returns
    the number of layers replaced."""
    replaced = 0
    for block in model.layers:
        for parent in block.modules():
            for name, child in list(parent.named_children()):
                if type(child) is nn.Linear:
                    setattr(parent, name, Int4Linear.quantize(child))
                    replaced += 1
    return replaced
