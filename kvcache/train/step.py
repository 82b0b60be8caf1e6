"""One chunk's share of ``chunked_loss``, as a module.

``chunked_loss`` runs the model once per chunk in each of its two passes. Data-parallel wrappers
act at a module's call: DDP prepares its gradient all-reduce in its ``forward``, FSDP2's
``fully_shard`` gathers a module's parameters before its ``forward`` and reduce-scatters their
gradients after its backward. The chunk's whole computation, the model and the loss of its
targets (the output head included, which the model skips), is therefore one module call that
either wrapper can take: ``ChunkStep``. Single-process ``chunked_loss`` calls it unwrapped.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..cache.base import KVCache


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The kvcache ``Transformer`` inside ``model`` (itself, or a peft model's base model, with its
    adapters in place)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


class ChunkStep(torch.nn.Module):
    """The weighted cross-entropy of one chunk: ``model`` (a ``Transformer``, or a peft model of
    one) run on the chunk through ``cache``, then its output head and the loss."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    @property
    def transformer(self) -> torch.nn.Module:
        return base_model(self.model)

    def forward(self, ids: torch.Tensor, cache: KVCache, targets: torch.Tensor, weights: torch.Tensor,
                denom: torch.Tensor, ignore_index: int) -> torch.Tensor:
        """ids, targets: (B, n) long; weights: (B, n) float32, each target's weight; denom: ()
        the whole call's total weight. Returns () the chunk's weighted loss sum over ``denom``."""
        model = self.transformer
        hidden = model(ids, cache, skip_lm_head=True)
        logits = model.head(hidden).float()
        losses = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=ignore_index, reduction="none")
        return (losses * weights.flatten()).sum() / denom


def sharded_step(model: torch.nn.Module) -> tuple[torch.nn.Module, ChunkStep] | None:
    """(what to call, the ChunkStep) if ``model`` is a ChunkStep wrapped for data parallelism
    (DDP around it, or sharded by ``fully_shard``), else None."""
    inner = getattr(model, "module", None)
    if isinstance(inner, ChunkStep):
        return model, inner
    if isinstance(model, ChunkStep):
        return model, model
    return None
