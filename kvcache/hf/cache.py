"""A transformers ``Cache`` whose layers are kvcache layer caches.

How a forward of a transformers model reaches a kvcache layer cache: each attention module
rotates its queries and keys, calls the cache's ``update(key, value, layer_idx, ...)`` and then
the registered attention function (attention.py) with the query, the key and value that
``update`` returned, and the module. ``HFCache.update`` stores nothing: it returns the new
keys and values unchanged and leaves a note of the call (this cache, the layer, the key tensor)
for the attention function, which hands query, key and value to ``HFCache.attend``; there the
layer cache stores them and computes attention, as kvcache's own model does.

A forward is one kvcache chunk. Layer 0's ``attend`` turns the chunk's shape and transformers'
2D padding mask into a ``Step`` (``KVCache.begin``, which validates before any layer writes);
the last layer's ``attend`` commits it. Layers must come in order, one call each per forward.

Sizes, as transformers asks for them:
    get_seq_length()   columns fed so far (padding included, as transformers counts them and
                       ``generate`` slices its inputs by); ``lengths`` has each row's real tokens.
    get_mask_sizes(T)  at most min(seen, cache_length) held slots plus the T new keys; kvcache
                       builds no mask from them (its attention derives visibility from positions).
    get_max_length()   the most tokens a layer takes: its capacity for dense, -1 (no limit) for
                       a policy that evicts.
Rows cannot be reordered, repeated, selected or cropped (beam search, contrastive search,
assisted decoding): each layer cache keeps per-row slots and eviction state that have no such
operation, so those raise NotImplementedError.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass

import torch
from transformers import Cache

from ..cache import KVCache, Step
from . import padding
from .compat import CACHE_ARG
from .layer import HFLayer
from .positions import check_positions


@dataclass(frozen=True)
class _Pending:
    """An ``update`` whose attention call has not come yet."""

    cache: HFCache
    layer_idx: int
    key: torch.Tensor


# The last ``update`` not yet followed by its attention call. Attention modules call the
# attention function right after ``update`` and pass it nothing else that leads to the cache, so
# the note is how the function finds it; a context variable keeps threads apart.
_PENDING: ContextVar[_Pending | None] = ContextVar("kvcache_hf_pending", default=None)

NO_CACHE = (
    "attn_implementation='kvcache' computes attention in a kvcache cache, but this call has none: pass "
    f"{CACHE_ARG}=kvcache.hf.make_cache(model, ...) to the model or to generate, or switch the model back "
    "with model.set_attn_implementation('sdpa')"
)


def take_pending(layer_idx: int, key: torch.Tensor) -> HFCache:
    """The cache whose ``update`` this attention call follows (layer ``layer_idx``, ``key`` the
    tensor ``update`` returned); raises if there is none or it was for another call."""
    pending = _PENDING.get()
    _PENDING.set(None)
    if pending is None:
        raise RuntimeError(NO_CACHE)
    if pending.layer_idx != layer_idx or pending.key is not key:
        raise RuntimeError(
            f"the attention call of layer {layer_idx} does not follow its cache update (the last update was for "
            f"layer {pending.layer_idx}{'' if pending.key is key else ', with other keys'}): this model changes "
            "keys between the cache and the attention function, which kvcache.hf does not support"
        )
    return pending.cache


@dataclass(frozen=True)
class _Chunk:
    """The forward in flight: its kvcache Step and where its padding is."""

    step: Step
    layout: padding.Layout


class HFCache(Cache):
    """A transformers ``Cache`` over a ``kvcache.KVCache`` (``self.kv``), one ``HFLayer`` per
    decoder layer. Made by ``kvcache.hf.make_cache``; see the module docstring."""

    def __init__(self, kv: KVCache) -> None:
        super().__init__(layers=[HFLayer(self, i, layer) for i, layer in enumerate(kv.layers)])
        self.kv = kv
        # Columns fed so far, padding included (transformers' sequence length).
        self.columns = 0
        self._chunk: _Chunk | None = None
        # The layer whose update comes next.
        self._next = 0

    # ----- what transformers asks ---------------------------------------------------------------

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: object, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the new keys and values unchanged and note the call for the attention function.

        key_states, value_states: (B, Hkv, T, D), rotated keys and values of the chunk's tokens.
        The rest is the base class's open signature: what a release passes there (rotary
        tensors, cache positions, the attention keywords; see compat.py) is not needed, since
        positions are kvcache's own and the attention function receives the keywords."""
        stale = _PENDING.get()
        if stale is not None and stale.cache is self:
            raise RuntimeError(
                f"layer {stale.layer_idx} updated the cache but its attention did not reach kvcache's attention "
                "function: the model is not set to attn_implementation='kvcache' (kvcache.hf.make_cache sets it), "
                "or computes attention outside transformers' AttentionInterface, which kvcache.hf does not support. "
                "The cache may hold part of a chunk: call reset() before using it again"
            )
        if layer_idx != self._next:
            raise RuntimeError(
                f"layer {layer_idx} called the cache when layer {self._next} was due"
                + (f": the previous call stopped after layer {self._next - 1}, so the cache holds part of a chunk. "
                   "Call reset() before using it again" if self._chunk is not None else
                   "; kvcache.hf takes every layer once per forward, in order")
            )
        _PENDING.set(_Pending(self, layer_idx, key_states))
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.columns

    def get_mask_sizes(self, query: int | torch.Tensor, layer_idx: int) -> tuple[int, int]:
        return self.layers[layer_idx].get_mask_sizes(query)

    def get_max_length(self, layer_idx: int | None = None) -> int:
        if layer_idx is not None:
            return self.layers[layer_idx].get_max_length()
        lengths = [layer.get_max_length() for layer in self.layers]
        return -1 if -1 in lengths else min(lengths)

    # The name transformers 5.0 asks by.
    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].get_max_length()

    @property
    def is_compileable(self) -> bool:
        # Host-side decisions (lengths, held slots) drive every call.
        return False

    @property
    def is_croppable(self) -> bool:
        return False

    @property
    def batch_size(self) -> int:
        return self.kv.batch_size

    # The names transformers 5.0 asks by.
    @property
    def max_batch_size(self) -> int:
        return self.kv.batch_size

    @property
    def max_cache_len(self) -> int:
        return self.kv.cache_length

    def reset(self) -> None:
        """Forget every token (a forward stopped half-way included)."""
        self.kv.reset()
        self.columns = 0
        self._chunk = None
        self._next = 0
        pending = _PENDING.get()
        if pending is not None and pending.cache is self:
            _PENDING.set(None)

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        raise NotImplementedError(
            "a kvcache cache cannot reorder its rows (each layer keeps per-row slots and eviction state), so beam "
            "search is not supported: generate with num_beams=1 (greedy or sampling)"
        )

    def crop(self, tokens: int) -> None:
        if tokens == 0:
            return
        raise NotImplementedError(
            "a kvcache cache cannot drop its newest tokens (an evicting policy does not keep tokens in order), so "
            "assisted and speculative decoding are not supported"
        )

    def batch_repeat_interleave(self, repeats: int) -> None:
        if repeats == 1:
            return
        raise NotImplementedError(
            "a kvcache cache cannot repeat its rows: make it with batch_size = prompts x num_return_sequences"
        )

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("a kvcache cache cannot select rows (contrastive search is not supported)")

    # ----- kvcache's side -------------------------------------------------------------------------

    @property
    def lengths(self) -> torch.Tensor:
        """(B,) long, CPU: real tokens each row has seen (its next token's position)."""
        return self.kv.lengths

    @property
    def policy(self) -> str:
        return self.kv.policy

    def nbytes(self) -> int:
        """Bytes of every layer's buffers (keys, values, positions, statistics)."""
        return self.kv.nbytes()

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None) -> torch.Tensor:
        """Store layer ``layer_idx``'s keys and values for the chunk and attend.

        q: (B, Hq, T, D) queries rotated at their positions, scaled so that 1/sqrt(D) is their
        scale; k, v: (B, Hkv, T, D); attention_mask: transformers' 2D padding mask (B, >= T)
        or None; position_ids: (B or 1, T) as transformers rotated the chunk, or None.
        Returns (B, Hq, T, D), zero at padding.
        """
        if layer_idx == 0:
            self._chunk = self._begin(q, k, attention_mask, position_ids)
        chunk = self._chunk
        layout = chunk.layout
        if layout.front is not None:
            q, k, v = (padding.move(x, layout.front) for x in (q, k, v))
        out = self.kv.layers[layer_idx].attend(q, k, v, chunk.step)
        if layout.back is not None:
            out = padding.move(out, layout.back)
        if layout.pad is not None:
            # transformers reads no output at padding, but the next layer computes keys from it.
            out = out.masked_fill(layout.pad[:, None, :, None], 0)
        self._next = layer_idx + 1
        if self._next == len(self.kv.layers):
            self.kv.commit(chunk.step)
            self.columns += chunk.step.num_tokens
            self._chunk = None
            self._next = 0
        return out

    def _begin(self, q: torch.Tensor, k: torch.Tensor, attention_mask: torch.Tensor | None,
               position_ids: torch.Tensor | None) -> _Chunk:
        """Validate the chunk and describe it for every layer; nothing is changed here."""
        B, T = q.shape[0], q.shape[2]
        spec = self.kv.spec
        if B != spec.batch_size:
            raise ValueError(
                f"the model was called with {B} rows but this cache was made for batch_size={spec.batch_size}: "
                f"make it with kvcache.hf.make_cache(model, ..., batch_size={B})"
            )
        got = (k.shape[1], k.shape[3], k.dtype, k.device)
        want = (spec.num_kv_heads, spec.head_dim, spec.dtype, spec.device)
        if got != want:
            raise ValueError(
                f"this cache was made for keys of {want[0]} heads x {want[1]} on {want[3]} in {want[2]}, but the model "
                f"gives {got[0]} heads x {got[1]} on {got[3]} in {got[2]}: make the cache for this model, after any "
                "change of its dtype or device"
            )
        layout = padding.layout(attention_mask, B, T)
        # begin reads the chunk's shape and device, never its token ids.
        step = self.kv.begin(torch.empty((B, T), dtype=torch.long, device=q.device), layout.n_tokens)
        if position_ids is not None:
            check_positions(step, layout, position_ids)
        return _Chunk(step, layout)

    def __repr__(self) -> str:
        return f"HFCache(columns={self.columns}, {self.kv!r})"
