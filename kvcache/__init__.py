"""kvcache: KV caching for decoder-only language models, exact where it claims to be."""

from .cache import KVCache, LayerCache, adaptive_head_budgets, make_cache, option_info, policies, policy_options, storages
from .checkpoint import Tokenizer, load, load_tokenizer
from .config import ModelConfig, RopeConfig
from .errors import CapacityError, CheckpointError, KVCacheError
from .generate import generate
from .model import Transformer

__version__ = "0.1.0"

__all__ = [
    "CapacityError",
    "CheckpointError",
    "KVCache",
    "KVCacheError",
    "LayerCache",
    "ModelConfig",
    "RopeConfig",
    "Tokenizer",
    "Transformer",
    "adaptive_head_budgets",
    "generate",
    "load",
    "load_tokenizer",
    "make_cache",
    "option_info",
    "policies",
    "policy_options",
    "storages",
]
