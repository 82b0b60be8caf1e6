"""The KV cache: contract, storages, policies and their registry."""

from .base import CacheSpec, KVCache, LayerCache, Step
from .headwise import HeadwiseCache, adaptive_head_budgets
from .registry import layer_budgets, make_cache, policies, policy_options, register, storages

__all__ = ["HeadwiseCache", "adaptive_head_budgets", "CacheSpec", "KVCache", "LayerCache", "Step", "layer_budgets", "make_cache", "policies", "policy_options", "register", "storages"]
