"""``HFLayer``: one entry of ``HFCache.layers``, a kvcache layer cache as transformers'
per-layer cache interface (``CacheLayerMixin``) sees it.

transformers reads sizes from a cache's layers and iterates over them (``is_sliding``,
``is_initialized``, resets); every operation here concerns the whole cache and goes to it, since
a kvcache forward is one chunk across all layers (see cache.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from transformers.cache_utils import CacheLayerMixin

from ..cache import LayerCache
from .compat import query_length

if TYPE_CHECKING:
    from .cache import HFCache


class HFLayer(CacheLayerMixin):
    """Layer ``index`` of ``cache``, whose kvcache layer cache is ``layer``."""

    is_compileable = False
    is_croppable = False

    def __init__(self, cache: HFCache, index: int, layer: LayerCache) -> None:
        super().__init__()
        self.cache = cache
        self.index = index
        self.layer = layer
        self.is_sliding = layer.spec.sliding_window is not None
        # The buffers are allocated with the cache: there is nothing to initialise lazily.
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor,
               *args: object, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cache.update(key_states, value_states, self.index, *args, **kwargs)

    def get_seq_length(self) -> int:
        return self.cache.get_seq_length()

    def get_mask_sizes(self, query: int | torch.Tensor) -> tuple[int, int]:
        """(keys an attention call reads at most, tokens no longer held before them).

        query: the chunk's length T, or its cache positions (T,) (see compat.py)."""
        T = query_length(query)
        seen = self.cache.get_seq_length()
        held = min(seen, self.layer.spec.cache_length)
        return held + T, seen - held

    def get_max_length(self) -> int:
        return -1 if self.layer.evicts else self.layer.spec.cache_length

    # The name transformers 5.0 asks by.
    get_max_cache_shape = get_max_length

    def offload(self) -> None:
        pass

    def prefetch(self) -> None:
        pass

    def reset(self) -> None:
        self.cache.reset()

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        self.cache.reorder_cache(beam_idx)

    def crop(self, tokens: int) -> None:
        self.cache.crop(tokens)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.cache.batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.cache.batch_select_indices(indices)
