"""The KV cache: contract, storages, policies and their registry."""

from .base import CacheSpec, KVCache, LayerCache, Step
from .budgets import adaptive_head_budgets, layer_budgets
from .candidates import Candidates
from .headwise import HeadwiseCache
from .options import OptionInfo, option
from .policies import register
from .registry import budget_options, make_cache, option_info, policies, policy_options, storages
from .rows import Rows

__all__ = [
    "Candidates", "CacheSpec", "HeadwiseCache", "KVCache", "LayerCache", "OptionInfo", "Rows", "Step",
    "adaptive_head_budgets", "budget_options", "layer_budgets", "make_cache", "option", "option_info",
    "policies", "policy_options", "register", "storages",
]
