"""RMSNorm in the two forms checkpoints use (``ModelConfig.norm``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """x / rms(x) * w (Llama, Mistral, Qwen): normalised in float32, scaled after casting back,
    as the reference implementations do."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + w) (Gemma): the weight is stored as an offset from one, and the scaling
    happens in float32 before the cast back, so a half-precision model rounds once."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


NORMS: dict[str, type[nn.Module]] = {"rms": RMSNorm, "gemma": GemmaRMSNorm}


def make_norm(kind: str, dim: int, eps: float) -> nn.Module:
    """The norm of ``kind`` (one of ``kvcache.model.config.NORMS``) over the last ``dim`` features."""
    return NORMS[kind](dim, eps)
