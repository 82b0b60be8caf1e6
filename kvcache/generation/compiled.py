"""A captured decode step: one token per row through a model and its cache, compiled once.

The captured step is ``torch.compile`` of the eager decode step itself: every layer cache runs
its one ``decode`` method (cache/base.py). What differs is only what the step knows. An eager
step carries host facts (each row's length) that narrow the slots attended; the captured step
is described by device tensors alone (``Step.captured_decode``), so every layer attends all of
its slots under a mask from positions and the shapes never change. The host bookkeeping (each
row's length, held slots) runs outside the graph (``KVCache.advance_decode``), as ``commit``
runs it after an eager step. One capture then serves every step of every generation with the
same cache: ``torch.compile(fullgraph=True)``, and on CUDA its CUDA-graph mode
("reduce-overhead").

What a CUDA graph needs: every tensor the step reads or writes that lives across steps (the
cache's keys, values, positions, scores, counts and lengths) is a static address
(``torch._dynamo.mark_static_address``), as the model's parameters and buffers are; the step's
only other input is the tokens. Positions come from the cache's ``device_lengths``, which the
step advances inside its graph: no host-to-device copy and no host wait per step.

Prefill stays eager. Batched eviction (``reserve``) and whole blocks are not captured: their
decode steps alternate between appending and evicting, a decision made on the host. A dense
cache, which allocates its slots as it fills, has every slot allocated before the capture
(``allocate_for_capture``): a captured step's buffers keep their size and address.
"""

from __future__ import annotations

import time

import torch

from ..cache.base import KVCache, Step
from ..errors import CapacityError
from ..runtime import devices


class CompiledDecode:
    """``decode(tokens)`` -> (B, vocab) logits of the next token, for ``model`` and ``cache``.

    tokens: (B, 1) long on the model's device, one new token per row. ``backend`` and ``mode``
    go to ``torch.compile`` (default: inductor; "reduce-overhead" on CUDA, where it replays a
    CUDA graph). The cache may be reset and refilled between calls; it must stay the same object.
    """

    def __init__(self, model: torch.nn.Module, cache: KVCache, *, backend: str = "inductor",
                 mode: str | None = None) -> None:
        check_capturable(cache)
        cache.check_model(model)
        allocate_for_capture(cache)
        self.model, self.cache = model, cache
        device = model.embed_tokens.weight.device
        if mode is None and device.type == "cuda" and backend == "inductor":
            mode = "reduce-overhead"  # a mode is inductor's: another backend would get it as an argument
        self._cuda_graphs = mode == "reduce-overhead"
        # Seconds the first call took: the capture (tracing, compiling) plus one step.
        self.compile_s: float | None = None
        self._step = torch.compile(self._forward, fullgraph=True, dynamic=False, backend=backend, mode=mode)

    def _forward(self, tokens: torch.Tensor) -> torch.Tensor:
        lengths = self.cache.device_lengths
        positions = lengths[:, None].clone()
        step = Step.captured_decode(positions)
        logits = self.model.run(tokens, positions, self.cache, step)[:, -1]
        lengths.add_(1)
        return logits

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        """One step with ``tokens`` (B, 1) from anywhere: their shape, device and ids are checked
        first (the ids' check waits for the device once)."""
        cache = self.cache
        if tokens.shape != (cache.batch_size, 1):
            raise ValueError(f"tokens must have shape ({cache.batch_size}, 1), got {tuple(tokens.shape)}")
        if not devices.same(tokens.device, cache.spec.device):
            raise ValueError(f"tokens are on {tokens.device} but the cache is on {cache.spec.device}")
        self.model.check_token_ids(tokens)
        return self.step(tokens)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """One step with ``tokens`` (B, 1) sampled from this model's logits (the decode loop's):
        not checked against the vocabulary, so that nothing waits for the device."""
        cache = self.cache
        limit, longest = cache.max_tokens, int(cache.lengths.max())
        if limit is not None and longest >= limit:
            row = int(cache.lengths.argmax())
            raise CapacityError(
                f"{cache.policy} cache is full: row {row} holds {int(cache.lengths[row])} tokens and "
                f"cache_length is {limit}. Make the cache with a larger cache_length, or use an evicting policy."
            )
        self.model.warn_past_max_positions(longest + 1)
        cache.decode_positions()  # copied from the host after a prefill; between steps, nothing
        if self.compile_s is None:
            for t in held_tensors(cache):
                torch._dynamo.mark_static_address(t)
            start = time.perf_counter()
            logits = self._step(tokens)
            if logits.is_cuda:
                torch.cuda.synchronize()  # once: the capture is over when its first step is
            self.compile_s = time.perf_counter() - start
        else:
            logits = self._step(tokens)
        cache.advance_decode()
        # A CUDA graph's output lives in memory the next replay overwrites.
        return logits.clone() if self._cuda_graphs else logits


def captured_decode(model: torch.nn.Module, cache: KVCache) -> CompiledDecode:
    """The captured decode step of ``model`` over ``cache``: made on first use and kept with the
    cache (``cache.captured``), so every later generation with the same cache replays it."""
    if cache.captured is None or cache.captured.model is not model:
        cache.captured = CompiledDecode(model, cache)
    return cache.captured


def held_tensors(cache: KVCache) -> list[torch.Tensor]:
    """Every tensor ``cache`` holds from step to step: its lengths and decode constants, and each
    layer's (its storage's buffers, a policy's scores and counts, head-wise layers' heads), found
    by walking the layers' attributes, so that a policy's new tensor is found without a list to
    keep. Model tensors (parameters, buffers) are already static and not walked into."""
    found: dict[int, torch.Tensor] = {}
    seen: set[int] = set()
    todo: list[object] = [cache.device_lengths, cache._decode_valid, cache._decode_last, *cache.layers]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, torch.nn.Module):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found[id(obj)] = obj
        elif isinstance(obj, (list, tuple)):
            todo.extend(obj)
        elif isinstance(obj, dict):
            todo.extend(obj.values())
        elif type(obj).__module__.startswith("kvcache.") and hasattr(obj, "__dict__"):
            todo.extend(vars(obj).values())
    return list(found.values())


def allocate_for_capture(cache: KVCache) -> None:
    """Allocate every slot of ``cache`` (a dense cache allocates as it fills; a captured step's
    buffers must not move), or raise ``MemoryBudgetError`` saying what that needs and what to
    change, before anything is allocated."""
    cache.allocate(advice=(
        "a captured decode step (compile=True) needs every slot of a dense cache allocated up front, up to its "
        "cache_length. Lower max_new_tokens (the cache_length generate makes is the longest prompt + "
        "max_new_tokens) or cache_length, or the batch size, or decode without compile, which allocates the "
        "cache as it fills"))


def check_capturable(cache: KVCache) -> None:
    """Raise ValueError if the decode steps of ``cache`` cannot be captured (batched eviction,
    whole blocks)."""
    # make_cache gives every layer (and head) the reserve of the cache's own spec.
    if cache.spec.reserve:
        raise ValueError(
            f"a captured decode step does not support reserve (got reserve={cache.spec.reserve}): batched "
            "eviction alternates between appending and evicting. Use compile=False, or reserve=0."
        )
    if cache.spec.block > 1 and any(layer.evicts for layer in cache.layers):
        raise ValueError(
            f"a captured decode step evicts single tokens; this cache keeps whole blocks (block={cache.spec.block}). "
            "Use compile=False, or block=1."
        )
