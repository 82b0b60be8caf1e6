"""gpt-oss's mixture of experts (``ModelConfig.mlp == "experts"``).

A router scores every expert for each token; the token goes to its ``experts_per_token`` best,
weighted by a softmax over their scores. Each expert is a SwiGLU with clamps:
    gate, up = (x W_gu + b_gu) split at even and odd columns
    gate = min(gate, limit); up = clamp(up, -limit, limit)
    out = ((up + 1) * gate * sigmoid(alpha * gate)) W_down + b_down
The parameters are laid out as the checkpoints store them: (experts, in, out) per projection.
"""

from __future__ import annotations

import torch
from torch import nn

from .config import ModelConfig


class ExpertWeights(nn.Module):
    """Every expert's projections, stacked: gate_up_proj (E, hidden, 2 * I) with gate and up
    interleaved by column, down_proj (E, I, hidden), and their biases."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        E, H, I = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.zeros(E, H, 2 * I))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(E, 2 * I))
        self.down_proj = nn.Parameter(torch.zeros(E, I, H))
        self.down_proj_bias = nn.Parameter(torch.zeros(E, H))


class Experts(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.router = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=True)
        self.experts = ExpertWeights(cfg)
        self.top_k = cfg.experts_per_token
        self.alpha = cfg.swiglu_alpha
        self.limit = cfg.swiglu_limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, T, hidden) -> (B, T, hidden)."""
        flat = x.reshape(-1, x.shape[-1])  # (N, hidden)
        top, chosen = self.router(flat).topk(self.top_k, dim=-1)  # (N, k) each
        weight = top.softmax(-1)
        if x.shape[1] == 1:
            out = self._gathered(flat, chosen, weight)
        else:
            out = self._by_expert(flat, chosen, weight)
        return out.view_as(x)

    def _swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate = gate_up[..., ::2].clamp(max=self.limit)
        up = gate_up[..., 1::2].clamp(-self.limit, self.limit)
        return (up + 1) * gate * torch.sigmoid(gate * self.alpha)

    def _gathered(self, flat: torch.Tensor, chosen: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """One token per row (a decode step): each token's k experts gathered, with shapes that do
        not depend on the routing, so the step can be captured. flat (N, H); chosen, weight (N, k)."""
        w = self.experts
        h = torch.einsum("nh,nkhi->nki", flat, w.gate_up_proj[chosen]) + w.gate_up_proj_bias[chosen]
        out = torch.einsum("nki,nkih->nkh", self._swiglu(h), w.down_proj[chosen]) + w.down_proj_bias[chosen]
        return (out * weight.unsqueeze(-1)).sum(1)

    def _by_expert(self, flat: torch.Tensor, chosen: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """A chunk: each expert runs once over the tokens routed to it (reading its weights once)."""
        w = self.experts
        out = torch.zeros_like(flat)
        for e in chosen.unique().tolist():
            token, slot = (chosen == e).nonzero(as_tuple=True)
            h = self._swiglu(flat[token] @ w.gate_up_proj[e] + w.gate_up_proj_bias[e])
            y = h @ w.down_proj[e] + w.down_proj_bias[e]
            out.index_add_(0, token, (y * weight[token, slot, None]).to(out.dtype))
        return out
