"""One prefill of a sample's first chunk, shared by every policy that would compute it alike.

Every cell of a sample feeds the same first chunk (the context, or context and question) into
a fresh cache. Where a policy's layers attend that chunk exactly as the dense cache does (the
fused causal kernel over the chunk alone: dense, snapkv, tova, h2o, knorm, keydiff,
expected_attention in full precision), the model computes the same hidden states for it, so
the same queries, keys and values reach every layer. ``record`` runs the chunk once, through a
dense cache, and keeps what reached each layer and what came back. ``replay`` then makes, into
a policy's fresh cache, the very calls the model would make: ``layer.attend(q, k, v, step)``
with the step that cache describes itself, layer after layer, checking each layer's output
against the recorded one bit for bit. Equal outputs mean equal inputs to the next layer, so by
induction the cache ends exactly as the model's own prefill would leave it, and the logits of
the chunk's last token are the recorded ones. A policy that attends otherwise (a sliding window,
attention sinks, a quantized storage's codes) fails the check at its first layer; its cell then
prefills on its own.

The check runs once per cache configuration (policy, storage, ratio) and ``SharedPrefill``,
which a sweep keeps for all its tasks: the attention path is chosen by the configuration, not by
the chunk's contents (a prompt alone in an empty cache takes the fused kernel for its outputs in
every evicting cache, whatever its length). Later replays of that configuration hand each layer
the chunk through ``absorb``, which an evicting cache takes without computing the attention
outputs, only what it scores the chunk by (snapkv: its window's weights; h2o: every query's;
knorm, keydiff, expected_attention: keys and queries), so that a replay costs a small part of a
prefill; ``tests/eval/test_shared.py`` checks that both replays leave the cache as the policy's
own prefill does.

A policy that scores a context by reconstructing it (kvzip) shares otherwise: its scores do
not depend on its budget, so one reconstruction pass a sample (``kvcache.generation.reconstruction.score``, into a
cache that keeps every token) fills the caches of all its ratios (``kvcache.generation.reconstruction.take``: what
each one's own pass would keep, bit for bit).
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass

import torch

from ..cache.base import KVCache, LayerCache, Step
from ..cache.registry import make_cache
from ..generation import reconstruction as kvzip


@dataclass(frozen=True)
class Call:
    """What one layer's cache received and returned for the chunk: q (1, Hq, T, D) rotated
    queries, k and v (1, Hkv, T, D), out (1, Hq, T, D) the attention output."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor


@dataclass(frozen=True)
class Recorded:
    """A first chunk as the model ran it: ids (T ints), one ``Call`` per layer, and the logits
    (1, vocab) of its last token."""

    ids: tuple[int, ...]
    calls: tuple[Call, ...]
    logits: torch.Tensor


class _Recording:
    """Stands in for a layer of a cache during one call: passes everything on to ``layer`` and
    keeps the ``attend`` call's tensors."""

    def __init__(self, layer: LayerCache) -> None:
        self.layer = layer
        self.call: Call | None = None

    def check(self, step: Step) -> None:
        self.layer.check(step)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: Step) -> torch.Tensor:
        out = self.layer.attend(q, k, v, step)
        self.call = Call(q, k, v, out)
        return out


@torch.inference_mode()
def record(model, ids: list[int]) -> Recorded:
    """Run ``ids`` (one row) as the first chunk of a dense cache and keep every layer's call."""
    if not ids:
        raise ValueError("the first chunk to record is empty")
    cache = make_cache(model, "dense", cache_length=len(ids))
    cache.allocate()  # every slot now, not during the call, when the recordings stand in for the layers
    layers = cache.layers
    recording = [_Recording(layer) for layer in layers]
    cache.layers = recording
    try:
        device = model.embed_tokens.weight.device
        logits = model(torch.tensor([ids], device=device), cache, last_only=True)[:, 0]
    finally:
        cache.layers = layers
    return Recorded(tuple(ids), tuple(r.call for r in recording), logits)


@torch.inference_mode()
def replay(model, cache: KVCache, recorded: Recorded, check: bool = True) -> bool:
    """Make the recorded chunk's calls into the fresh ``cache`` (see module docstring). True if
    every layer returned the recorded output, the cache then holding what the model's own
    prefill of the chunk leaves; False at the first layer that differs, the cache then half
    filled (make a new one). ``check=False``: for a configuration already checked, each layer
    takes the chunk through ``absorb``, which need not compute the outputs (an evicting cache
    then computes only what it scores the chunk by); always True."""
    if int(cache.lengths.max()) != 0:
        raise ValueError("replay fills a fresh cache: this one has seen tokens (reset it first)")
    if cache.batch_size != 1:
        raise ValueError(f"a recorded chunk is one row; the cache has {cache.batch_size}")
    device = model.embed_tokens.weight.device
    step = cache.begin(torch.tensor([recorded.ids], device=device), None, model)
    for layer, call in zip(cache.layers, recorded.calls, strict=True):
        if not check:
            layer.absorb(call.q, call.k, call.v, step)
        elif not torch.equal(layer.attend(call.q, call.k, call.v, step), call.out):
            return False
    cache.commit(step)
    return True


class SharedPrefill:
    """The first chunks of a sweep's samples, each prefilled once for every policy that
    computes it alike (module docstring). Holds the latest recording only: run the cells of a
    sample one after another.

    ``prefill`` fills a fresh cache with a chunk; ``key`` names the cache's configuration (the
    policy, storage and ratio), and one that failed a replay is prefilled on its own from then
    on; one that passed is replayed without the check (and without computing the outputs)
    from then on. ``seconds``: time spent recording; ``replays``: caches filled by a replay.
    One serves one model, the first it is given (``check_model``): its recordings and verdicts
    hold for that model only.
    """

    def __init__(self) -> None:
        self._model: weakref.ref | None = None
        self._recorded: Recorded | None = None
        # The latest reconstruction pass: ((policy, ids, repeat), the scored cache, its logits).
        self._scored: tuple | None = None
        self.unshared: set[str] = set()
        self.checked: set[str] = set()
        self.seconds = 0.0
        self.replays = 0

    def check_model(self, model) -> None:
        """Bind to ``model`` on first use; ValueError for any other model (a recording of the same
        ids, or a verdict, made with another model would fill its caches wrongly)."""
        if self._model is None:
            self._model = weakref.ref(model)
        elif self._model() is not model:
            raise ValueError("this SharedPrefill serves another model: its recordings and checked "
                             "configurations hold for that model only; make one for each model")

    def recorded(self, model, ids: list[int]) -> Recorded:
        self.check_model(model)
        if self._recorded is None or self._recorded.ids != tuple(ids):
            self._recorded = None  # let the old one go before the new one is made
            start = time.perf_counter()
            self._recorded = record(model, ids)
            self.seconds += time.perf_counter() - start
        return self._recorded

    @torch.inference_mode()
    def reconstructed(self, model, cache: KVCache, ids: list[int], policy: str,
                      repeat: list[int]) -> tuple[KVCache, torch.Tensor]:
        """(cache, logits): the fresh cache of a policy that reconstructs (kvzip) at any budget,
        filled as its own pass over ``ids`` would fill it, from one pass per chunk and
        ``policy`` (``kvcache.generation.reconstruction.score``, then ``take``: the scores do not depend on the
        budget); logits (1, vocab) of the chunk's last token. A quantized storage's cache makes
        its own pass."""
        if cache.layers[0].storage.packed:
            return cache, kvzip.prefill(model, cache, [ids], repeat=repeat, chunk=None)
        self.check_model(model)
        key = (policy, tuple(ids), tuple(repeat))
        if self._scored is None or self._scored[0] != key:
            self._scored = None  # let the old one go before the new one is made
            start = time.perf_counter()
            scored = make_cache(model, policy, cache_length=len(ids))
            self._scored = (key, scored, kvzip.score(model, scored, [ids], repeat=repeat))
            self.seconds += time.perf_counter() - start
        _, scored, logits = self._scored
        kvzip.take(cache, scored)
        self.replays += 1
        return cache, logits

    @torch.inference_mode()
    def prefill(self, model, cache: KVCache, ids: list[int], key: str, fresh) -> tuple[KVCache, torch.Tensor]:
        """(cache, logits): ``cache`` filled by a replay, or if ``key``'s configuration does not
        share the prefill, a new cache from ``fresh()`` filled by the model; logits (1, vocab)
        of the chunk's last token."""
        if key not in self.unshared:
            recorded = self.recorded(model, ids)
            if replay(model, cache, recorded, check=key not in self.checked):
                self.checked.add(key)
                self.replays += 1
                return cache, recorded.logits
            self.unshared.add(key)
            cache = fresh()
        device = model.embed_tokens.weight.device
        return cache, model(torch.tensor([ids], device=device), cache, last_only=True)[:, 0]
