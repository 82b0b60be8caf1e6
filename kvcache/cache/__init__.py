"""The KV cache: contract, storages, policies and their registry."""

from .base import CacheSpec, KVCache, LayerCache, Step
from .registry import layer_budgets, make_cache, policies, policy_options, register

__all__ = ["CacheSpec", "KVCache", "LayerCache", "Step", "layer_budgets", "make_cache", "policies", "policy_options", "register"]
