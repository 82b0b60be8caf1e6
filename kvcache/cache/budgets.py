"""How a budget is spread: over layers (uniform, PyramidKV) and over K/V heads (Ada-KV).

Computed here, outside the cache classes: ``make_cache`` turns a budget into one capacity per
layer (or per layer and head) and then allocates each layer at its own size.

``adaptive_head_budgets`` computes a per-head allocation from a calibration prompt: the last
``window`` tokens vote for keys (SnapKV's pooled votes), and a layer's total budget goes to the
highest-voted (head, key) pairs across all its heads, so heads whose attention is concentrated
give up slots to heads whose attention is spread (Ada-KV, Feng et al. 2024).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..kernels import attention
from .base import CacheSpec, KVCache, Step
from .policies.dense import DenseCache
from .policies.snapkv import pool_votes

ALLOCATIONS = ("uniform", "pyramid")
# PyramidKV's top layer keeps cache_length / PYRAMID_BETA tokens; the bottom layer what is left.
PYRAMID_BETA = 20


def layer_budgets(cache_length: int, num_layers: int, allocation: str | Sequence[int]) -> list[int]:
    """Tokens per layer: the same everywhere, a PyramidKV pyramid with mean ``cache_length``
    (more in lower layers, where attention is broad), or an explicit list."""
    if not isinstance(allocation, str):
        budgets = [int(b) for b in allocation]
        if len(budgets) != num_layers or min(budgets) <= 0:
            raise ValueError(f"layer budgets must be {num_layers} positive integers, got {budgets}")
        return budgets
    if allocation == "uniform":
        return [cache_length] * num_layers
    if allocation == "pyramid":
        if num_layers == 1:
            return [cache_length]
        top = max(1, cache_length // PYRAMID_BETA)
        bottom = 2 * cache_length - top
        return [round(bottom - (bottom - top) * i / (num_layers - 1)) for i in range(num_layers)]
    raise ValueError(f"unknown layer allocation {allocation!r}; use one of {', '.join(ALLOCATIONS)} or a list")


class _VoteRecorder(DenseCache):
    """A dense layer cache that also records, for a prompt fed in one call, the attention its
    last ``observed`` queries give every key, pooled over neighbouring positions (SnapKV's votes)."""

    def __init__(self, spec: CacheSpec, observed: int, kernel: int) -> None:
        super().__init__(spec)
        self.observed, self.kernel = observed, kernel
        self.votes: torch.Tensor | None = None  # (B, Hkv, T) after the call

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: Step) -> torch.Tensor:
        out = super().attend(q, k, v, step)
        T = step.num_tokens
        listened = slice(T - self.observed, T)
        k_pos = step.positions[:, None, :]
        weight = torch.ones_like(step.positions[:, listened], dtype=torch.float32)
        _, mass, _ = attention.masked_with_weights(
            q[:, :, listened], k, v, step.positions[:, listened], k_pos, weight, limit=self.spec.sliding_window,
            outputs=False, scores=self.spec.scores)
        self.votes = pool_votes(mass, k_pos.expand_as(mass), self.kernel, "avg")
        return out


@torch.inference_mode()
def adaptive_head_budgets(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    cache_length: int,
    *,
    window: int = 32,
    kernel: int = 7,
    floor: float = 0.2,
) -> list[list[int]]:
    """Per-layer, per-K/V-head budgets averaging ``cache_length`` tokens per head.

    input_ids: (1, T) calibration prompt. A fraction ``floor`` of each layer's budget is shared
    equally (no head starves); the rest follows the pooled observation-window votes.
    Returns ``budgets[layer][head]``, to pass as ``make_cache(..., head_budgets=...)``.
    """
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"input_ids must have shape (1, T), got {tuple(input_ids.shape)}")
    if not 0 <= floor <= 1:
        raise ValueError(f"floor must lie in [0, 1], got {floor}")
    if kernel <= 0 or kernel % 2 == 0:
        raise ValueError(f"kernel must be a positive odd number, got {kernel}")
    T = input_ids.shape[1]
    window = min(window, T)
    specs = [CacheSpec.for_model(model, batch_size=1, cache_length=T, layer=i) for i in range(model.config.num_layers)]
    probe = KVCache([_VoteRecorder(spec, window, kernel) for spec in specs], specs[0], "dense")
    model(input_ids, probe)
    budgets = []
    for layer in probe.layers:
        votes = layer.votes[0]  # (Hkv, T)
        H = votes.shape[0]
        total = cache_length * H
        base = int(floor * cache_length)
        free = total - base * H
        flat = votes.flatten()
        chosen = flat.topk(min(free, flat.numel())).indices // T
        extra = torch.bincount(chosen, minlength=H)
        budgets.append([max(1, base + int(e)) for e in extra])
    return budgets
