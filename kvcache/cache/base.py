"""The KV-cache contract: a per-layer cache that owns attention, and a per-model container.

Contract (one call site): each attention layer calls ``layer_cache.attend(q, k, v, step)`` with
    q: (B, Hq, T, D) queries, already rotated at their absolute positions,
    k: (B, Hkv, T, D) keys, rotated at their absolute positions,
    v: (B, Hkv, T, D) values,
and gets (B, Hq, T, D) attention outputs back. The layer cache decides where the new keys go,
which old keys stay, and how attention over what it keeps is computed.

Keys are stored post-RoPE together with their absolute positions (per batch row, and per K/V head
for policies that evict per head). A policy that renumbers positions rotates a stored key once,
from its stored position to the assigned one, never re-rotating a key it rotated before.

The container (``KVCache``) tracks how many tokens each row has seen. ``begin`` validates a chunk
and computes, once per model call, everything the layers share (``Step``); ``commit`` advances
the row lengths after the last layer. All checks happen in ``begin``, before any layer writes,
so a rejected chunk leaves the cache as it was.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..errors import CapacityError
from ..model.scores import Scores
from ..runtime import devices
from ..runtime.memory import check_fits
from . import snapshot as snapshots
from .options import NoOptions
from .positions import MAX_POSITIONS
from .snapshot import Snapshot, check_tensors, storage_buffers

if TYPE_CHECKING:  # storage.py builds on this module
    from .storages import Storage

# What to change when a dense cache cannot grow (``KVCache.allocate``'s default advice).
GROWTH_ADVICE = ("the cache keeps what it holds. Lower max_new_tokens (or cache_length, the most tokens a row may "
                 "reach), the batch size, or use an evicting policy or a quantized storage (dense:int8)")


@dataclass(frozen=True)
class CacheSpec:
    """Geometry shared by every layer of a cache."""

    batch_size: int
    num_kv_heads: int
    head_dim: int
    cache_length: int
    dtype: torch.dtype
    device: torch.device
    # The model's own sliding-window attention (Mistral), applied on top of any policy.
    sliding_window: int | None = None
    # (D // 2,) rotary frequencies, for policies that renumber positions.
    inv_freq: torch.Tensor | None = None
    # How keys and values are kept: a storage name (storage.STORAGES: "full", the model's dtype;
    # "int8", "int4", "int2"; "kivi4/32", "token8", ...; see storage.py).
    storage: str = "full"
    # Slots an evicting policy leaves free when a chunk overflows: it keeps cache_length - reserve
    # tokens, and the next reserve tokens are appended without evicting (see evicting.py).
    reserve: int = 0
    # Positions per block of eviction: an evicting policy keeps whole aligned blocks (blocks.py).
    block: int = 1
    # (hidden, Hq * D) this layer's output projection weight, for policies that weigh a value by
    # what it adds to the layer's output (critical); None where the model does not give it.
    out_proj: torch.Tensor | None = field(default=None, compare=False, repr=False)
    # The family's rule for attention scores (Gemma 2's soft-capping, gpt-oss's sink logits), or
    # None for plain softmax attention; every attention call of the layer passes it on.
    scores: Scores | None = None

    def __post_init__(self) -> None:
        # One form per device (cuda -> cuda:0, cpu:0 -> cpu), so that comparing it with a tensor's is exact.
        object.__setattr__(self, "device", devices.canonical(self.device))
        if self.batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {self.batch_size}")
        if self.cache_length <= 0:
            raise ValueError(f"cache_length must be positive, got {self.cache_length}")

    @classmethod
    def for_model(cls, model: torch.nn.Module, *, batch_size: int, cache_length: int, storage: str = "full",
                  reserve: int = 0, block: int = 1, layer: int | None = None) -> CacheSpec:
        """The geometry of a cache for layer ``layer`` of ``model`` (a ``Transformer``, or what
        ``kvcache.hf`` reads of another engine's model: ``config.layer(i)``, ``rotary(i)`` and
        ``scores(i)``): its K/V heads, head size, dtype, device, the layer's sliding window, rotary
        frequencies and scores rule, and its output projection (when the model has ``layers``).
        Without ``layer``, layer 0's window, rotary and rule and no projection. The one place
        they are read."""
        cfg, weight = model.config, model.embed_tokens.weight
        layers = getattr(model, "layers", None)
        out_proj = None if layer is None or layers is None else layers[layer].self_attn.o_proj.weight
        index = 0 if layer is None else layer
        return cls(batch_size=batch_size, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                   cache_length=cache_length, dtype=weight.dtype, device=weight.device,
                   sliding_window=cfg.layer(index).window, inv_freq=model.rotary(index), storage=storage,
                   reserve=reserve, block=block, out_proj=out_proj, scores=model.scores(index))


@dataclass(frozen=True)
class Step:
    """One model call's chunk, as every layer sees it.

    positions:  (B, T) long, device. Absolute position of each token; padding continues the count.
    valid:      (B, T) bool, device. False for right padding (stored nowhere, attended by no one).
    append_slot:(B, T) long, device. ``start + t`` for real tokens and the scratch slot
                ``cache_length`` for padding: where an append-only policy writes each token.
    last_index: (B,) long, device. Index in the chunk of each row's last real token (0 if none).
    newest:     (B,) long, device. Position of each row's newest token after the chunk (-1 if none).
    start:      (B,) long, CPU. Tokens each row had seen before this chunk.
    n_tokens:   (B,) long, CPU. Real tokens per row in this chunk.
    fresh:      every row starts empty, so queries and keys span the same tokens.
    uniform:    every row has the same start and no padding, so writes can be plain slices.
    span_end:   max over rows of start + n_tokens: the most tokens any row has seen after the chunk.
    min_start:  min over rows of start.
    start0:     start of row 0 (the start of every row when ``uniform``).
    decode:     one real token in every row (T == 1, no padding): the decode step, which every
                layer cache runs through its one ``decode`` method, eager or compiled.
                A captured step (``Step.captured_decode``) is described by device tensors alone,
                so that one capture serves every step: ``start`` and ``n_tokens`` are None, the
                host integers -1 and the flags False, and ``decode`` then attends every slot
                under a mask from positions. An eager step's host facts only narrow the slots
                attended or drop a mask that would hide nothing.
    shared:     values that every layer would compute alike for this call (rotation angles, say),
                computed by the first layer that needs them; keyed by whoever computes them.
    """

    positions: torch.Tensor
    valid: torch.Tensor
    append_slot: torch.Tensor
    last_index: torch.Tensor
    newest: torch.Tensor
    start: torch.Tensor
    n_tokens: torch.Tensor
    fresh: bool
    uniform: bool
    span_end: int
    min_start: int
    start0: int
    decode: bool
    shared: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_tokens(self) -> int:
        """T, the chunk length including padding."""
        return self.positions.shape[1]

    @property
    def known(self) -> bool:
        """Whether the host facts (``start``, ``n_tokens``, the integers) are set: false for a
        captured decode step."""
        return self.start is not None

    @classmethod
    def captured_decode(cls, positions: torch.Tensor) -> Step:
        """One token per row at ``positions`` (B, 1) long, device: the step of a captured decode
        (compile.py). Every field is a tensor computed from ``positions`` or a constant, so
        tracing it twice gives the same graph."""
        B = positions.shape[0]
        return cls(
            positions=positions, valid=torch.ones_like(positions, dtype=torch.bool), append_slot=positions,
            last_index=torch.zeros(B, dtype=torch.long, device=positions.device), newest=positions[:, 0],
            start=None, n_tokens=None, fresh=False, uniform=False, span_end=-1, min_start=-1, start0=-1,
            decode=True,
        )


class LayerCache(ABC):
    """The cache of one attention layer.

    A policy is a subclass with a ``name``, a one-line ``description`` and, if it has options, a
    frozen dataclass ``Options`` (see options.py); the registry finds it in policies/.

    What other modules use of a layer cache is declared here: ``attend``, ``decode`` and
    ``advance_decode`` (the model), ``check``, ``reset``, ``nbytes``, the state methods
    (snapshot.py), the prefix-slot methods (the prefix store), ``sink_queries`` (training's
    replay) and ``storage`` (training's recorder, the benchmarks).
    """

    name: str
    description: str
    Options: type = NoOptions
    # The slot buffers (storage.py) of a layer that keeps its tokens in one; a head-wise layer
    # keeps them in its heads (``HeadwiseCache.heads``).
    storage: Storage
    # Whether the cache may drop tokens. One that does not (dense) rejects a chunk that does not fit.
    evicts: bool = True
    # Whether ``CacheSpec.reserve`` (batched eviction) applies.
    supports_reserve: bool = False
    # Whether what the layer keeps, and computes from it, is independent of how a sequence is
    # chunked (up to float rounding): true of dense and of policies that keep tokens by position
    # alone (window, sink). The prefix store continues such a cache from any boundary it stored;
    # any other only from boundaries on the prefill grid (docs/prefix.md).
    chunking_invariant: bool = False

    def __init__(self, spec: CacheSpec, options: object = None) -> None:
        self.spec = spec
        self.options = options

    @classmethod
    def options_for_budget(cls, cache_length: int) -> dict[str, object]:
        """Options as the policy's paper sets them for a budget of ``cache_length`` slots (used
        by ``kvcache eval`` and the benchmarks, and by ``make_cache`` for options the user did
        not give whose defaults do not fit a small budget). Default: none."""
        return {}

    @abstractmethod
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: Step) -> torch.Tensor:
        """Store the chunk's keys and values and return attention outputs (see module docstring)."""

    def absorb(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: Step) -> None:
        """Take a chunk as ``attend`` does, for a caller that has its attention outputs already
        (a prefill shared by several caches, kvcache/eval/shared.py): the cache ends as
        ``attend`` leaves it. This default runs ``attend`` and drops the outputs; a cache may
        skip computing them."""
        self.attend(q, k, v, step)

    def check(self, step: Step) -> None:
        """Raise ``CapacityError`` if ``step`` cannot be accepted. Must not change any state."""

    def decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: Step) -> torch.Tensor:
        """``attend`` for a decode step (``step.decode``): one token per row. The one decode path,
        eager and compiled alike: writes by index, fixed shapes unless the step's host facts
        narrow them (see ``Step``), no host reads, no data-dependent branches. ``advance_decode``
        does the host bookkeeping after the step. q: (B, Hq, 1, D); k, v: (B, Hkv, 1, D) ->
        (B, Hq, 1, D). Default: ``attend`` (a layer with no decode path of its own)."""
        return self.attend(q, k, v, step)

    def advance_decode(self) -> None:
        """Host-side bookkeeping after a decode step (nothing by default)."""

    def sink_queries(self, q: torch.Tensor, step: Step) -> torch.Tensor | None:
        """The queries q (B, Hq, T, D) as the first ``sinks`` slots score them when positions are
        renumbered (the sink policy), or None when they score them as q does (every other)."""
        return None

    @abstractmethod
    def reset(self) -> None:
        """Forget every token."""

    @abstractmethod
    def nbytes(self) -> int:
        """Bytes held by this layer's buffers."""

    # ----- allocation: a layer that keeps every token allocates its slots as it fills (dense) ---
    def allocated(self) -> int:
        """Slots this layer's buffers have now, the scratch slot aside: its ``cache_length``,
        allocated when the layer was made, unless it allocates as it fills (dense)."""
        return self.spec.cache_length

    def grow(self, tokens: int) -> None:
        """Allocate what holding ``tokens`` tokens per row takes (at most ``cache_length``),
        keeping what the layer holds. ``KVCache.allocate`` checks the memory first. Default:
        nothing to allocate."""

    def nbytes_at(self, tokens: int) -> int:
        """What ``nbytes()`` would be after ``grow(tokens)``, with nothing allocated."""
        return self.nbytes()

    # ----- state: snapshots, forks and the prefix store (snapshot.py) -------------------------
    def state(self) -> dict[str, torch.Tensor]:
        """The tensors that hold this layer's contents, by name: the live buffers (not copies),
        each with the batch as its first dimension. Default: the storage's buffers
        (``storage.k``, ``storage.v``, ``storage.pos``, ...). A layer that keeps more (statistics,
        counters, a policy's own tensors) adds them; all else is configuration (``config``).
        May first bring the layer to a canonical form, which changes nothing it computes."""
        return {f"storage.{name}": t for name, t in storage_buffers(self.storage).items()}

    def check_state(self, state: Mapping[str, torch.Tensor], rows: int) -> None:
        """Raise ValueError unless ``state`` (as ``state()`` gives it, for ``rows`` rows) fits
        this layer: the same names, dtypes and shapes. Changes nothing."""
        check_tensors(self.state(), state, rows, f"the {self.name} layer")

    def load_state(self, state: Mapping[str, torch.Tensor], rows: torch.Tensor) -> None:
        """Copy ``state`` (checked by ``check_state``) into rows ``rows`` ((n,) long) of this layer."""
        live = self.state()
        for name, t in state.items():
            # (Positions of another integer type, checked to fit: an older snapshot's int64.)
            live[name].index_copy_(0, rows.to(live[name].device), t.to(live[name].device, live[name].dtype))

    def config(self) -> dict[str, object]:
        """What makes this layer what it is, besides its batch size and contents, as JSON values:
        a snapshot restores only into a layer of equal ``config``."""
        spec = self.spec
        options = dataclasses.asdict(self.options) if dataclasses.is_dataclass(self.options) else {}
        return {
            "policy": self.name, "options": options, "cache_length": spec.cache_length,
            "num_kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim,
            "dtype": str(spec.dtype).removeprefix("torch."), "storage": spec.storage,
            "reserve": spec.reserve, "sliding_window": spec.sliding_window,
        }

    def empty_like(self, batch_size: int) -> LayerCache:
        """A new, empty layer cache of the same configuration, for ``batch_size`` rows."""
        return type(self)(dataclasses.replace(self.spec, batch_size=batch_size), self.options)

    # ----- slots as prefixes (the prefix store): only a layer whose slot p holds position p ----
    def shares_prefixes(self) -> bool:
        """Whether a row's first n slots are the cache of its first n tokens whatever came after,
        so that the prefix store can cut any prefix out of a stored row (dense). Default: no."""
        return False

    def read_slots(self, row: int, start: int, stop: int) -> dict[str, torch.Tensor]:
        """Copies of row ``row``'s slots [start, stop), by state name (a layer that
        ``shares_prefixes``)."""
        raise NotImplementedError(f"the {self.name} layer does not share prefixes")

    def write_slots(self, row: int, parts: dict[str, torch.Tensor]) -> None:
        """Make row ``row`` hold the slots ``parts`` (as ``read_slots`` gives them) and nothing
        after them (a layer that ``shares_prefixes``)."""
        raise NotImplementedError(f"the {self.name} layer does not share prefixes")


class KVCache:
    """The cache of a whole model: one ``LayerCache`` per layer plus each row's token count.

    A cache is made for one model (``kvcache.make_cache(model, ...)``): its layer count, K/V
    heads, head size, dtype and device are the model's, and ``begin`` rejects a call from a
    model that differs in any of them.

    ``lengths``: (B,) long, CPU. The tokens each row has seen since the last ``reset``, which
    is the position the row's next token takes. It is not the number of slots a row holds: an
    evicting cache holds at most ``cache_length`` of them.

    ``device_lengths``: (B,) long, on the cache's device: the same counts, from which a decode
    step takes its positions without a host-to-device copy. A decode step advances it on the
    device (the captured one inside its graph); it is copied from ``lengths`` only when those
    changed otherwise (a prefill chunk, a reset, a restore), at the next decode step.
    """

    def __init__(self, layers: list[LayerCache], spec: CacheSpec, policy: str) -> None:
        _check_layers(layers, spec)
        self.layers = layers
        self.spec = spec
        self.policy = policy
        # Tokens seen per row. Kept on the CPU: it drives Python-side decisions (capacity checks,
        # slicing) without a device synchronisation.
        self.lengths = torch.zeros(spec.batch_size, dtype=torch.long)
        B, device = spec.batch_size, spec.device
        self.device_lengths = torch.zeros(B, dtype=torch.long, device=device)
        # What device_lengths holds, as the host knows it without reading the device.
        self._mirrored = torch.zeros(B, dtype=torch.long)
        # A decode step's constant fields (read only): every token real, each row's token at index 0.
        self._decode_valid = torch.ones(B, 1, dtype=torch.bool, device=device)
        self._decode_last = torch.zeros(B, dtype=torch.long, device=device)
        # The captured decode step over this cache, made by ``kvcache.generation.compiled.captured_decode``
        # on first use and kept here so that later generations replay it.
        self.captured = None
        # ``allocated_tokens`` as last computed (layers only grow), so that a step that fits
        # what is allocated costs one comparison.
        self._allocated = self.allocated_tokens

    @property
    def batch_size(self) -> int:
        return self.spec.batch_size

    @property
    def cache_length(self) -> int:
        return self.spec.cache_length

    @property
    def max_tokens(self) -> int | None:
        """The most tokens a row can hold, or None if every layer evicts and so takes any number.

        A layer that keeps every token (dense) rejects a chunk that would take a row past this
        with ``CapacityError``; a caller that knows how many tokens it will feed can check first.
        (In a model with sliding layers, those hold a ring of their window whatever the policy:
        the global layers' capacity is the cache's.)
        """
        capacities = [layer.spec.cache_length for layer in self.layers if not layer.evicts]
        return min(capacities) if capacities else None

    @property
    def allocated_tokens(self) -> int | None:
        """The most tokens a row can hold before the layers that keep every token allocate more
        slots: at most ``max_tokens``; None if every layer evicts.

        A dense layer allocates its slots as it fills: a few hundred when made, then, when a
        chunk would take a row past them, at least twice as many (``allocate``), up to its
        ``cache_length``. So ``nbytes()`` is what the tokens reached take, not what
        ``cache_length`` would, and a run copies its buffers O(log n) times for n tokens."""
        held = [layer.allocated() for layer in self.layers if not layer.evicts]
        return min(held) if held else None

    def allocate(self, tokens: int | None = None, advice: str = GROWTH_ADVICE) -> None:
        """Allocate now what holding ``tokens`` tokens per row takes (default ``max_tokens``:
        every slot) in the layers that allocate as they fill; what they hold is kept. A captured
        decode step, whose buffers must not move, needs every slot allocated first.

        Raises ``MemoryBudgetError`` before allocating anything if the device has not the memory
        available for the new buffers (the old ones are freed a layer at a time, once copied);
        ``advice`` says what to change, in that message."""
        capacity = self.max_tokens
        if capacity is None:
            return
        tokens = capacity if tokens is None else min(tokens, capacity)
        growing = [(layer, layer.nbytes_at(tokens) - layer.nbytes()) for layer in self.layers]
        growing = [(layer, extra) for layer, extra in growing if extra > 0]
        if growing:
            # Every layer's new buffers, and one layer's old ones until they are copied.
            need = sum(extra for _, extra in growing) + max(layer.nbytes() for layer, _ in growing)
            rows = f"{self.batch_size} row{'s' if self.batch_size != 1 else ''}"
            check_fits(need, self.spec.device, f"growing the {self.policy} cache from {self.allocated_tokens} to "
                       f"{tokens} tokens per row ({len(growing)} layers x {rows})", advice)
            for layer, _ in growing:
                layer.grow(tokens)
        self._allocated = self.allocated_tokens

    def check_model(self, model: torch.nn.Module) -> None:
        """Raise ValueError unless ``model`` has the layers, K/V heads, head size, dtype and device
        this cache was made for. Reads only what ``make_cache`` reads from a model."""
        spec = CacheSpec.for_model(model, batch_size=self.batch_size, cache_length=self.cache_length)
        cache = (len(self.layers), self.spec.num_kv_heads, self.spec.head_dim, self.spec.dtype, self.spec.device)
        wanted = (model.config.num_layers, spec.num_kv_heads, spec.head_dim, spec.dtype, spec.device)
        names = ("layers", "K/V heads", "head_dim", "dtype", "device")
        differ = [f"{name} {c} (cache) vs {m} (model)" for name, c, m in zip(names, cache, wanted) if c != m]
        if differ:
            raise ValueError(
                f"this cache was made for another model: {'; '.join(differ)}. Make the cache for this "
                "model with kvcache.make_cache(model, ...), after any change of the model's dtype or device."
            )

    def begin(
        self, input_ids: torch.Tensor, n_tokens: torch.Tensor | list[int] | None, model: torch.nn.Module | None = None
    ) -> Step:
        """Validate the chunk ``input_ids`` (B, T) and describe it for the layers.

        ``model``: the model about to run the chunk, checked against the cache (``check_model``);
        ``Transformer.forward`` always passes itself. Nothing is changed here: a chunk rejected
        by any check leaves the cache as it was (``commit`` is what advances it).
        """
        if model is not None:
            self.check_model(model)
        B, T = input_ids.shape
        if B != self.batch_size:
            raise ValueError(
                f"input_ids has batch size {B} but the cache was made for batch_size={self.batch_size}"
            )
        if not devices.same(input_ids.device, self.spec.device):
            raise ValueError(f"input_ids is on {input_ids.device} but the cache is on {self.spec.device}")
        if n_tokens is None:
            n = torch.full((B,), T, dtype=torch.long)
        else:
            n = torch.as_tensor(n_tokens).cpu()
            if n.is_floating_point() or n.is_complex() or n.dtype == torch.bool:
                raise ValueError(f"n_tokens must hold integers, got dtype {n.dtype}")
            n = n.long()
            if n.shape != (B,):
                raise ValueError(f"n_tokens must have shape ({B},), got {tuple(n.shape)}")
            if bool((n < 0).any()) or bool((n > T).any()):
                raise ValueError(f"n_tokens must lie in [0, {T}], got {n.tolist()}")
        start = self.lengths.clone()
        min_start, max_start = int(start.min()), int(start.max())
        all_full = n_tokens is None or bool((n == T).all())
        decode = T == 1 and all_full
        span_end = max_start + T if all_full else int((start + n).max())
        if span_end > MAX_POSITIONS:
            # Slots store positions as int32 at most (positions.py).
            raise CapacityError(f"a row would see {span_end} tokens; a cache takes at most {MAX_POSITIONS} per row "
                                "(positions are stored as int32). Reset the cache before that.")
        if decode:
            # Every field on the device from the device's own lengths: no host-to-device copy.
            positions = self.decode_positions()[:, None].clone()
            valid, append_slot, last_index = self._decode_valid, positions, self._decode_last
            newest = positions[:, 0]
        else:
            # A chunk's fields are made on the host and copied, once per chunk.
            dev = self.spec.device
            t = torch.arange(T)
            positions = start[:, None] + t
            valid = t < n[:, None]
            append_slot = torch.where(valid, positions, torch.full_like(positions, self.cache_length)).to(dev)
            positions, valid = positions.to(dev), valid.to(dev)
            last_index, newest = (n - 1).clamp(min=0).to(dev), (start + n - 1).to(dev)
        step = Step(
            positions=positions,
            valid=valid,
            append_slot=append_slot,
            last_index=last_index,
            newest=newest,
            start=start,
            n_tokens=n,
            fresh=max_start == 0,
            uniform=all_full and min_start == max_start,
            span_end=span_end,
            min_start=min_start,
            start0=int(start[0]),
            decode=decode,
        )
        for layer in self.layers:
            layer.check(step)
        if self._allocated is not None and span_end > self._allocated:
            # After every check: a rejected chunk allocates nothing. At least doubling, so that
            # growing to n tokens copies the buffers O(log n) times.
            self.allocate(max(span_end, 2 * self.allocated_tokens))
        return step

    def commit(self, step: Step) -> None:
        """Advance each row by the chunk's real tokens (called after the last layer)."""
        if step.decode:
            self.device_lengths += 1  # on the device, as the captured step does in its graph
            self.advance_decode()
        else:
            self.lengths += step.n_tokens

    def decode_positions(self) -> torch.Tensor:
        """``device_lengths`` (B,), up to date: copied from ``lengths`` if they changed other than
        by decode steps since the last copy (one host-to-device copy after a prefill, none
        between decode steps)."""
        if not torch.equal(self.lengths, self._mirrored):
            # A cache made under inference mode holds inference tensors, which only inference
            # mode may write (a call outside it is rejected by the checks that follow, not here).
            with torch.inference_mode(self.device_lengths.is_inference()):
                self.device_lengths.copy_(self.lengths)
                self._mirrored.copy_(self.lengths)
        return self.device_lengths

    def advance_decode(self) -> None:
        """The host's bookkeeping after a decode step, eager (through ``commit``) or captured
        (compile.py, outside the captured graph): every row one token longer. The step itself
        advanced ``device_lengths``."""
        self.lengths += 1
        self._mirrored += 1
        for layer in self.layers:
            layer.advance_decode()

    # Under inference mode, as snapshots are taken and restored: a call run under it (generate's)
    # leaves layers holding inference tensors (an evicting cache's held counts, a policy's
    # statistics), which nothing outside inference mode may change in place.
    @torch.inference_mode()
    def reset(self) -> None:
        self.lengths.zero_()
        for layer in self.layers:
            layer.reset()

    def nbytes(self) -> int:
        """Bytes held by all layers' buffers (keys, values, positions and any scores): what is
        allocated now (see ``allocated_tokens``)."""
        return sum(layer.nbytes() for layer in self.layers)

    @property
    def chunking_invariant(self) -> bool:
        """Whether every layer is independent of how a sequence is chunked (see LayerCache)."""
        return all(layer.chunking_invariant for layer in self.layers)

    def snapshot(self, rows: Sequence[int] | None = None) -> Snapshot:
        """A copy of the state of ``rows`` (default: every row): keys, values, positions,
        statistics, held counts, policy state and the row lengths. Continuing this cache, or a
        cache restored from the snapshot, never changes it."""
        return snapshots.take(self, rows)

    def restore(self, snapshot: Snapshot, rows: Sequence[int] | None = None) -> None:
        """Make ``rows`` (default: every row) hold the state in ``snapshot``, which holds as many
        rows. The snapshot must come from a cache of the same policy, storage and per-layer
        configuration (cache_length, options, heads, dtype); otherwise ValueError is raised and
        this cache is left as it was. Other rows are not touched."""
        snapshots.restore(self, snapshot, rows)

    def empty_like(self, batch_size: int | None = None) -> KVCache:
        """A new, empty cache of the same configuration (for ``batch_size`` rows; default the same)."""
        batch_size = self.batch_size if batch_size is None else batch_size
        layers = [layer.empty_like(batch_size) for layer in self.layers]
        return KVCache(layers, dataclasses.replace(self.spec, batch_size=batch_size), self.policy)

    def fork(self) -> KVCache:
        """An independent copy of this cache: the two continue separately."""
        twin = self.empty_like()
        twin.restore(self.snapshot())
        return twin

    def __repr__(self) -> str:
        return (
            f"KVCache(policy={self.policy!r}, layers={len(self.layers)}, batch_size={self.batch_size}, "
            f"cache_length={self.cache_length}, lengths={self.lengths.tolist()}, nbytes={self.nbytes()})"
        )


def _check_layers(layers: list[LayerCache], spec: CacheSpec) -> None:
    """Every layer must share the container's geometry, so that checking the container's spec
    against a model checks every layer."""
    if not layers:
        raise ValueError("a KVCache needs one layer cache per model layer, got none")
    shared = ("batch_size", "num_kv_heads", "head_dim", "dtype", "device")
    for i, layer in enumerate(layers):
        differ = [f"{name}={getattr(layer.spec, name)}" for name in shared
                  if getattr(layer.spec, name) != getattr(spec, name)]
        if differ:
            raise ValueError(
                f"layer {i} was made with {', '.join(differ)}, unlike the cache's spec "
                f"({', '.join(f'{name}={getattr(spec, name)}' for name in shared)})"
            )


def capacity_error(step: Step, capacity: int, policy: str) -> CapacityError:
    need = step.start + step.n_tokens
    row = int(need.argmax())
    return CapacityError(
        f"{policy} cache is full: row {row} would hold {int(need[row])} tokens but cache_length is "
        f"{capacity}. Make the cache with a larger cache_length, or use an evicting policy."
    )
