"""kvzip: keep the keys the model needs to reconstruct the context (Kim et al. 2025, "KVzip:
Query-Agnostic KV Cache Compression with Context Reconstruction"; kvpress's KVzipPress).

A context's importance is measured without any question: the model is asked to repeat the
context (a repeat prompt, then the context again), and each context key scores the largest
attention weight any reconstruction query gives it, over the query heads of its K/V group. Each
K/V head then keeps its best-scored keys (the per-head budget; the paper also spreads budgets
unevenly over heads and layers, which this policy does not).

The scores need a second pass through the whole model, which a layer cache cannot make on its
own: ``kvcache.generation.reconstruction.prefill`` (and ``kvcache eval``) feed each context chunk followed by its
reconstruction as one call, with every layer told how many of the call's tokens are context
(``record``). In that call a layer attends the context causally, as any prefill would; the
reconstruction tokens attend the held slots, the context and each other, are scored, and are
never stored; then the layer keeps the ``cache_length - reserve`` best-scored candidates per head.
With a chunked context, keys held from earlier chunks keep the best score any pass gave them
(they compete with each new chunk's keys, as every kept token does in this library).

Tokens that arrive otherwise (a question, decoded tokens, or a prompt fed by plain ``generate``)
have no score. When the cache must evict and such tokens are present, the oldest of them goes
first (the newest token always stays): the compressed context is kept and a window slides over
what followed it. A prompt fed by plain ``generate`` is therefore kept as a window (plus
``sinks``); use ``kvcache.generation.reconstruction`` to compress by reconstruction.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass

import torch

from ...errors import KVCacheWarning
from ...kernels import attention
from ...kernels.visibility import visibility
from ..base import CacheSpec, Step
from ..candidates import Candidates
from ..evicting import PROTECTED, EvictingCache, check_context, require_room
from ..options import option

# Below every reconstruction score (a softmax weight, in [0, 1]): tokens no pass has scored.
UNSCORED = -1.0
# Scores are computed for at most this many (query head x query x key) weights at once.
SCORE_BLOCK = 1 << 22


@dataclass(frozen=True)
class KVzipOptions:
    sinks: int = option(4, "first tokens always kept (kvpress keeps 4)")

    def __post_init__(self) -> None:
        if self.sinks < 0:
            raise ValueError(f"sinks must be >= 0, got {self.sinks}")


class KVzipCache(EvictingCache):
    name = "kvzip"
    description = ("KVzip: keep the keys most attended while the model reconstructs the context "
                   "(query-agnostic; needs kvcache.generation.reconstruction's pass), per K/V head")
    Options = KVzipOptions
    per_head = True
    # score: the best reconstruction weight a token received; scored: 1 once a pass has scored it.
    stat_names = ("score", "scored")
    # Its scores come from kvcache.generation.reconstruction's reconstruction pass, which ``kvcache eval`` runs.
    reconstructs = True

    @classmethod
    def options_for_budget(cls, cache_length: int) -> dict[str, object]:
        return {"sinks": max(0, min(4, cache_length // 4))}

    def __init__(self, spec: CacheSpec, options: KVzipOptions) -> None:
        require_room(spec, "sinks", options.sinks)
        super().__init__(spec, options)
        # Tokens of the current call that are context; the rest reconstruct it (None: an ordinary call).
        self._context: int | None = None

    def record(self, context: int | None) -> None:
        """Make the next calls reconstruction calls whose first ``context`` tokens are context
        (``kvcache.generation.reconstruction`` does this around its pass); None makes calls ordinary again."""
        check_context(context)
        self._context = context

    def check(self, step: Step) -> None:
        if self._context is None:
            return
        if not step.uniform:
            raise ValueError("a kvzip reconstruction call takes rows of equal length without padding")
        if step.num_tokens <= self._context:
            raise ValueError(f"a kvzip reconstruction call has {step.num_tokens} tokens, not more than its "
                             f"{self._context} context tokens: the reconstruction is missing")

    def attend(self, q, k, v, step: Step) -> torch.Tensor:
        if self._context is None:
            if step.known and step.num_tokens > 1 and bool((self.held + step.n_tokens > self.spec.cache_length).any()):
                warnings.warn(
                    "a prompt chunk overflowed a kvzip cache outside its reconstruction pass, so it has no "
                    "scores: its oldest tokens are evicted first, as a window would. Compress a context with "
                    "kvcache.generation.reconstruction's prefill or generate (or kvcache eval) instead.",
                    KVCacheWarning, stacklevel=2)
            return super().attend(q, k, v, step)
        return self._reconstruct(q, k, v, step, self._context)

    def priority(self, c: Candidates) -> torch.Tensor:
        scored = c.stats["scored"] > 0
        prio = torch.where(scored, c.stats["score"], UNSCORED)
        # An unscored newest token stays: it was just attended, and dropping it would leave a gap.
        prio = prio.masked_fill(~scored & (c.positions == c.newest), PROTECTED)
        if self.options.sinks:
            prio = prio.masked_fill((c.positions >= 0) & (c.positions < self.options.sinks), PROTECTED)
        return prio

    def keep_best(self, source: KVzipCache, step: Step) -> None:
        """Fill this empty layer from ``source``, the same layer of a cache that a reconstruction
        pass scored while keeping every token (``kvcache.generation.reconstruction.score``): its tokens are the
        candidates, ranked under this layer's budget and options, so the layer keeps what its
        own pass over the same context would. ``step``: the context as one chunk into this
        layer's (reset) cache. Full-precision storages only."""
        if self.storage.packed or source.storage.packed:
            raise ValueError("keep_best moves tokens as tensors: both layers need a full-precision storage")
        if bool((self.held > 0).any()):
            raise ValueError("keep_best fills an empty layer; reset the cache first")
        n = step.num_tokens
        if not bool((source.held == n).all()):
            raise ValueError(f"the source layer holds {source.held.tolist()} tokens, not the context's {n}: "
                             "it must be scored by a pass that kept every token (kvcache.generation.reconstruction.score)")
        ks, vs, pos = source.storage.view(n)
        stats = {name: s[:, :, :n].clone() for name, s in source.stats.items()}
        # No queries: kvzip ranks by the scores the pass stored (``priority``), never by a call's queries.
        no_queries = ks.new_zeros(ks.shape[0], 1, 0, ks.shape[3])
        self._keep(Candidates(ks, vs, pos, stats, no_queries, step, keeps=self._keeps(step)), stored=0)

    def _reconstruct(self, q, k, v, step: Step, n: int) -> torch.Tensor:
        """One reconstruction call: the chunk's first ``n`` tokens are context, the rest its
        reconstruction. Returns outputs for every token (the next layer needs them all); stores
        the best-scored held and context tokens. q (B, Hq, T, D); k, v (B, Hkv, T, D)."""
        C = self.spec.cache_length
        store = self.storage
        B, Hkv = k.shape[:2]
        k, v = store.roundtrip(k, v)
        chunk_pos = step.positions.unsqueeze(1).expand(-1, Hkv, -1)  # (B, Hkv, T)
        stored = 0 if step.fresh and n >= C else C
        cand_k, cand_v, cand_pos = self._candidates(k[:, :, :n], v[:, :, :n], chunk_pos[:, :, :n], stored)
        stats = {name: torch.cat((s[:, :, :stored], s.new_zeros(B, Hkv, n)), 2) for name, s in self.stats.items()}
        context_step = _context_step(step, n)
        c = Candidates(cand_k, cand_v, cand_pos, stats, q[:, :, :n], context_step, keeps=self._keeps(context_step))
        # Every key the call sees: the candidates, then the reconstruction's own.
        keys = torch.cat((c.keys, k[:, :, n:]), 2)
        values = torch.cat((c.values, v[:, :, n:]), 2)
        key_pos = torch.cat((cand_pos, chunk_pos[:, :, n:]), 2)
        if stored:
            out = attention.masked(q, keys, values, step.positions, key_pos, limit=self.spec.sliding_window,
                                   scores=self.spec.scores)
        else:
            # An empty cache: the call is causal attention over itself, the fused kernel's case.
            out = attention.causal(q, keys, values, limit=self.spec.sliding_window, scores=self.spec.scores)
        fresh = reconstruction_scores(q[:, :, n:].float(), keys.float(), step.positions[:, n:], key_pos,
                                      cand_pos.shape[2], self.spec.sliding_window)
        had = stats["scored"] > 0
        stats["score"].copy_(torch.where(had, torch.maximum(stats["score"], fresh), fresh))
        stats["scored"].copy_((cand_pos >= 0).float())
        self._keep(c, stored)
        return out


def reconstruction_scores(q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                          scored: int, limit: int | None = None) -> torch.Tensor:
    """(B, Hkv, scored): for each of the first ``scored`` keys, the largest softmax weight any
    query gives it, over the queries and the query heads of its K/V group. q (B, Hq, R, D) at
    positions q_pos (B, R); k (B, Hkv, S, D) at positions k_pos (B, Hp, S) (-1: empty). Each
    query's softmax runs over all the keys it may see (``visibility``: filled, not in its future,
    within the model's window ``limit``). Queries go in blocks, so at most about ``SCORE_BLOCK``
    weights exist at once."""
    B, Hq, R, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G = Hq // Hkv
    best = q.new_zeros(B, Hkv, scored)
    block = max(1, SCORE_BLOCK // max(1, B * Hq * S))
    kt = k.transpose(-1, -2)  # (B, Hkv, D, S)
    for start in range(0, R, block):
        stop = min(start + block, R)
        r = stop - start
        # The G query heads of a group as G * r rows of one product: a (G, r) batch against one
        # key matrix would copy it G times. Scaled in place: no second tensor of weights' size.
        qb = q[:, :, start:stop].reshape(B, Hkv, G * r, D)
        logits = (qb @ kt).mul_(D**-0.5).view(B, Hkv, G, r, S)
        seen = visibility(q_pos[:, start:stop], k_pos, None, 0, limit).unsqueeze(2)  # (B, Hp, 1, r, S)
        weights = logits.masked_fill_(~seen, float("-inf")).softmax(-1)
        best = torch.maximum(best, weights[..., :scored].amax(dim=(2, 3)))
    return best


def _context_step(step: Step, n: int) -> Step:
    """The call's step as if it had held the context (its first ``n`` tokens) alone: what the
    kept candidates are ranked under (each row's newest position, its token count)."""
    B = step.positions.shape[0]
    return dataclasses.replace(
        step, positions=step.positions[:, :n], valid=step.valid[:, :n], append_slot=step.append_slot[:, :n],
        last_index=torch.full_like(step.last_index, n - 1), newest=step.positions[:, n - 1],
        n_tokens=torch.full((B,), n, dtype=torch.long), span_end=step.start0 + n, decode=False, shared={},
    )
