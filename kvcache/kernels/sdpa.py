"""``F.scaled_dot_product_attention`` without cuDNN's backend in eager CUDA calls.

cuDNN's attention builds an execution plan for every new shape, and in eager decode the key
length grows by one slot at every step: one decode step of a layer at 32k keys, batch 16, on an
H200 took 37 ms of host time in that planning, against 0.5 ms for the same call once planned
(benchmarks/step_kernels.py, ``--parts layer``). The flash, memory-efficient and math backends
plan nothing. A captured step (``torch.compile``) attends fixed shapes, so it keeps PyTorch's
choice, and so does every device but CUDA, where no backend plans per shape.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def _enabled_without_cudnn() -> list[SDPBackend]:
    """The CUDA backends the caller has enabled (torch.backends.cuda's switches), cuDNN's left out."""
    switches = [(SDPBackend.FLASH_ATTENTION, torch.backends.cuda.flash_sdp_enabled),
                (SDPBackend.EFFICIENT_ATTENTION, torch.backends.cuda.mem_efficient_sdp_enabled),
                (SDPBackend.MATH, torch.backends.cuda.math_sdp_enabled)]
    return [backend for backend, enabled in switches if enabled()]


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
         is_causal: bool = False, enable_gqa: bool = False) -> torch.Tensor:
    """``F.scaled_dot_product_attention(q, k, v, attn_mask, is_causal=..., enable_gqa=...)``:
    q (B, Hq, T, D), k, v (B, Hkv, S, D) -> (B, Hq, T, D), the layout the backend returns.

    In an eager CUDA call, the backends the caller has enabled but cuDNN's (the switches are
    process-wide: restored after the call, as ``sdpa_kernel`` does); where cuDNN's is the only
    one enabled, it is used."""
    backends = _enabled_without_cudnn() if q.is_cuda and not torch.compiler.is_compiling() else []
    if backends:
        with sdpa_kernel(backends):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal,
                                                  enable_gqa=enable_gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=enable_gqa)


def with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False
             ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Attention and its log-sum-exp from one fused call, or None where no fused kernel returns
    both here (only the CPU's flash kernel is used: its log-sum-exp is what its own softmax
    divided by). q (B, H, T, D), k, v (B, H, S, D), the same head count (no grouping) ->
    ((B, H, T, D), (B, H, T) float32). With ``is_causal`` query t sees keys [0, t]."""
    if q.device.type != "cpu" or q.dtype not in (torch.float32, torch.bfloat16, torch.float16) or q.requires_grad:
        return None
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal)
    return out, lse
