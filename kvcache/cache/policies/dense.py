"""dense: keep every token. Exact: the result equals the model's forward without a cache."""

from __future__ import annotations

import torch

from ... import kernels
from ...kernels import attention
from ..base import CacheSpec, LayerCache, Step, capacity_error
from ..snapshot import check_tensors, is_positions
from ..storages import make_storage

# Slots a dense layer allocates when made (all of them if its cache_length is smaller). It
# allocates more as it fills (``KVCache.allocate``), so that a cache_length set far beyond what a
# run reaches costs only what the run holds. (A storage that cannot grow, KIVI's, has every slot.)
FIRST_SLOTS = 256


class DenseCache(LayerCache):
    """Appends every token; a chunk that would exceed ``cache_length`` is rejected. Slots are
    allocated as the cache fills: ``cache_length`` is the most it may grow to."""

    name = "dense"
    description = "keep every token (exact; fails when cache_length is exceeded)"

    evicts = False
    chunking_invariant = True

    def __init__(self, spec: CacheSpec, options: object = None) -> None:
        super().__init__(spec, options)
        # Position p lives in slot p < cache_length: positions take the narrowest type holding them.
        self.storage = make_storage(spec, limit=spec.cache_length, slots=FIRST_SLOTS)

    def check(self, step: Step) -> None:
        if step.span_end > self.spec.cache_length:
            raise capacity_error(step, self.spec.cache_length, self.name)

    def allocated(self) -> int:
        return self.storage.k.shape[2] - 1

    def grow(self, tokens: int) -> None:
        slots = min(tokens, self.spec.cache_length)
        if slots > self.allocated():
            self.storage.grow(slots)

    def nbytes_at(self, tokens: int) -> int:
        slots = min(tokens, self.spec.cache_length)
        held = self.allocated()
        if slots <= held:
            return self.nbytes()
        # Every buffer of a storage that grows is laid out per slot: its bytes scale with the slots.
        return self.nbytes() // (held + 1) * (slots + 1)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: Step) -> torch.Tensor:
        if step.decode:
            return self.decode(q, k, v, step)
        T = step.num_tokens
        store = self.storage
        # Where a token's bits do not depend on where or when it is stored (``exact_roundtrip``),
        # a chunk attends the bits the cache keeps as plain tensors, at the cost of dense
        # attention: its own tokens read back from their codes once stored, the stored slots
        # decoded. Every later step reads the same numbers from the slots, so the
        # result does not depend on how the sequence is chunked. (KIVI keys change layout as
        # their group fills, and each query reads them as they were at its position: the
        # storage's ``attend_chunk`` attends such a chunk.)
        readback = store.exact_roundtrip and (T > 1 or not store.packed)
        # A quantized chunk is read back from its codes once written (below); one wider than the
        # cache's slots (padding past them) before, as storing it will code it.
        early = readback and (not store.packed or (step.fresh and T > self.allocated()))
        if early:
            k, v = store.roundtrip(k, v)  # storing them below stores the codes computed here
        if step.uniform:
            store.write_slice(step.start0, k, v, step.positions)
        else:
            store.write(self._append_slots(step), k, v, step.positions)
            # Padding went to the scratch slot: it holds no token (as after an evicting cache's write).
            store.empty_scratch()
        if step.fresh and readback:
            if not early:
                # The chunk read back from the codes just written (slot t holds token t): what
                # ``roundtrip`` gives, without holding the codes twice. (Padding reads its slot's
                # old contents, which no real query sees.)
                k, v = store.read_back(0, T)
            return attention.causal(q, k, v, window=self.spec.sliding_window, scores=self.spec.scores)
        if T > 1 and store.packed and not store.exact_roundtrip:
            return store.attend_chunk(q, step.positions, step.n_tokens, self.spec.sliding_window)
        span = step.span_end
        ks, vs, pos = store.view(span)
        if step.uniform and T > 1 and not store.packed and self.spec.sliding_window is None and self.spec.scores is None:
            # Every row holds positions [0, S) at slots [0, S) (a dense cache writes token t at
            # slot t) and the chunk follows them: no mask to build.
            return attention.after_prefix(q, ks, vs, step.positions, pos, step.start0)
        if readback and store.packed and self.spec.scores is None:
            # The stored slots decoded a block at a time, each through the fused kernel: never a
            # full-precision copy of the whole cache.
            return kernels.attend_decoded(q, ks, vs, step.positions, pos, window=self.spec.sliding_window)
        # A one-token step over a uniformly filled cache sees every slot, unless a model window cuts it.
        all_visible = step.uniform and T == 1 and (self.spec.sliding_window is None or span <= self.spec.sliding_window)
        return attention.masked(q, ks, vs, step.positions, pos, window=self.spec.sliding_window, all_visible=all_visible,
                                scores=self.spec.scores)

    def _append_slots(self, step: Step) -> torch.Tensor:
        """(B, T) the slot of each token of a chunk: its position, and padding's the scratch slot,
        which the step names as slot ``cache_length`` and is the last of the slots allocated."""
        held = self.allocated()
        return step.append_slot if held == self.spec.cache_length else step.append_slot.clamp(max=held)

    def decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: Step) -> torch.Tensor:
        # Position p lives in slot p. A captured step attends every slot, the empty and future
        # ones masked, so its shapes never change (the caller has checked that every position
        # fits, and allocated every slot: ``KVCache.allocate``); an eager step attends the slots
        # any row has filled, and rows filled alike (within the model's window) need no mask.
        if step.uniform:
            # Every row writes slot start0: a slice, cheaper than a scatter per buffer.
            self.storage.write_slice(step.start0, k, v, step.positions)
        else:
            self.storage.write(step.positions, k, v, step.positions)
        span = step.span_end if step.known else self.allocated()
        ks, vs, pos = self.storage.view(span)
        if step.uniform and (self.spec.sliding_window is None or span <= self.spec.sliding_window):
            visible = None
        else:
            visible = attention.visibility(step.positions, pos, None, 0, self.spec.sliding_window)[:, :, 0]  # (B, 1, S)
        return attention.decode(q, ks, vs, visible, scores=self.spec.scores)[0]

    # ----- slots as prefixes (the prefix store): slot p holds position p ---------------------
    def shares_prefixes(self) -> bool:
        """Whether a row's first n slots are the cache of its first n tokens whatever came after,
        so that any prefix of a stored row can be cut out of it: a token's bits do not depend on
        where it is placed, and every storage buffer is laid out per slot (neither is true of
        KIVI's per-channel key groups and residual: such a cache stores whole snapshots)."""
        slots = self.allocated() + 1
        per_slot = all(t.dim() >= 3 and t.shape[2] == slots for t in self.state().values())
        return self.storage.exact_roundtrip and per_slot

    def read_slots(self, row: int, start: int, stop: int) -> dict[str, torch.Tensor]:
        """Copies of row ``row``'s slots [start, stop), which hold positions start..stop-1: every
        storage buffer but the positions, name -> (1, Hkv, stop - start, ...)."""
        slots = self.allocated() + 1
        parts = {}
        for name, t in self.state().items():
            if t.dim() < 3 or t.shape[2] != slots:
                # A storage buffer not laid out per slot cannot be cut into prefixes.
                raise ValueError(f"dense storage buffer {name} of shape {tuple(t.shape)} has no slot axis (dim 2)")
            if name != "storage.pos":
                parts[name] = t[row : row + 1, :, start:stop].clone()
        return parts

    def write_slots(self, row: int, parts: dict[str, torch.Tensor]) -> None:
        """Make row ``row`` hold positions 0..n-1, their slots taken from ``parts`` (as
        ``read_slots`` gives them, n wide), and nothing after them. Checks everything first."""
        state = self.state()
        n = next(iter(parts.values())).shape[2] if parts else 0
        wanted = set(state) - {"storage.pos"}
        if set(parts) != wanted or n > self.spec.cache_length:
            raise ValueError(f"slots {sorted(parts)} of {n} tokens do not fit this dense layer "
                             f"({sorted(wanted)}, cache_length {self.spec.cache_length})")
        for name, t in parts.items():
            live = state[name]
            if t.dtype != live.dtype or tuple(t.shape) != (1, *live.shape[1:2], n, *live.shape[3:]):
                raise ValueError(f"{name}: slots of {t.dtype} {tuple(t.shape)} do not fit {live.dtype} "
                                 f"(1, {live.shape[1]}, {n}, ...)")
        self.grow(n)
        state = self.state()
        for name, t in parts.items():
            state[name][row : row + 1, :, :n].copy_(t)
        pos = self.storage.pos
        pos[row, :, :n] = torch.arange(n, device=pos.device)
        pos[row, :, n:] = -1

    # ----- snapshots: a row's slots past its tokens hold nothing, so a snapshot of another
    # cache's allocation restores here (as many slots as both have, the rest emptied) --------
    def check_state(self, state, rows: int) -> None:
        if not self.storage.grows:
            return super().check_state(state, rows)
        slots = {t.shape[2] for t in state.values() if isinstance(t, torch.Tensor) and t.dim() >= 3}
        live = self.state()
        if len(slots) == 1 and 0 < min(slots) <= self.spec.cache_length + 1:
            # The layer's buffers as they would be with the snapshot's slots (nothing allocated).
            live = {name: torch.empty((*t.shape[:2], min(slots), *t.shape[3:]), dtype=t.dtype, device="meta")
                    for name, t in live.items()}
        check_tensors(live, state, rows, f"the {self.name} layer")

    def load_state(self, state, rows: torch.Tensor) -> None:
        if not self.storage.grows:
            return super().load_state(state, rows)
        # Slot p holds position p: the rows' tokens take slots up to their highest position.
        self.grow(int(state["storage.pos"].max()) + 1)
        for name, t in state.items():
            live = self.state()[name]
            n = min(t.shape[2], live.shape[2]) - 1  # slots both have, the scratch slot aside
            index = rows.to(live.device)
            # (Positions of another integer type, checked to fit: an older snapshot's int64.)
            live[:, :, :n].index_copy_(0, index, t[:, :, :n].to(live.device, live.dtype))
            live[:, :, n:-1].index_fill_(0, index, -1 if is_positions(name) else 0)

    def reset(self) -> None:
        self.storage.reset()

    def nbytes(self) -> int:
        return self.storage.nbytes()
