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

import dataclasses
import warnings
from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F

from ..cache.base import KVCache
from ..cache.names import CacheName
from ..cache.registry import make_cache
from ..errors import CapacityError, KVCacheWarning
from .replay import KeyValueStore, Recorder, Replay, check_supported, held_positions, storages
from .step import ChunkStep, base_model, sharded_step


def chunked_loss(
    model: torch.nn.Module,
    ids: torch.Tensor | Sequence[torch.Tensor],
    labels: torch.Tensor | Sequence[torch.Tensor] | None = None,
    *,
    policy: str = "dense",
    cache_length: int | float | None = None,
    chunk: int | Sequence[int] = 512,
    weights: torch.Tensor | Sequence[torch.Tensor] | None = None,
    ignore_index: int = -100,
    offload_kv: bool = False,
    options: Mapping[str, object] | None = None,
    allocation: str | Sequence[int] = "uniform",
    head_budgets: Sequence[Sequence[int]] | None = None,
    reserve: int = 0,
    block: int = 1,
) -> torch.Tensor:
    """Mean next-token cross-entropy of ``ids`` run ``chunk`` tokens at a time through a cache.

    ids:     (B, T) token ids, every row T tokens (T >= 2); or a list of B rows of different
             lengths (1-D tensors, each >= 2 tokens), with ``labels`` and ``weights`` lists alike:
             ragged rows. Each row then has exactly the loss and gradient it has alone (see
             ``pad_rows``), and the batch's loss is the mean over all their targets. T is the
             longest row's length (a float ``cache_length`` is a fraction of it).
    labels:  (B, T) targets aligned with ``ids`` (default ``ids``): the logits at position t
             predict ``labels[:, t + 1]``, as in transformers' causal-LM loss; positions whose
             label is ``ignore_index`` are not counted.
    weights: (B, T) float, optional: the weight of the target ``labels[:, t]`` (t >= 1) in the
             mean, which is then sum(w * loss) / sum(w) (answers of retrieval tasks weigh more).
    policy, cache_length, options, allocation, head_budgets, reserve, block:
             the cache, as ``kvcache.make_cache`` takes them (``h2o:int4``, ``options={"sinks":
             4}`` ...); ``cache_length`` defaults to T (a dense cache of the sequence), and a
             float is a fraction of T.
    chunk:   tokens per model call, or a sequence of chunk sizes that sum to T.
    offload_kv: keep the recorded keys and values and their gradient buffers, the memory that grows
             with T, in CPU memory (pinned on CUDA) instead of on the model's device; gradients
             are unchanged.

    ``model`` may also be sharded for data parallelism by ``kvcache.train.shard.shard`` (DDP or
    FSDP2, under ``torch.distributed``): every rank then passes its own rows of the global batch,
    the result is the loss of the global batch, and ``backward()`` leaves in every rank's
    ``.grad`` (a shard of it, under FSDP2) the gradient of the global batch, as one process
    running all the rows would compute it.

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
    if isinstance(ids, (list, tuple)):
        ids, labels, weights = pad_rows(ids, labels, weights, ignore_index)
    sharded = sharded_step(model)
    step = ChunkStep(base_model(model)) if sharded is None else sharded[1]
    call = step if sharded is None else sharded[0]
    model = step.transformer
    _check_ids(ids)
    targets, target_weights = _targets(ids, labels, weights, ignore_index)
    denom = target_weights.sum()
    world, ids, targets, target_weights = _across_ranks(sharded is not None, denom, ids, targets, target_weights,
                                                        ignore_index)
    B, T = ids.shape
    sizes = chunk_sizes(chunk, T)
    if float(denom) <= 0:
        raise ValueError("no token to predict: every label is ignore_index (or every weight is 0)")
    shape = dict(options=options, allocation=allocation, head_budgets=head_budgets, reserve=reserve, block=block)
    cache = _replayable_cache(model, policy, T if cache_length is None else cache_length, B, T, shape)
    store_device = torch.device("cpu") if offload_kv else ids.device
    plan = _Plan(call, cache, ids, targets, target_weights, denom, sizes, ignore_index, store_device)
    if sharded is not None:
        plan.world = world
        return _sharded_loss(plan)
    return _loss(plan, model)


def _across_ranks(sharded: bool, denom: torch.Tensor, ids, targets, target_weights, ignore_index: int) -> tuple:
    """(world size, ids, targets, target weights): under torch.distributed, ``denom`` becomes the
    global batch's total weight (in place) and the rows are padded to the longest rank's
    (``_pad_to_longest_rank``); else the world is 1 and the rows are as given."""
    if not (sharded and torch.distributed.is_initialized()):
        return 1, ids, targets, target_weights
    torch.distributed.all_reduce(denom)
    return (torch.distributed.get_world_size(), *_pad_to_longest_rank(ids, targets, target_weights, ignore_index))


def _check_ids(ids: torch.Tensor) -> None:
    """Raise ValueError unless ``ids`` is a (B, T) integer tensor with T >= 2."""
    if ids.dim() != 2 or ids.dtype not in (torch.long, torch.int32):
        raise ValueError(f"ids must be a (batch, tokens) integer tensor, got shape {tuple(ids.shape)} and dtype {ids.dtype}")
    if ids.shape[1] < 2:
        raise ValueError(f"ids needs at least 2 tokens per row (one to predict from, one to predict), got {ids.shape[1]}")


def _pad_to_longest_rank(ids, targets, target_weights, ignore_index: int) -> tuple[torch.Tensor, ...]:
    """ids, targets and target weights (B, T) right-padded to the longest T of any rank.

    Every rank must make as many model calls (FSDP2 gathers each block's weights in each):
    shorter rows are padded to the longest rank's, which changes nothing they compute."""
    longest = torch.tensor(ids.shape[1], device=ids.device)
    torch.distributed.all_reduce(longest, op=torch.distributed.ReduceOp.MAX)
    return _extend(ids, targets, target_weights, int(longest), ignore_index)


def _replayable_cache(model: torch.nn.Module, policy: str, length: int | float, B: int, T: int,
                      shape: dict) -> KVCache:
    """The cache the chunks of a (B, T) batch run through: ``policy``'s with ``cache_length=length``
    and the rest of make_cache's keywords in ``shape`` (options, allocation, ...), or the same
    policy with ``full`` storage (and a warning) where its storage quantizes a token depending
    on where it is placed, so its keys cannot be replayed as stored. Raises CapacityError where
    a cache that does not evict cannot hold the T tokens."""
    cache = make_cache(model, policy, cache_length=length, batch_size=B, prompt_length=T, **shape)
    for layer in cache.layers:
        check_supported(layer)
    if not all(getattr(s, "exact_roundtrip", True) for layer in cache.layers for s in storages(layer)):
        full = dataclasses.replace(CacheName.parse(policy), storage="full", storage_named=False)
        warnings.warn(
            f"chunked_loss trains {policy!r} as {full!r} (full precision): its storage quantizes a token "
            "differently depending on where it is placed, so a chunk's keys cannot be replayed as stored; "
            "per-token storages (token8, token4, token2) are replayed exactly, straight-through",
            KVCacheWarning,
            stacklevel=3,  # chunked_loss's caller
        )
        cache = make_cache(model, full, cache_length=length, batch_size=B, prompt_length=T, **shape)
    if cache.max_tokens is not None and cache.max_tokens < T:
        raise CapacityError(
            f"a {policy!r} cache of cache_length={cache.max_tokens} cannot hold a sequence of {T} tokens: "
            "give the dense cache the whole sequence (cache_length=None) or choose an evicting policy"
        )
    return cache


def _loss(plan: _Plan, model: torch.nn.Module) -> torch.Tensor:
    """The loss of a single-process call: one autograd node over the parameters that require
    grad, or the recording pass alone where no gradient is wanted."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not (torch.is_grad_enabled() and params):
        with torch.no_grad():
            return plan.record()
    return _ChunkedLoss.apply(plan, *params)


def _sharded_loss(plan: _Plan) -> torch.Tensor:
    """The loss of a data-parallel call: one autograd node over an anchor, or the recording pass
    alone where no gradient is wanted."""
    # Gradients go to .grad through the wrapper's own hooks (DDP's all-reduce, FSDP2's
    # reduce-scatter), so the loss hangs on an anchor instead of the parameters.
    anchor = torch.zeros((), device=plan.ids.device, requires_grad=torch.is_grad_enabled())
    if not anchor.requires_grad:
        with torch.no_grad():
            return plan.record()
    return _ShardedChunkedLoss.apply(plan, anchor)


def pad_rows(rows: Sequence[torch.Tensor], labels: Sequence[torch.Tensor] | None,
             weights: Sequence[torch.Tensor] | None, ignore_index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Ragged rows as one right-padded batch: ids (B, T) (padded with id 0), labels (B, T)
    (``ignore_index`` on padding), weights (B, T) float32 (0 on padding), T the longest row.

    Padding changes nothing a row's real tokens compute: it comes after them, so causal attention
    never shows it to them, and a cache's decisions made after a chunk that holds padding only
    reach later chunks, where that row is all padding. Every chunk boundary before a row's end
    is where the row alone would have it, so each row's tokens are computed exactly as alone."""
    rows = list(rows)
    if not rows:
        raise ValueError("ids is an empty list: give at least one row")
    for name, given in (("labels", labels), ("weights", weights)):
        if given is not None and (not isinstance(given, (list, tuple)) or len(given) != len(rows)):
            raise ValueError(f"with ragged ids (a list of {len(rows)} rows), {name} must be a list of as many rows")
    for i, row in enumerate(rows):
        if not torch.is_tensor(row) or row.dim() != 1 or row.dtype not in (torch.long, torch.int32):
            raise ValueError(f"ragged ids: row {i} must be a 1-D integer tensor, got "
                             f"{type(row).__name__} {tuple(getattr(row, 'shape', ()))}")
        if row.shape[0] < 2:
            raise ValueError(f"ids needs at least 2 tokens per row (one to predict from, one to predict); "
                             f"row {i} has {row.shape[0]}")
        for name, given in (("labels", labels), ("weights", weights)):
            if given is not None and tuple(given[i].shape) != tuple(row.shape):
                raise ValueError(f"{name}[{i}] must have the shape of row {i} {tuple(row.shape)}, "
                                 f"got {tuple(given[i].shape)}")
    T, device = max(r.shape[0] for r in rows), rows[0].device
    ids = torch.zeros(len(rows), T, dtype=torch.long, device=device)
    padded_labels = torch.full_like(ids, ignore_index)
    padded_weights = torch.zeros(len(rows), T, dtype=torch.float32, device=device)
    for i, row in enumerate(rows):
        n = row.shape[0]
        ids[i, :n] = row
        padded_labels[i, :n] = row if labels is None else labels[i]
        padded_weights[i, :n] = 1.0 if weights is None else weights[i].float()
    return ids, padded_labels, padded_weights


def _extend(ids, targets, target_weights, T: int, ignore_index: int) -> tuple[torch.Tensor, ...]:
    """ids, targets (B, t) and target weights right-padded to T tokens (id 0, nothing to predict)."""
    extra = T - ids.shape[1]
    if extra == 0:
        return ids, targets, target_weights
    return (F.pad(ids, (0, extra), value=0), F.pad(targets, (0, extra), value=ignore_index),
            F.pad(target_weights, (0, extra), value=0.0))


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
    """The state shared by the two passes of one ``chunked_loss`` call.

    call: the ``ChunkStep`` (or its data-parallel wrapper) that runs one chunk and gives its loss.
    store_device: where the recorded keys and values and their gradient buffers live.
    """

    def __init__(self, call, cache: KVCache, ids, targets, target_weights, denom, sizes, ignore_index,
                 store_device: torch.device) -> None:
        self.call, self.cache, self.ids, self.sizes = call, cache, ids, sizes
        self.targets, self.target_weights, self.denom, self.ignore_index = targets, target_weights, denom, ignore_index
        self.starts = [sum(sizes[:i]) for i in range(len(sizes))]
        T = ids.shape[1]
        self.store_device = store_device
        self.stores = [KeyValueStore(T, store_device) for _ in cache.layers]
        # held[c][l]: (B, Hp, S) positions layer l held before chunk c (None for the first chunk).
        self.held: list[list[torch.Tensor] | None] = []
        self.world = 1  # data-parallel ranks whose losses add up to the global batch's loss
        device = ids.device
        self.autocast = (device.type, torch.is_autocast_enabled(device.type), torch.get_autocast_dtype(device.type))

    def _chunk_loss(self, c: int, cache: KVCache) -> torch.Tensor:
        """Chunk ``c`` run through ``cache``: its weighted loss sum over the whole call's weight."""
        s, n = self.starts[c], self.sizes[c]
        return self.call(self.ids[:, s : s + n], cache, self.targets[:, s : s + n],
                         self.target_weights[:, s : s + n], self.denom, self.ignore_index)

    def record(self) -> torch.Tensor:
        """The recording pass (no gradient): the loss, the keys and values, the decisions."""
        cache, B = self.cache, self.ids.shape[0]
        recording = KVCache([Recorder(layer, store) for layer, store in zip(cache.layers, self.stores)],
                            cache.spec, cache.policy)
        total = torch.zeros((), device=self.ids.device)
        for c, s in enumerate(self.starts):
            self.held.append(None if c == 0 else [held_positions(layer, s, B) for layer in cache.layers])
            total = total + self._chunk_loss(c, recording)
        if self.world > 1:
            torch.distributed.all_reduce(total)  # every rank's share of the global batch's loss
        return total

    def _replay(self, c: int, scale: torch.Tensor) -> tuple[torch.Tensor, list[Replay]]:
        """Chunk ``c`` recomputed with gradient over the recorded keys and values its layers held:
        (its loss times ``scale``, the replay layers whose leaves and new keys and values the
        gradient is taken for)."""
        cache, device = self.cache, self.ids.device
        s, n = self.starts[c], self.sizes[c]
        replays = []
        for i, (layer, store) in enumerate(zip(cache.layers, self.stores)):
            kept = None
            if self.held[c] is not None:
                pos = self.held[c][i]
                k, v = store.gather(pos)
                kept = (k.to(device).requires_grad_(), v.to(device).requires_grad_(), pos)
            replays.append(Replay(layer, kept, store.k[:, :, s : s + n].to(device), store.v[:, :, s : s + n].to(device)))
        replay = KVCache(replays, cache.spec, cache.policy)
        replay.lengths.fill_(s)
        device_type, enabled, dtype = self.autocast
        with torch.enable_grad(), torch.autocast(device_type, dtype=dtype, enabled=enabled):
            loss = self._chunk_loss(c, replay) * scale
        return loss, replays

    def _roots(self, c: int, loss: torch.Tensor, replays: list[Replay], g_k, g_v) -> tuple[list, list]:
        """The outputs to differentiate for chunk ``c`` and their incoming gradients: the loss, and
        the chunk's keys and values with the gradient later chunks sent them."""
        s, n = self.starts[c], self.sizes[c]
        outputs, grad_outputs = [loss], [None]
        if c < len(self.sizes) - 1:  # the last chunk's keys and values reach no later chunk
            for r, gk, gv in zip(replays, g_k, g_v):
                for new, g in ((r.new_k, gk), (r.new_v, gv)):
                    # Made by frozen weights only (a frozen first layer; LoRA on v_proj alone),
                    # nothing trainable lies behind it.
                    if new.requires_grad:
                        outputs.append(new)
                        grad_outputs.append(g[:, :, s : s + n].to(new.device, new.dtype))
        return outputs, grad_outputs

    def _buffers(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Gradient arriving at each position's key and value from later chunks, float32, with one
        spare position (T) where the empty slots' (zero) gradients are sent."""
        T = self.ids.shape[1]
        g_k = [torch.zeros(*s.k.shape[:2], T + 1, s.k.shape[3], dtype=torch.float32, device=s.k.device)
               for s in self.stores]
        return g_k, [torch.zeros_like(g) for g in g_k]

    def backward(self, grad: torch.Tensor, params: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """The gradient pass: every parameter's gradient of ``grad * loss``."""
        T = self.ids.shape[1]
        g_k, g_v = self._buffers()
        grads: list[torch.Tensor | None] = [None] * len(params)
        for c in reversed(range(len(self.sizes))):
            loss, replays = self._replay(c, grad)
            outputs, grad_outputs = self._roots(c, loss, replays, g_k, g_v)
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

    def backward_into_grad(self, grad: torch.Tensor) -> None:
        """The gradient pass of a data-parallel step: each chunk's backward is a call of its own
        that adds the parameters' gradient into their ``.grad`` through the wrapper's hooks.

        Every rank's loss is its rows' share of the global batch's loss; the wrappers average over
        the ranks, so each rank differentiates ``world`` times its share. Under DDP the
        gradients are all-reduced once, at the last backward (the first chunk's); FSDP2
        reduce-scatters after every chunk, so no rank ever holds a whole gradient."""
        T = self.ids.shape[1]
        g_k, g_v = self._buffers()
        ddp = isinstance(self.call, torch.nn.parallel.DistributedDataParallel)
        try:
            for c in reversed(range(len(self.sizes))):
                if ddp:
                    self.call.require_backward_grad_sync = c == 0
                loss, replays = self._replay(c, grad * self.world)
                outputs, grad_outputs = self._roots(c, loss, replays, g_k, g_v)
                torch.autograd.backward(outputs, [g if g is not None else torch.ones_like(loss) for g in grad_outputs])
                for r, gk, gv in zip(replays, g_k, g_v):
                    if r.kept_k is not None:
                        _send_back(gk, r.kept_pos, r.kept_k.grad, T)
                        _send_back(gv, r.kept_pos, r.kept_v.grad, T)
        finally:
            if ddp:
                self.call.require_backward_grad_sync = True


def _pairs(items):
    return [(items[i], items[i + 1]) for i in range(0, len(items), 2)]


def _send_back(buffer: torch.Tensor, pos: torch.Tensor, grad: torch.Tensor | None, T: int) -> None:
    """Add ``grad`` (B, Hkv, S, D), the gradient of held keys (or values) at ``pos`` (B, Hp, S), to
    ``buffer`` (B, Hkv, T + 1, D) at those positions; empty slots go to the spare position T."""
    if grad is None:
        return
    B, H, S, D = grad.shape
    pos = pos.to(buffer.device)
    index = torch.where(pos >= 0, pos, T).expand(B, H, S).unsqueeze(-1).expand(B, H, S, D)
    buffer.scatter_add_(2, index, grad.to(buffer.device, torch.float32))


def _check_not_backpropagated(ctx) -> None:
    """The recorded keys and values are freed by a loss's first backward: a second one cannot run."""
    if ctx.plan is None:
        raise RuntimeError("this chunked_loss was already backpropagated (its recorded keys and values are "
                           "freed by the first backward); call chunked_loss again")


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
        _check_not_backpropagated(ctx)
        grads = ctx.plan.backward(grad, list(ctx.params))
        ctx.plan = None  # the recorded keys and values are freed with the graph
        return (None, *grads)


class _ShardedChunkedLoss(torch.autograd.Function):
    """The loss of a data-parallel ``chunked_loss`` as one autograd node over an anchor: forward is
    the recording pass (the global batch's loss), backward runs the chunks' backward calls, which
    leave the gradient in the parameters' ``.grad``."""

    @staticmethod
    def forward(ctx, plan: _Plan, anchor: torch.Tensor) -> torch.Tensor:
        ctx.plan = plan
        return plan.record()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        _check_not_backpropagated(ctx)
        ctx.plan.backward_into_grad(grad)
        ctx.plan = None
        return None, None
