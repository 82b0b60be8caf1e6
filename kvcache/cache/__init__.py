"""The KV cache: contract, storages, policies and their registry."""

from .base import CacheSpec, KVCache, LayerCache, Step
from .registry import make_cache, policies, register

__all__ = ["CacheSpec", "KVCache", "LayerCache", "Step", "make_cache", "policies", "register"]
