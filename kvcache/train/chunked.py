"""``chunked_loss``: the next-token loss of a long sequence fed chunk by chunk through a bounded
KV cache, with exact gradients and memory that follows the cache, not the sequence.

Backward through a real cache fails: a later chunk overwrites the slots an earlier chunk's graph
saved. So the loss is computed in two passes (see replay.py):

1. Recording, without gradient: the chunks run through a real cache of the chosen policy, which
   attends and evicts exactly as in inference. Each layer's keys and values of every position
   (as attended) and, after each chunk, the positions each layer kept are recorded. This pass
   gives the loss value.
2. Backward, one chunk at a time from the last: the chunk is recomputed with gradient, its
   queries attending over fresh leaf copies of the recorded keys and values its layers held
   before it plus its own. One ``autograd.grad`` call gives the parameters' gradient from this
   chunk and the gradient of every held key and value, which is added to a per-position buffer;
   when the chunk that made a position is reached, that buffer is fed back into its keys and
   values. This is reverse-mode differentiation with chunks as the nodes, so the gradient is the
   exact gradient of the recorded computation: every later chunk that attended to a token sends
   its share back through that token's key and value, into the layers and chunks below.

Memory: one chunk's activations through the model (its queries against at most
``cache_length + chunk`` keys per layer), plus the recorded keys and values and their gradient
buffers, ``2 * layers * Hkv * head_dim`` numbers per token each (a dense cache of the sequence,
twice): 4 KB a token on the bundled model, where full backprop keeps about 210 KB a token
(benchmarks/finetune.py). Time: the recording forward, then a forward and a backward per chunk.
"""

from __future__ import annotations

import warnings
from typing import Sequence

import torch
import torch.nn.functional as F

from ..cache.base import KVCache
from ..cache.registry import make_cache
from ..errors import CapacityError
from .replay import KeyValueStore, Recorder, Replay, check_supported, held_positions


def chunked_loss(
    model: torch.nn.Module,
    ids: torch.Tensor,
    labels: torch.Tensor | None = None,
    *,
    policy: str = "dense",
    cache_length: int | float | None = None,
    chunk: int | Sequence[int] = 512,
    weights: torch.Tensor | None = None,
    ignore_index: int = -100,
    **options,
) -> torch.Tensor:
    """Mean next-token cross-entropy of ``ids`` run ``chunk`` tokens at a time through a cache.

    ids:     (B, T) token ids, every row T tokens (T >= 2).
    labels:  (B, T) targets aligned with ``ids`` (default ``ids``): the logits at position t
             predict ``labels[:, t + 1]``, as in transformers' causal-LM loss; positions whose
             label is ``ignore_index`` are not counted.
    weights: (B, T) float, optional: the weight of the target ``labels[:, t]`` (t >= 1) in the
             mean, which is then sum(w * loss) / sum(w) (answers of retrieval tasks weigh more).
    policy, cache_length, options: the cache, as ``kvcache.make_cache`` takes them (``h2o:int4``,
             ``sinks=4`` ...); ``cache_length`` defaults to T (a dense cache of the sequence), and a
             float is a fraction of T.
    chunk:   tokens per model call, or a sequence of chunk sizes that sum to T.

    Returns a scalar tensor. Its ``backward()`` (or ``torch.autograd.grad``) gives every
    parameter that requires grad the exact gradient of the computation the cache performed: the
    chunks attend over what the policy kept, the policy's decisions are made once without
    gradient and replayed, and the gradient reaches earlier chunks through the keys and values
    later chunks attended to. A dense cache gives the gradient of the plain forward over the
    whole sequence. Quantized storages whose codes for a token do not depend on where it is placed
    (per-token codes: ``h2o:int8``, ``token4``) are straight-through: the forward sees the stored
    codes read back, and the gradient passes to the unquantized keys and values unchanged. A
    storage whose codes do depend on placement (KIVI's per-channel key groups, which ``int4`` and
    ``int2`` name) is trained at full precision: the same policy with ``full`` storage, with a
    warning.
    On CUDA the call follows the caller's autocast (bf16) in both passes.
    """
    model = model.get_base_model() if hasattr(model, "get_base_model") else model
    if ids.dim() != 2 or ids.dtype not in (torch.long, torch.int32):
        raise ValueError(f"ids must be a (batch, tokens) integer tensor, got shape {tuple(ids.shape)} and dtype {ids.dtype}")
    B, T = ids.shape
    if T < 2:
        raise ValueError(f"ids needs at least 2 tokens per row (one to predict from, one to predict), got {T}")
    sizes = chunk_sizes(chunk, T)
    targets, target_weights = _targets(ids, labels, weights, ignore_index)
    denom = target_weights.sum()
    if float(denom) <= 0:
        raise ValueError("no token to predict: every label is ignore_index (or every weight is 0)")
    length = T if cache_length is None else cache_length
    cache = make_cache(model, policy, cache_length=length, batch_size=B, prompt_length=T, **options)
    if not all(getattr(getattr(layer, "storage", None), "exact_roundtrip", True) for layer in cache.layers):
        full = policy.partition(":")[0]
        warnings.warn(
            f"chunked_loss trains {policy!r} as {full!r} (full precision): its storage quantizes a token "
            "differently depending on where it is placed, so a chunk's keys cannot be replayed as stored; "
            "per-token storages (token8, token4, token2) are replayed exactly, straight-through",
            stacklevel=2,
        )
        cache = make_cache(model, full, cache_length=length, batch_size=B, prompt_length=T, **options)
    for layer in cache.layers:
        check_supported(layer)
    if cache.max_tokens is not None and cache.max_tokens < T:
        raise CapacityError(
            f"a {policy!r} cache of cache_length={cache.max_tokens} cannot hold a sequence of {T} tokens: "
            "give the dense cache the whole sequence (cache_length=None) or choose an evicting policy"
        )
    plan = _Plan(model, cache, ids, targets, target_weights, denom, sizes, ignore_index)
    params = [p for p in model.parameters() if p.requires_grad]
    if not (torch.is_grad_enabled() and params):
        with torch.no_grad():
            return plan.record()
    return _ChunkedLoss.apply(plan, *params)


def chunk_sizes(chunk: int | Sequence[int], total: int) -> list[int]:
    """Chunk sizes covering ``total`` tokens: ``chunk`` at a time (the last one shorter), or the
    given sizes, which must be positive and sum to ``total``."""
    if isinstance(chunk, bool):
        raise ValueError(f"chunk must be a positive int or a sequence of them, got {chunk!r}")
    if isinstance(chunk, int):
        if chunk <= 0:
            raise ValueError(f"chunk must be positive, got {chunk}")
        return [min(chunk, total - s) for s in range(0, total, chunk)]
    sizes = list(chunk)
    if not sizes or any(isinstance(n, bool) or not isinstance(n, int) or n <= 0 for n in sizes):
        raise ValueError(f"chunk sizes must be positive ints, got {sizes}")
    if sum(sizes) != total:
        raise ValueError(f"chunk sizes must sum to the sequence length {total}, got {sum(sizes)} ({sizes})")
    return sizes


def _targets(ids, labels, weights, ignore_index) -> tuple[torch.Tensor, torch.Tensor]:
    """targets (B, T): what position t predicts (``ignore_index`` at the last position), and its
    weight (B, T) float32, 0 where nothing is predicted."""
    labels = ids if labels is None else labels
    if labels.shape != ids.shape:
        raise ValueError(f"labels must have the shape of ids {tuple(ids.shape)}, got {tuple(labels.shape)}")
    targets = torch.full_like(ids, ignore_index, dtype=torch.long)
    targets[:, :-1] = labels[:, 1:]
    w = torch.zeros(ids.shape, dtype=torch.float32, device=ids.device)
    if weights is None:
        w[:, :-1] = 1.0
    else:
        if weights.shape != ids.shape:
            raise ValueError(f"weights must have the shape of ids {tuple(ids.shape)}, got {tuple(weights.shape)}")
        if bool((weights < 0).any()):
            raise ValueError("weights must be >= 0")
        w[:, :-1] = weights[:, 1:].float()
    return targets, w.masked_fill(targets == ignore_index, 0.0)


class _Plan:
    """The state shared by the two passes of one ``chunked_loss`` call."""

    def __init__(self, model, cache: KVCache, ids, targets, target_weights, denom, sizes, ignore_index) -> None:
        self.model, self.cache, self.ids, self.sizes = model, cache, ids, sizes
        self.targets, self.target_weights, self.denom, self.ignore_index = targets, target_weights, denom, ignore_index
        self.starts = [sum(sizes[:i]) for i in range(len(sizes))]
        T = ids.shape[1]
        self.stores = [KeyValueStore(T) for _ in cache.layers]
        # held[c][l]: (B, Hp, S) positions layer l held before chunk c (None for the first chunk).
        self.held: list[list[torch.Tensor] | None] = []
        device = ids.device
        self.autocast = (device.type, torch.is_autocast_enabled(device.type), torch.get_autocast_dtype(device.type))

    def _chunk_loss(self, c: int, hidden: torch.Tensor) -> torch.Tensor:
        """Weighted sum of chunk ``c``'s token losses over the whole call's weight: a scalar.
        hidden: (B, n, hidden_size) the final normed hidden states of the chunk."""
        s, n = self.starts[c], self.sizes[c]
        logits = self.model.lm_head(hidden).float()
        losses = F.cross_entropy(logits.flatten(0, 1), self.targets[:, s : s + n].flatten(),
                                 ignore_index=self.ignore_index, reduction="none")
        return (losses * self.target_weights[:, s : s + n].flatten()).sum() / self.denom

    def record(self) -> torch.Tensor:
        """The recording pass (no gradient): the loss, the keys and values, the decisions."""
        model, cache, B = self.model, self.cache, self.ids.shape[0]
        recording = KVCache([Recorder(layer, store) for layer, store in zip(cache.layers, self.stores)],
                            cache.spec, cache.policy)
        total = torch.zeros((), device=self.ids.device)
        for c, (s, n) in enumerate(zip(self.starts, self.sizes)):
            self.held.append(None if c == 0 else [held_positions(layer, s, B) for layer in cache.layers])
            hidden = model(self.ids[:, s : s + n], recording, skip_lm_head=True)
            total = total + self._chunk_loss(c, hidden)
        return total

    def backward(self, grad: torch.Tensor, params: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """The gradient pass: every parameter's gradient of ``grad * loss``."""
        model, cache = self.model, self.cache
        T = self.ids.shape[1]
        # Gradient arriving at each position's key and value from later chunks, float32, with one
        # spare position (T) where the empty slots' (zero) gradients are sent.
        g_k = [torch.zeros(*s.k.shape[:2], T + 1, s.k.shape[3], dtype=torch.float32, device=s.k.device)
               for s in self.stores]
        g_v = [torch.zeros_like(g) for g in g_k]
        grads: list[torch.Tensor | None] = [None] * len(params)
        device_type, enabled, dtype = self.autocast
        for c in reversed(range(len(self.sizes))):
            s, n = self.starts[c], self.sizes[c]
            replays = []
            for i, (layer, store) in enumerate(zip(cache.layers, self.stores)):
                kept = None
                if self.held[c] is not None:
                    pos = self.held[c][i]
                    k, v = store.gather(pos)
                    kept = (k.requires_grad_(), v.requires_grad_(), pos)
                replays.append(Replay(layer, kept, store.k[:, :, s : s + n], store.v[:, :, s : s + n]))
            replay = KVCache(replays, cache.spec, cache.policy)
            replay.lengths.fill_(s)
            with torch.enable_grad(), torch.autocast(device_type, dtype=dtype, enabled=enabled):
                hidden = model(self.ids[:, s : s + n], replay, skip_lm_head=True)
                loss = self._chunk_loss(c, hidden) * grad
            outputs, grad_outputs = [loss], [None]
            if c < len(self.sizes) - 1:  # the last chunk's keys and values reach no later chunk
                for r, gk, gv in zip(replays, g_k, g_v):
                    for new, g in ((r.new_k, gk), (r.new_v, gv)):
                        # Made by frozen weights only (a frozen first layer; LoRA on v_proj alone),
                        # nothing trainable lies behind it.
                        if new.requires_grad:
                            outputs.append(new)
                            grad_outputs.append(g[:, :, s : s + n].to(new.dtype))
            leaves = [t for r in replays if r.kept_k is not None for t in (r.kept_k, r.kept_v)]
            found = torch.autograd.grad(outputs, params + leaves, grad_outputs, allow_unused=True)
            for j, g in enumerate(found[: len(params)]):
                if g is not None:
                    grads[j] = g if grads[j] is None else grads[j].add_(g)
            if leaves:
                for r, gk, gv, (dk, dv) in zip(replays, g_k, g_v, _pairs(found[len(params):])):
                    _send_back(gk, r.kept_pos, dk, T)
                    _send_back(gv, r.kept_pos, dv, T)
        return grads


def _pairs(items):
    return [(items[i], items[i + 1]) for i in range(0, len(items), 2)]


def _send_back(buffer: torch.Tensor, pos: torch.Tensor, grad: torch.Tensor | None, T: int) -> None:
    """Add ``grad`` (B, Hkv, S, D), the gradient of held keys (or values) at ``pos`` (B, Hp, S), to
    ``buffer`` (B, Hkv, T + 1, D) at those positions; empty slots go to the spare position T."""
    if grad is None:
        return
    B, H, S, D = grad.shape
    index = torch.where(pos >= 0, pos, T).expand(B, H, S).unsqueeze(-1).expand(B, H, S, D)
    buffer.scatter_add_(2, index, grad.float())


class _ChunkedLoss(torch.autograd.Function):
    """The loss as one autograd node over the parameters: forward is the recording pass,
    backward the chunk-by-chunk gradient pass."""

    @staticmethod
    def forward(ctx, plan: _Plan, *params: torch.Tensor) -> torch.Tensor:
        ctx.plan = plan
        ctx.params = params
        return plan.record()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.plan is None:
            raise RuntimeError("this chunked_loss was already backpropagated (its recorded keys and values are "
                               "freed by the first backward); call chunked_loss again")
        grads = ctx.plan.backward(grad, list(ctx.params))
        ctx.plan = None  # the recorded keys and values are freed with the graph
        return (None, *grads)
