"""KVzip's reconstruction pass: compress a context before any question is seen.

A ``kvzip`` cache (cache/policies/kvzip.py) scores a context by how much the model attends each
of its keys while repeating it. ``prefill`` feeds the context chunk by chunk; a chunk that would
overflow the cache is fed together with its reconstruction, ``chunk + repeat prompt + chunk``, in
one call with the layers recording: the context part is attended and stored as any prefill
would, the reconstruction part is scored and dropped, and every layer keeps its best-scored
keys. A chunk that fits is fed as it is (nothing to evict, nothing to score: a cache whose
budget covers the sequence is the dense cache). ``generate`` is ``prefill`` followed by the
question and greedy decoding.

    from kvcache.generation import reconstruction

    cache = kvcache.make_cache(model, "kvzip", cache_length=kept + reserve, reserve=reserve)
    tokens = reconstruction.generate(model, cache, context_ids, question_ids,
                                     repeat=reconstruction.repeat_ids(tokenizer), max_new_tokens=32)

Later chunks of a long context are reconstructed after the last ``overlap`` tokens of the chunk
before (KVzip's cue of where to start). Rows of a batch must have contexts of equal length.

The scores do not depend on the budget, so one pass can serve caches of several: ``score``
runs it into a cache with room for the whole context (every token kept, with its score), and
``take`` fills a cache of any budget with what its own pass over the whole context
(``prefill(..., chunk=None)``) would keep, bit for bit:

    scored = kvcache.make_cache(model, "kvzip", cache_length=len(context_ids))
    logits = reconstruction.score(model, scored, context_ids, repeat=reconstruction.repeat_ids(tokenizer))
    for kept in (512, 1024, 2048):
        cache = kvcache.make_cache(model, "kvzip", cache_length=kept + 64, reserve=64)
        reconstruction.take(cache, scored)           # then feed the question, decode
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..cache.base import KVCache
from ..cache.policies.kvzip import KVzipCache
from ..cache.registry import sliding_layers
from .generate import decode_loop, greedy

REPEAT_PROMPT = "\n\nRepeat the previous context exactly."


def repeat_ids(tokenizer, closing: str = "\n") -> list[int]:
    """The reconstruction prompt's ids: KVzip's instruction, then ``closing`` (the chat template's
    text after a user message, with ``--chat``; a newline otherwise), each tokenized on its own
    as kvpress's KVzipPress does."""
    return tokenizer.encode(REPEAT_PROMPT, add_special_tokens=False) + tokenizer.encode(closing, add_special_tokens=False)


def _rows(ids: object, what: str, device: torch.device) -> torch.Tensor:
    t = torch.as_tensor(ids, device=device)
    if t.dim() == 1:
        t = t.unsqueeze(0)
    if t.dim() != 2 or t.dtype not in (torch.long, torch.int32, torch.int64) or t.shape[1] == 0:
        raise ValueError(f"{what} must be token ids: a non-empty list of ints or a (rows, tokens) integer tensor")
    return t.long()


def _scored(cache: KVCache) -> list[KVzipCache]:
    """The layers the pass scores: every one but the rings of a model's sliding layers, which
    hold their window through it (``holds_window``)."""
    return [layer for i, layer in enumerate(cache.layers) if i not in sliding_layers(cache)]


def _check_cache(cache: KVCache, rows: int) -> None:
    rings = sliding_layers(cache)
    bad = [i for i, layer in enumerate(cache.layers) if not isinstance(layer, KVzipCache) and i not in rings]
    if bad:
        raise ValueError(f"kvzip's reconstruction pass needs a kvzip cache in every layer (layer {bad[0]} is "
                         f"{type(cache.layers[bad[0]]).__name__}): kvcache.make_cache(model, 'kvzip', ...) "
                         "without head_budgets")
    if cache.batch_size != rows:
        raise ValueError(f"the cache was made for batch_size={cache.batch_size}, but there are {rows} rows")


@torch.inference_mode()
def prefill(model, cache: KVCache, context: object, *, repeat: Sequence[int], chunk: int | None = 2048,
            overlap: int = 8) -> torch.Tensor:
    """Feed ``context`` (ids, (rows, n)) into ``cache`` after what it holds, compressing every
    chunk that would overflow it by reconstruction. Returns the logits (rows, vocab) after the
    context's last token. ``chunk``: context tokens per pass (None: one pass)."""
    device = model.embed_tokens.weight.device
    ids = _rows(context, "context", device)
    rep = _rows(repeat, "repeat", device)[0]
    B, n = ids.shape
    _check_cache(cache, B)
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk <= 0):
        raise ValueError(f"chunk must be a positive int or None, got {chunk!r}")
    if isinstance(overlap, bool) or not isinstance(overlap, int) or overlap < 0:
        raise ValueError(f"overlap must be a non-negative int, got {overlap!r}")
    step = n if chunk is None else chunk
    logits = None
    for a in range(0, n, step):
        part = ids[:, a : a + step]
        m = part.shape[1]
        if all(int(layer.held.max()) + m <= layer.spec.cache_length for layer in _scored(cache)):
            logits = model(part, cache, last_only=True)[:, 0]
            continue
        logits = _reconstruct(model, cache, part, rep, ids[:, max(0, a - overlap) : a])
    return logits


def _reconstruct(model, cache: KVCache, part: torch.Tensor, rep: torch.Tensor, cue: torch.Tensor) -> torch.Tensor:
    """One pass: ``part`` (B, m), then the repeat prompt ``rep`` (r,), the ``cue`` (B, c) and
    ``part`` again, in one call whose layers score ``part`` by its reconstruction and keep the
    best. Returns the logits (B, vocab) after ``part``'s last token."""
    B, m = part.shape
    call = torch.cat((part, rep.expand(B, -1), cue, part), 1)
    model.check_token_ids(call)  # as forward checks them: model.run below does not
    for layer in cache.layers:
        layer.record(m)
    try:
        step = cache.begin(call, None, model)
        last = torch.full((B,), m - 1, device=part.device)
        logits = model.run(call, step.positions, cache, step, last)[:, 0]
    finally:
        for layer in cache.layers:
            layer.record(None)
    # Only the context counts as seen: the reconstruction was scored and dropped.
    cache.lengths += m
    return logits


@torch.inference_mode()
def score(model, cache: KVCache, context: object, *, repeat: Sequence[int]) -> torch.Tensor:
    """One reconstruction pass over the whole ``context`` (ids, (rows, n)) into ``cache``, an
    empty kvzip cache with room for all n tokens, which keeps every one with its score (in a
    full-precision storage: ``take`` moves the kept tokens as tensors). Returns the logits
    (rows, vocab) after the context's last token: those of ``prefill`` with ``chunk=None``."""
    device = model.embed_tokens.weight.device
    ids = _rows(context, "context", device)
    rep = _rows(repeat, "repeat", device)[0]
    _check_cache(cache, ids.shape[0])
    if int(cache.lengths.max()) != 0:
        raise ValueError("score fills an empty cache: this one has seen tokens (reset it first)")
    if cache.cache_length < ids.shape[1]:
        raise ValueError(f"score keeps the whole context ({ids.shape[1]} tokens): the cache holds "
                         f"{cache.cache_length}; make it with cache_length={ids.shape[1]}")
    if cache.layers[0].storage.packed:
        raise ValueError("score needs a full-precision storage (a quantized one keeps codes whose layout "
                         "take cannot move); run prefill into each quantized cache instead")
    return _reconstruct(model, cache, ids, rep, ids[:, :0])


@torch.inference_mode()
def take(cache: KVCache, scored: KVCache) -> None:
    """Reset ``cache`` (kvzip, full precision) and fill it with what its own ``prefill`` of the
    context (``chunk=None``) would keep: the best-scored tokens that ``scored`` holds after
    ``score``, ranked under ``cache``'s own budget and options. ``scored`` is not changed."""
    _check_cache(scored, scored.batch_size)
    _check_cache(cache, scored.batch_size)
    n = scored.lengths
    if int(n.min()) == 0 or not torch.equal(n, n[:1].expand_as(n)):
        raise ValueError("take reads a cache filled by score (rows of one context length); this one "
                         f"has seen {n.tolist()} tokens")
    if len(cache.layers) != len(scored.layers):
        raise ValueError(f"the caches have {len(cache.layers)} and {len(scored.layers)} layers: not the same model")
    for i, (a, b) in enumerate(zip(cache.layers, scored.layers)):
        mine, theirs = a.spec, b.spec
        if (mine.num_kv_heads, mine.head_dim, mine.dtype, mine.device) != \
                (theirs.num_kv_heads, theirs.head_dim, theirs.dtype, theirs.device):
            raise ValueError(f"layer {i}: the caches differ in K/V heads, head size, dtype or device "
                             f"({mine.num_kv_heads}, {mine.head_dim}, {mine.dtype}, {mine.device} against "
                             f"{theirs.num_kv_heads}, {theirs.head_dim}, {theirs.dtype}, {theirs.device}): "
                             "not made for the same model")
    if cache.cache_length >= int(n[0]):
        raise ValueError(f"the cache holds {cache.cache_length} tokens, the whole context ({int(n[0])}): with "
                         "nothing to evict its own prefill scores nothing; prefill it directly")
    if cache.layers[0].storage.packed or scored.layers[0].storage.packed:
        raise ValueError("take moves tokens as tensors: both caches need a full-precision storage "
                         "(run prefill into a quantized cache instead)")
    cache.reset()
    device = cache.spec.device
    step = cache.begin(torch.zeros(scored.batch_size, int(n[0]), dtype=torch.long, device=device), None)
    rings = sliding_layers(cache)
    for i, (layer, source) in enumerate(zip(cache.layers, scored.layers)):
        if i in rings:
            # A sliding layer's ring holds the context's last window, whatever the budget.
            layer.load_state(source.state(), torch.arange(cache.batch_size, device=device))
        else:
            layer.keep_best(source, step)
    cache.commit(step)


@torch.inference_mode()
def generate(model, cache: KVCache, context: object, rest: object = None, *, repeat: Sequence[int],
             max_new_tokens: int, chunk: int | None = 2048, stop_tokens: Sequence[int] | None = None) -> list[list[int]]:
    """Greedy generation after a context compressed by KVzip: ``cache`` is reset, ``context`` goes
    through ``prefill``, then ``rest`` (the question and answer prefix, (rows, m) ids; optional)
    in one call, then up to ``max_new_tokens`` tokens per row, a row ending at a stop token (default
    the model's eos), as ``kvcache.generate`` does greedily. Returns the new tokens per row."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    device = model.embed_tokens.weight.device
    ids = _rows(context, "context", device)
    tail = None if rest is None else _rows(rest, "rest", device)
    if tail is not None and tail.shape[0] != ids.shape[0]:
        raise ValueError(f"rest has {tail.shape[0]} rows but context has {ids.shape[0]}")
    _check_cache(cache, ids.shape[0])
    stops = set(model.config.stop_ids() if stop_tokens is None else stop_tokens)
    cache.reset()
    logits = prefill(model, cache, ids, repeat=repeat, chunk=chunk)
    if tail is not None:
        logits = model(tail, cache, last_only=True)[:, 0]
    return decode_loop([[] for _ in range(ids.shape[0])], logits, lambda tokens: model.decode(tokens, cache),
                       max_new_tokens, greedy, lambda b, tokens: tokens[-1] in stops)
