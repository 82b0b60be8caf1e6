"""kvcache: KV caching for decoder-only language models, exact where it claims to be.

Quick start::

    import kvcache

    model = kvcache.load()                      # the bundled reference model; or a checkpoint directory
    tok = kvcache.load_tokenizer()
    ids = tok.encode("It is a truth universally acknowledged")
    new = kvcache.generate(model, ids, max_new_tokens=32, policy="h2o", cache_length=256)
    print(tok.decode(new))

    cache = kvcache.make_cache(model, "sink", cache_length=512, sinks=4)   # an explicit cache
    logits = model(torch.tensor([ids]), cache)                           # (1, T, vocab)

``kvcache.policies()`` lists the cache policies, ``kvcache.option_info(name)`` their options,
``kvcache.storages()`` the storages (``"h2o:int4"``). The command line is ``kvcache --help``;
docs/ARCHITECTURE.md explains the design. ``kvcache.chunked_loss(model, ids, policy=...,
cache_length=..., chunk=...)`` is the loss of a long sequence fed through a bounded cache, with
exact gradients, for fine-tuning (docs/finetune.md).
"""

from .cache import KVCache, LayerCache, adaptive_head_budgets, make_cache, option_info, policies, policy_options, storages
from .checkpoints.load import Tokenizer, load, load_tokenizer
from .errors import CapacityError, CheckpointError, GenerationError, KVCacheError, KVCacheWarning, MemoryBudgetError
from .generation.generate import generate
from .model.config import ModelConfig, RopeConfig
from .model.transformer import Transformer
from .prefix.store import PrefixStore, PrefixStoreError
from .train.chunked import chunked_loss

__version__ = "0.1.0"

__all__ = [
    "CapacityError",
    "CheckpointError",
    "GenerationError",
    "KVCache",
    "KVCacheError",
    "KVCacheWarning",
    "LayerCache",
    "MemoryBudgetError",
    "ModelConfig",
    "PrefixStore",
    "PrefixStoreError",
    "RopeConfig",
    "Tokenizer",
    "Transformer",
    "adaptive_head_budgets",
    "chunked_loss",
    "generate",
    "load",
    "load_tokenizer",
    "make_cache",
    "option_info",
    "policies",
    "policy_options",
    "storages",
]
