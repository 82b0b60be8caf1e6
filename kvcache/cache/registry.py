"""Policy names -> layer cache classes, and ``make_cache``."""

from __future__ import annotations

import torch

from .base import CacheSpec, KVCache, LayerCache
from .policies.dense import DenseCache

_POLICIES: dict[str, type[LayerCache]] = {}


def register(cls: type[LayerCache]) -> type[LayerCache]:
    """Register a layer cache class under its ``name`` (usable as a class decorator)."""
    if cls.name in _POLICIES:
        raise ValueError(f"a policy named {cls.name!r} is already registered")
    _POLICIES[cls.name] = cls
    return cls


register(DenseCache)


def policies() -> dict[str, str]:
    """Registered policy names with a one-line description each."""
    return {name: cls.description for name, cls in sorted(_POLICIES.items())}


def make_cache(
    model: torch.nn.Module,
    policy: str = "dense",
    *,
    cache_length: int,
    batch_size: int = 1,
) -> KVCache:
    """A cache for ``model`` holding up to ``cache_length`` tokens per row for ``batch_size`` rows.

    Buffers are allocated here, once, in the model's dtype and on its device.
    """
    if policy not in _POLICIES:
        raise ValueError(f"unknown policy {policy!r}; available: {', '.join(sorted(_POLICIES))}")
    cfg = model.config
    weight = model.embed_tokens.weight
    spec = CacheSpec(
        batch_size=batch_size,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        cache_length=cache_length,
        dtype=weight.dtype,
        device=weight.device,
        window=cfg.sliding_window,
    )
    cls = _POLICIES[policy]
    return KVCache([cls(spec) for _ in range(cfg.num_layers)], spec, policy)
