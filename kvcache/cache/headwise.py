"""Head-wise budgets (Ada-KV style): each K/V head of a layer gets its own capacity.

The saving is real: a layer is a set of single-head caches, each allocated at its own size,
rather than a full-size buffer with some slots masked. Any policy works per head; the layer
splits the query heads by group and concatenates the outputs.

``adaptive_head_budgets`` computes an allocation from a calibration prompt: the last ``window``
tokens vote for keys (SnapKV's pooled votes), and a layer's total budget goes to the
highest-voted (head, key) pairs across all its heads, so heads whose attention is concentrated
give up slots to heads whose attention is spread (Ada-KV, Feng et al. 2024).
"""

from __future__ import annotations

import dataclasses

import torch

from .base import CacheSpec, LayerCache, Step


class HeadwiseCache(LayerCache):
    """One layer whose K/V head h is a single-head ``cls`` cache of ``budgets[h]`` slots."""

    def __init__(self, spec: CacheSpec, cls: type[LayerCache], options: object, budgets: list[int]) -> None:
        if len(budgets) != spec.num_kv_heads or min(budgets) <= 0:
            raise ValueError(f"need {spec.num_kv_heads} positive head budgets, got {budgets}")
        super().__init__(spec, options)
        self.name = cls.name
        self.heads = [
            cls(dataclasses.replace(spec, num_kv_heads=1, cache_length=b), options) for b in budgets
        ]

    @property
    def budgets(self) -> list[int]:
        return [h.spec.cache_length for h in self.heads]

    def check(self, step: Step) -> None:
        for head in self.heads:
            head.check(step)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: Step) -> torch.Tensor:
        G = q.shape[1] // k.shape[1]
        outs = [
            head.attend(q[:, h * G : (h + 1) * G], k[:, h : h + 1], v[:, h : h + 1], step)
            for h, head in enumerate(self.heads)
        ]
        return torch.cat(outs, dim=1)

    def reset(self) -> None:
        for head in self.heads:
            head.reset()

    def nbytes(self) -> int:
        return sum(head.nbytes() for head in self.heads)


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
    Returns ``budgets[layer][head]``.
    """
    from .registry import make_cache

    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"input_ids must have shape (1, T), got {tuple(input_ids.shape)}")
    if not 0 <= floor <= 1:
        raise ValueError(f"floor must lie in [0, 1], got {floor}")
    T = input_ids.shape[1]
    window = min(window, T)
    # A SnapKV cache large enough to evict nothing records the pooled votes of the last tokens.
    probe = make_cache(model, "snapkv", cache_length=T + window + 1, window=window, kernel=kernel)
    for layer in probe.layers:
        # SnapKV computes votes only when it evicts, and this one never does: ask for them.
        layer.observe_every_step = True
    model(input_ids, probe)
    budgets = []
    for layer in probe.layers:
        votes = layer.stat["score"][0, :, :T]  # (Hkv, T)
        H = votes.shape[0]
        total = cache_length * H
        base = int(floor * cache_length)
        free = total - base * H
        flat = votes.flatten()
        chosen = flat.topk(min(free, flat.numel())).indices // T
        extra = torch.bincount(chosen, minlength=H)
        budgets.append([max(1, base + int(e)) for e in extra])
    return budgets
