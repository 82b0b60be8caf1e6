"""``F.scaled_dot_product_attention`` without cuDNN's backend in eager CUDA calls.

cuDNN's attention builds an execution plan for every new shape, and in eager decode the key
length grows by one slot at every step: one decode step of a layer at 32k keys, batch 16, on an
H200 took 37 ms of host time in that planning, against 0.5 ms for the same call once planned
(benchmarks/step_kernels.py, ``--parts layer``). Flash and memory-efficient attention need no
plan. A captured step (``torch.compile``) attends fixed shapes, so it keeps PyTorch's choice; on
other devices there is nothing to choose.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

_PLANLESS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
         is_causal: bool = False, enable_gqa: bool = False) -> torch.Tensor:
    """``F.scaled_dot_product_attention(q, k, v, attn_mask, is_causal=..., enable_gqa=...)``:
    q (B, Hq, T, D), k, v (B, Hkv, S, D) -> (B, Hq, T, D), the layout the backend returns."""
    if q.is_cuda and not torch.compiler.is_compiling():
        with sdpa_kernel(_PLANLESS):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal,
                                                  enable_gqa=enable_gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=enable_gqa)
