"""The machinery shared by bounded caches: attend over what is kept plus the new chunk, then keep
the ``cache_length`` candidates with the highest priority.

A policy is a subclass in its own file under policies/ (the registry finds it there) that says:
    ``priority(c)``       (B, Hp, N) float per candidate; the top ``cache_length`` stay;
    ``observe(c)``        what to remember from this call (optional): per-slot statistics from
                          the attention the cache computed anyway, or anything else in ``c``;
    ``lookback``/``sinks``  which candidates a query may see beyond causality (optional).
Both hooks receive one ``Candidates`` object (candidates.py): keys, values, positions and
statistics of the N tokens, and the call's queries. Hp is 1 when all K/V heads of a row keep the
same tokens (``per_head = False``) and Hkv when each head keeps its own. Empty candidates
(position -1) rank lowest whatever their priority says.

Occupied slots are always ``[0, held[b])`` for row b (``held`` is kept on the host). Three
paths, with the same semantics:
    decode  one token per row and no padding (``decode``, the one decode step of eager and
            compiled runs): the new token goes to the scratch slot ``cache_length``, attention
            runs over all ``cache_length + 1`` slots (a fixed shape), and the scratch slot is then
            moved over the lowest-priority slot (an empty one while the row is not full). No copy
            of the cache.
    append  every row has room for its chunk: nothing is evicted, the chunk is written after the
            held slots and attended in place, as a dense cache would. A policy whose scores are
            all made by the step that evicts (``observe_every_step = False``) skips the
            attention weights here, so a prompt costs what dense costs until the cache is full.
    chunk   anything else: candidates are the kept slots followed by the chunk (N = C + T);
            the top C are gathered back into the buffers.

``CacheSpec.reserve`` (R) makes eviction batched: a row that overflows keeps C - R tokens, not
C, and the next R tokens are appended without evicting (kvpress's "compress the context, then
let the cache grow" when R covers the question and answer). Its decode steps, and those of whole
blocks (blocks.py), take the append and chunk paths, decided on the host.
"""

from __future__ import annotations

import dataclasses
from abc import abstractmethod

import torch

from .. import kernels
from ..kernels import attention
from .base import CacheSpec, LayerCache, Step
from .blocks import keep_whole_blocks
from .candidates import Candidates
from .slots import put
from .storages import in_place, make_storage

# Added to a priority to make a candidate outrank every scored one (sinks, the recent window).
PROTECTED = 1e30
EMPTY = float("-inf")
# Mantissa bits a score keeps in ``coarse``: two scores that agree to 2**-12 (2.4e-4) relative tie.
TIE_BITS = 12


def coarse(score: torch.Tensor) -> torch.Tensor:
    """float32 ``score`` with its mantissa cut to ``TIE_BITS`` bits (toward zero; order kept).

    For a policy whose scores tie exactly in exact arithmetic (knorm: a token that comes twice
    has one key norm in the first layer, RoPE only rotates it): float rounding sets such scores
    apart by a few units in the last place, and which way depends on the kernels, which a GPU
    picks by shape, so a row would keep one token in a batch and the other alone. Cut, they are
    equal again and the ranking's tie rule (the newer is kept) decides. Rounding that straddles
    a cut is still possible, at about the ratio of the rounding to the cut (1e-7 / 2.4e-4 in
    float32)."""
    bits = score.float().view(torch.int32) & ~((1 << (23 - TIE_BITS)) - 1)
    return bits.view(torch.float32)


def rank_newest_first(prio: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Indices (..., N) of the candidates from the highest priority ``prio`` (..., N) down; ties
    go to the newer of ``positions`` (..., N), whatever the slot order (which differs between a
    row alone and in a ragged batch)."""
    by_age = positions.argsort(dim=-1, descending=True, stable=True)
    ranked = prio.gather(-1, by_age).sort(dim=-1, descending=True, stable=True).indices
    return by_age.gather(-1, ranked)


class EvictingCache(LayerCache):
    """A bounded layer cache that evicts by priority (see module docstring)."""

    name: str
    description: str
    per_head: bool = False
    # Names of per-slot float32 statistics (B, Hp, C + 1) carried along with the keys: ``stats``
    # by name, all held in one buffer.
    stat_names: tuple[str, ...] = ()
    # Whether ``observe`` needs attention mass; if not, attention uses the fused kernel and
    # ``observe`` is called every step without it.
    needs_attention: bool = False
    # Whether scores build up over steps (h2o's running sums), so that every step's attention
    # must be observed. When False, the step that evicts computes every score it ranks by
    # (tova: the newest query; snapkv: the prompt's window), and steps that only append skip
    # the attention weights.
    observe_every_step: bool = False
    # Whether ``reserve`` (batched eviction) applies; a ring, always full, has no use for it.
    supports_reserve: bool = True

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if isinstance(vars(cls).get("stats"), tuple):
            raise TypeError(f"{cls.__name__}: name per-slot statistics in stat_names, not stats "
                            "(stats is the dict of their buffers)")

    def __init__(self, spec: CacheSpec, options) -> None:
        super().__init__(spec, options)
        self.storage = make_storage(spec, per_head=self.per_head)
        # (B,) long, CPU: slots held per row, which are slots [0, held[b]).
        self.held = torch.zeros(spec.batch_size, dtype=torch.long)
        Hp = self.storage.pos.shape[1]
        # One buffer for all statistics, so the decode step clears and moves them in one call each.
        self._stat_buffer = torch.zeros(len(self.stat_names), spec.batch_size, Hp, spec.cache_length + 1,
                                        device=spec.device)
        # A policy that does not define ``observe`` (knorm) costs nothing to observe.
        self._observes = type(self).observe is not EvictingCache.observe

    @property
    def stats(self) -> dict[str, torch.Tensor]:
        """Each per-slot statistic by name, a (B, Hp, C + 1) float32 view of the one buffer.

        Made at each access rather than kept: a captured step whose inputs were the buffer and
        views of it would have inputs that alias one another, which AOTAutograd merges into a
        base of its own making, no static address, and inductor then runs the step without CUDA
        graphs. Views by indexing (not ``unbind``, whose views autograd forbids writing in place).
        """
        return {name: self._stat_buffer[i] for i, name in enumerate(self.stat_names)}

    # ----- what a policy defines -------------------------------------------------------------
    def lookback(self) -> int | None:
        """Furthest a query looks back (None: no limit besides the model's own window)."""
        return None

    def sinks(self) -> int:
        """Positions below this stay visible whatever ``window`` says."""
        return 0

    def _lookback(self) -> int | None:
        """The policy's ``window`` as attention applies it: with ``block > 1`` a query sees exactly
        the kept blocks and its own chunk (blocks.py), so no window."""
        return None if self.spec.block > 1 else self.lookback()

    def query_weight(self, step: Step) -> torch.Tensor:
        """(B, T) weight of each query in the attention mass that ``observe`` receives."""
        return step.valid.float()

    def observe(self, c: Candidates) -> None:
        """Update ``c.stats`` (or the policy's own state) from this call. Called after attention
        whenever the call computed ``c.mass`` (a policy that ``needs_attention``), and on every
        call, with ``c.mass`` None, for a policy that does not."""

    @abstractmethod
    def priority(self, c: Candidates) -> torch.Tensor:
        """(B, Hp, N) priority of each candidate; the highest ``cache_length`` stay. Empty slots
        (``c.positions`` -1) are ranked lowest by the caller, so a policy need not; ties go to
        the newer token."""

    # ----- shared machinery ------------------------------------------------------------------
    def _attend(self, q, k, v, q_pos, k_pos, step: Step, q_sink=None, observe: bool = True, outputs: bool = True,
                prefix: int | None = None):
        """Attention over candidates; returns out (None without ``outputs``) and, if the policy
        observes, mass and seen. ``prefix``: the leading slots of k every query sees (filled, all
        older than the chunk, whose own keys are the last T slots; ``attention.after_prefix``),
        or None where that is not known."""
        rule = dict(window=self._lookback(), sinks=self.sinks(), limit=self.spec.sliding_window, scores=self.spec.scores)
        # A prompt alone in an empty cache (the candidates are the chunk itself) takes renumbered
        # sinks on the fused path too (see ``_outputs``).
        alone = step.fresh and step.uniform and k.shape[2] == q.shape[2]
        prefix = self._unmasked(q, k, q_sink, 0 if alone else prefix)
        if not (observe and self.needs_attention) and (q_sink is None or alone):
            return (self._outputs(q, k, v, q_pos, k_pos, step, rule, q_sink, prefix) if outputs else None), None, None
        weight = self.query_weight(step)  # (B, T)
        if q_sink is None:
            # Every query's output comes from the fused kernel, and the explicit softmax runs for
            # the weights alone, over the listened queries: where a policy listens to a few
            # queries only (TOVA: the newest; SnapKV: its window), and for a prompt alone in an
            # empty cache whatever it listens to (h2o: every query). That prompt's outputs are
            # then the dense cache's, bit for bit, whichever policy scores it, so one dense
            # prefill of a context can fill every policy's cache (eval/shared.py).
            listened = weight.ne(0).any(0).nonzero().squeeze(1)  # (L,) indices into the chunk
            every = listened.numel() == q.shape[2]
            if every and prefix is not None:
                # Every query listened to, none masked but causally: the fused calls' outputs and
                # the weights recomputed from their log-sum-exp.
                out, mass, seen = attention.after_prefix_with_weights(q, k, v, q_pos, k_pos, prefix, weight)
                return (out if outputs else None), mass, seen
            if alone or 2 * listened.numel() <= q.shape[2]:
                out = self._outputs(q, k, v, q_pos, k_pos, step, rule, prefix=prefix) if outputs else None
                if not every:
                    q, q_pos, weight = q[:, :, listened], q_pos[:, listened], weight[:, listened]
                _, mass, seen = attention.masked_with_weights(
                    q, k, v, q_pos, k_pos, weight, outputs=False, in_order=alone and every, **rule)
                return out, mass, seen
        return attention.masked_with_weights(q, k, v, q_pos, k_pos, weight, q_sink=q_sink, outputs=outputs,
                                             in_order=alone, **rule)

    def _unmasked(self, q, k, q_sink, prefix: int | None) -> int | None:
        """``prefix`` where nothing but causality hides a slot from the chunk's queries (no window of
        the policy or the model, no scores rule, no renumbered sinks, plain tensors, more than one
        query), else None."""
        plain = (q_sink is None and self._lookback() is None and self.spec.sliding_window is None
                 and self.spec.scores is None and not kernels.is_packed(k) and q.shape[2] > 1)
        return prefix if plain else None

    def _outputs(self, q, k, v, q_pos, k_pos, step: Step, rule: dict, q_sink=None, prefix: int | None = None) -> torch.Tensor:
        """Attention outputs without weights: a prompt alone in an empty cache is causal
        attention (fused with no mask for its queries within any window's reach, banded for
        the rest); a chunk after ``prefix`` slots it sees in full is ``after_prefix``'s;
        anything else is masked. ``q_sink`` is supported on the first path only."""
        if step.fresh and step.uniform and k.shape[2] == q.shape[2]:
            return attention.causal(q, k, v, q_sink=q_sink, **rule)
        if prefix is not None:
            return attention.after_prefix(q, k, v, q_pos, k_pos, prefix)
        return attention.masked(q, k, v, q_pos, k_pos, **rule)

    @property
    def per_token(self) -> bool:
        """Whether decode steps take ``decode`` (one token over one victim). Batched eviction
        (``reserve``) and whole blocks decide on the host, step by step, whether to append or
        to evict several slots: their decode steps take the append and chunk paths."""
        return not self.spec.reserve and self.spec.block == 1

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: Step) -> torch.Tensor:
        return self._take(q, k, v, step)

    def absorb(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: Step) -> None:
        """``attend`` without the outputs where the chunk is ranked (the chunk path: what the
        policy scores and keeps is computed, the attention outputs are not); a subclass that
        attends its own way runs its ``attend``."""
        if type(self).attend is EvictingCache.attend:
            self._take(q, k, v, step, outputs=False)
        else:
            self.attend(q, k, v, step)

    def _take(self, q, k, v, step: Step, outputs: bool = True) -> torch.Tensor | None:
        """The path a chunk takes: a decode step's, appending while every row has room, else
        ranking (whose attention outputs ``outputs=False`` skips)."""
        if step.decode and self.per_token:
            return self.decode(q, k, v, step)
        if bool((self.held + step.n_tokens <= self.spec.cache_length).all()):
            return self._append(q, k, v, step)
        return self._chunk(q, k, v, step, outputs=outputs)

    def _append(self, q, k, v, step: Step, count: bool = True) -> torch.Tensor:
        """Every row has room for its chunk: write it after the held slots, attend in place.
        ``count``: add the chunk to ``held`` here (a decode step's count is ``advance_decode``'s)."""
        store, held = self.storage, self.held
        even = step.uniform and bool((held == held[0]).all())
        if even:
            h = int(held[0])
            store.write_slice(h, k, v, step.positions)
            self._stat_buffer[..., h : h + step.num_tokens] = 0.0
        else:
            # Padding goes to the scratch slot, whose statistics are cleared with the rest.
            t = torch.arange(step.num_tokens, device=k.device)
            slots = torch.where(step.valid, held.to(k.device)[:, None] + t, self.spec.cache_length)
            store.write(slots, k, v, step.positions)
            n, B, Hp, _ = self._stat_buffer.shape
            self._stat_buffer.scatter_(3, slots[None, :, None].expand(n, B, Hp, -1), 0.0)
            store.empty_scratch()
        after = held + step.n_tokens
        if count:
            self.held = after
        span = int(after.max())
        ks, vs, pos = store.view(span)
        if step.num_tokens > 1 and store.packed and store.exact_roundtrip:
            # A chunk attends decoded slots at the cost of full-precision attention: the same
            # numbers as reading the codes, since a token's bits do not depend on its slot.
            ks, vs = ks.decoded(), vs.decoded()
        observe = self.needs_attention and self.observe_every_step
        if step.decode and self._lookback() is None and self.spec.sliding_window is None:
            # Every held slot is in the past: only the empty ones of shorter rows are hidden, and
            # with equal rows none (then, without weights, this is the dense decode call).
            visible = None if even else pos >= 0
            out, mass = attention.decode(q, ks, vs, visible, want_mass=observe, scores=self.spec.scores)
            seen = 1.0 if visible is None else visible.float()
        else:
            # With equal rows, the held slots precede the chunk (slots [h, h + T)) and all are older.
            prefix = h if even and self.spec.block == 1 else None
            out, mass, seen = self._attend(q, ks, vs, step.positions, pos, step, observe=observe, prefix=prefix)
        stats = {name: s[:, :, :span] for name, s in self.stats.items()}
        self._observe(Candidates(ks, vs, pos, stats, q, step), mass, seen)
        return out

    def _observe(self, c: Candidates, mass: torch.Tensor | None, seen: torch.Tensor | float) -> None:
        """Show the policy this call: with the attention mass it asked for, or, if it needs none,
        every call. Statistics decide what is kept; they carry no gradient."""
        if not self._observes or (mass is None and self.needs_attention):
            return
        self.observe(dataclasses.replace(
            c, stored_keys=c.stored_keys.detach(), stored_values=c.stored_values.detach(),
            queries=c.queries.detach(), mass=None if mass is None else mass.detach(), seen=seen,
            # What the call already read back from packed views, not read again.
            _decoded={name: t.detach() for name, t in c._decoded.items()},
        ))

    def decode(self, q, k, v, step: Step) -> torch.Tensor:
        # The new token goes to the scratch slot, every slot is attended (a fixed shape), and the
        # lowest-priority slot takes the token. A row that is not full evicts an empty slot, the
        # first (as appending would choose), so this one path serves every step.
        C = self.spec.cache_length
        if step.known and int(self.held.max()) < C:
            # A host fact narrows the step: every row has room, so the slot this path would pick
            # is each row's first empty one. The token is written there and only the filled
            # slots are attended (the path below attends all C + 1), as a dense cache would.
            return self._append(q, k, v, step, count=False)
        store = self.storage
        store.write_slice(C, k, v, step.positions)
        self._stat_buffer[..., C] = 0.0
        ks, vs, pos = store.view(C + 1)
        # Once every row has seen C tokens no slot is empty (a captured step does not know).
        full = step.min_start >= C
        if self.lookback() is None and self.spec.sliding_window is None:
            # Only empty slots are hidden.
            visible = None if full else pos >= 0
        else:
            visible = attention.visibility(step.positions, pos, self.lookback(), self.sinks(), self.spec.sliding_window)[:, :, 0]
        out, mass = attention.decode(q, ks, vs, visible, want_mass=self.needs_attention, scores=self.spec.scores)
        c = Candidates(ks, vs, pos, self.stats, q, step)
        self._observe(c, mass, 1.0 if visible is None else visible.float())
        prio = self.priority(c)
        if not full:
            prio = prio.masked_fill(pos < 0, EMPTY)
        # Among equally low priorities evict the oldest, so what is kept depends on positions,
        # never on slot order (which differs between a row alone and in a ragged batch).
        lowest = prio == prio.amin(-1, keepdim=True)
        victim = torch.where(lowest, pos, torch.iinfo(pos.dtype).max).argmin(-1, keepdim=True)  # (B, Hp, 1)
        store.settle(victim, k, v, step.positions)
        if self.stat_names:
            put(self._stat_buffer, victim.unsqueeze(0), self._stat_buffer[..., C : C + 1].clone())
        return out

    def advance_decode(self) -> None:
        if self.per_token:
            self.held = (self.held + 1).clamp(max=self.spec.cache_length)

    def _chunk(self, q, k, v, step: Step, outputs: bool = True) -> torch.Tensor | None:
        C = self.spec.cache_length
        store = self.storage
        Hp = store.pos.shape[1]
        new_pos = torch.where(step.valid, step.positions, -1).unsqueeze(1).expand(-1, Hp, -1)
        # New tokens are attended as they will be stored, like the decode path (which reads them back).
        k, v = store.roundtrip(k, v)
        # An empty cache adds no candidates: a prompt that fills it is ranked on its own. (Not
        # with padding, whose values would then fill the slots left empty.)
        stored = 0 if step.fresh and step.uniform and step.num_tokens >= C else C
        cand_k, cand_v, cand_pos = self._candidates(k, v, new_pos, stored)
        stats = {
            name: torch.cat((s[:, :, :stored], s.new_zeros(s.shape[0], Hp, k.shape[2])), dim=2)
            for name, s in self.stats.items()
        }
        # The chunk attends the kept slots decoded (what reading their codes gives, at the cost of
        # full-precision attention); the candidates stay packed, so that ``keep`` moves the kept
        # slots' codes as they are and stores the chunk's as ``roundtrip`` computed them.
        c = Candidates(cand_k, cand_v, cand_pos, stats, q, step, keeps=self._keeps(step))
        # Rows holding the same count h, each in slots [0, h) (whole blocks may empty a head's slots
        # below it), see all of them: they are older than the chunk, which follows the stored slots.
        held = int(self.held[0])
        prefix = held if stored and self.spec.block == 1 and bool((self.held == held).all()) else None
        out, mass, seen = self._attend(q, c.keys, c.values, step.positions, cand_pos, step,
                                       self.sink_queries(q, step), outputs=outputs, prefix=prefix)
        self._observe(c, mass, seen)
        self._keep(c, stored)
        return out

    def _candidates(self, k, v, new_pos: torch.Tensor, stored: int) -> tuple:
        """Keys, values (B, Hkv, N, D) and positions (B, Hp, N) of the candidates: the first
        ``stored`` slots (0 or all C; packed as the storage holds them), then the new tokens k, v
        (B, Hkv, T, D) at ``new_pos`` (B, Hp, T)."""
        if not stored:
            return k, v, new_pos
        ks, vs, pos = self.storage.view(stored)
        pos = torch.cat((pos, new_pos), dim=2)
        if self.storage.packed:
            return ks.with_tail(k), vs.with_tail(v), pos
        return torch.cat((ks, k), dim=2), torch.cat((vs, v), dim=2), pos

    def _keeps(self, step: Step) -> torch.Tensor:
        """(B,) long, CPU: the tokens each row keeps after ``step``'s chunk: what it holds, or
        ``cache_length - reserve`` where the chunk overflows it (``Candidates.keeps``)."""
        total = self.held + step.n_tokens.cpu()
        C = self.spec.cache_length
        return torch.where(total > C, C - self.spec.reserve, total)

    def _keep(self, c: Candidates, stored: int) -> None:
        """Gather the top-priority ``cache_length`` candidates back into the buffers; the first
        ``stored`` candidates are the kept slots, the rest the chunk. A row that overflows keeps
        ``cache_length - reserve`` of them."""
        C = self.spec.cache_length
        cand_k, cand_v, cand_pos, stats, step = c.stored_keys, c.stored_values, c.positions, c.stats, c.step
        prio = self.priority(c).masked_fill(cand_pos < 0, EMPTY)
        total = self.held + step.n_tokens
        over = total > C
        if self.spec.block > 1:
            room = torch.where(over, C - self.spec.reserve, C)
            prio, kept = keep_whole_blocks(prio, cand_pos, self.spec.block, c.newest, room)
        keep = rank_newest_first(prio, cand_pos)[..., :C]  # (B, Hp, C), in rank order
        held = kept if self.spec.block > 1 else c.keeps
        if self.storage.keeps_in_place:
            # Survivors stay in their slots (KIVI keeps its per-channel key groups for keys that do
            # not move); the kept ranks still fill slots [0, held), the dropped ones follow.
            live = held.to(keep.device)[:, None, None].expand(-1, keep.shape[1], 1)
            keep, _ = in_place(keep, stored, live)
        self.storage.keep(cand_k, cand_v, cand_pos, keep, stored=stored)
        for name, s in self.stats.items():
            s[:, :, :C] = stats[name].gather(2, keep)
        self.held = held
        if self.spec.block > 1:
            # Slots hold the kept candidates first; each head's dropped ones (past its own count) are emptied.
            self.storage.pos[:, :, :C].masked_fill_(prio.gather(2, keep) == EMPTY, -1)
            return
        if self.spec.reserve and bool(over.any()):
            # Slots [0, held) hold the kept candidates: past a row's ``held`` are the ones it drops.
            dropped = torch.arange(C, device=cand_pos.device) >= self.held.to(cand_pos.device)[:, None, None]
            self.storage.pos[:, :, :C].masked_fill_(dropped, -1)

    def reset(self) -> None:
        self.storage.reset()
        self._stat_buffer.zero_()
        self.held.zero_()

    def state(self) -> dict[str, torch.Tensor]:
        """The storage's buffers, each statistic ``stat.{name}`` (B, Hp, C + 1) and ``held`` (B,)."""
        state = super().state()
        state.update({f"stat.{name}": s for name, s in self.stats.items()})
        state["held"] = self.held
        return state

    def nbytes(self) -> int:
        return self.storage.nbytes() + self._stat_buffer.numel() * self._stat_buffer.element_size()


def check_context(context: object) -> None:
    """Raise ValueError unless ``context`` is None or a positive number of tokens: the context
    part of a reconstruction call (kvcache.generation.reconstruction's pass; ``record``)."""
    if context is not None and (isinstance(context, bool) or not isinstance(context, int) or context <= 0):
        raise ValueError(f"context must be a positive number of tokens, got {context!r}")


def require_room(spec: CacheSpec, what: str, n: int, purpose: str = "") -> None:
    """Raise ValueError unless ``n`` always-kept tokens (``what``, e.g. "recent + sinks") leave
    room in what an overflowing row keeps (``cache_length - reserve``)."""
    room = spec.cache_length - spec.reserve
    if n >= room:
        reserve = f" - reserve ({spec.reserve})" if spec.reserve else ""
        raise ValueError(f"{what} ({n}) must be smaller than cache_length ({spec.cache_length}){reserve}{purpose}")
