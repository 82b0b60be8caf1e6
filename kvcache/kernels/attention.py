"""Attention kernels. Nothing here allocates a T x T mask or repeats grouped K/V heads.

Shapes used throughout:
    B batch, Hq query heads, Hkv key/value heads, G = Hq // Hkv, T query tokens, S key slots, D head_dim.

Paths:
    ``causal``   equal query/key spans (no cache, or the first chunk into an empty cache): fused SDPA
                 with ``is_causal=True``, which needs no mask tensor at all.
    ``masked``   queries against keys whose positions are data (a filled cache): the mask is derived
                 from positions for at most ``QUERY_BLOCK`` queries at a time, so extra memory is
                 O(min(T, QUERY_BLOCK) x S). Slots shared by all heads take one mask broadcast over
                 the heads and the kernel's grouped-head mode; per-head slots fold the grouped heads
                 into the query axis instead of repeating K/V: (B, Hq, T, D) -> (B, Hkv, G*T, D).
                 A dense decode step whose keys are all visible is a single fused call without a mask.
    ``masked_with_weights``  the same, with explicit softmax weights, reporting the attention each
                 key received (for policies that score tokens by it).
    ``decode``   one query per row with explicit weights (scoring policies, renumbered sinks).
A family's own scores rule (``model.scores.Scores``: Gemma 2's soft-capping, gpt-oss's learned
sink logits), passed as ``scores``, sends every path to the explicit softmax, which applies it.
Packed keys and values (a quantized storage's ``view``) go to ``kernels``, which attends over the
codes block by block with the same arguments and results; nothing here decodes them, but for a
call with a scores rule, which the packed kernels do not apply: those read the codes back first.
Decode never uses ``is_causal=True``: SDPA aligns that mask top-left, so a one-token query would
see only key 0.
"""

from __future__ import annotations

import torch

from .. import kernels
from ..model.scores import Scores
from .sdpa import sdpa, with_lse
from .visibility import visibility

# Plain softmax attention: no soft-capping, no sink logits.
PLAIN = Scores()

# Largest number of queries whose (query x key) mask and scores are materialised at once.
QUERY_BLOCK = 1024
# Keys per block of the weights ``after_prefix_with_weights`` recomputes.
KEY_BLOCK = 512
# Queries per block of a windowed span (``causal``): each block attends over its band of keys.
BAND_BLOCK = 256


def causal(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: int | None = None,
    sinks: int = 0,
    limit: int | None = None,
    q_sink: torch.Tensor | None = None,
    scores: Scores | None = None,
) -> torch.Tensor:
    """Causal self-attention over one span: query t and key t are both at position t.

    q: (B, Hq, T, D); k, v: (B, Hkv, T, D) -> (B, Hq, T, D). ``window``, ``sinks`` and ``limit``
    restrict what each query sees as in ``visibility`` (``window`` alone is model-level
    sliding-window attention). ``q_sink`` (B, Hq, T, D), if given, scores the keys at positions
    below ``sinks`` instead of q (renumbered sinks); it must equal q for the queries before the
    nearer of ``window`` and ``limit``.

    Those queries see every earlier key, so they take the fused causal kernel with no mask. The
    later ones go in blocks of ``BAND_BLOCK`` queries, each over the keys it can see at all (the
    sinks and the band from its first query's reach to its last query), with a mask built from
    positions: O(T x (window + BAND_BLOCK)) work rather than O(T x T). With ``scores`` every
    query takes the explicit softmax of ``masked_with_weights``.
    """
    B, Hq, T, D = q.shape
    if scores is not None:
        pos = torch.arange(T, device=q.device).expand(B, T)
        return masked_with_weights(q, k, v, pos, pos[:, None], None, window=window, sinks=sinks, limit=limit,
                                   q_sink=q_sink, in_order=True, scores=scores)[0]
    if kernels.is_packed(k):
        pos = torch.arange(T, device=q.device).expand(B, T)
        return kernels.attend(q, k, v, pos, pos[:, None], window=window, sinks=sinks, limit=limit, q_sink=q_sink)[0]
    Hkv = k.shape[1]
    gqa = Hq != Hkv
    reach = min([T] + [w for w in (window, limit) if w is not None])
    if reach >= T:
        return sdpa(q, k, v, is_causal=True, enable_gqa=gqa)
    pos = torch.arange(T, device=q.device)
    out = torch.empty_like(q)
    out[:, :, :reach] = sdpa(
        q[:, :, :reach], k[:, :, :reach], v[:, :, :reach], is_causal=True, enable_gqa=gqa)
    for start in range(reach, T, BAND_BLOCK):
        stop = min(start + BAND_BLOCK, T)
        n = stop - start
        low = start - reach + 1  # the oldest key any query of the block sees by recency
        S = min(sinks, low)  # sink keys that lie before the band
        keys = torch.cat((pos[:S], pos[low:stop]))
        kb = torch.cat((k[:, :, :S], k[:, :, low:stop]), dim=2)
        vb = torch.cat((v[:, :, :S], v[:, :, low:stop]), dim=2)
        vis = visibility(pos[None, start:stop].expand(B, n), keys.expand(B, 1, -1), window, sinks, limit)
        qb = q[:, :, start:stop]
        if q_sink is None:
            out[:, :, start:stop] = sdpa(qb, kb, vb, attn_mask=vis, enable_gqa=gqa)
            continue
        ns = S + max(0, min(sinks, stop) - low)  # keys below ``sinks``, a prefix of ``keys``
        bias = sink_bias(qb, q_sink[:, :, start:stop], kb, slice(0, ns)).masked_fill_(~vis, float("-inf"))
        out[:, :, start:stop] = sdpa(qb, kb, vb, attn_mask=bias, enable_gqa=gqa)
    return out



def after_prefix(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                 prefix: int) -> torch.Tensor:
    """A chunk of T queries over ``prefix`` slots that every one of them sees and, causally, its
    own T keys: what ``masked`` computes for such a chunk, without a mask.

    q (B, Hq, T, D); k, v (B, Hkv, S, D): slots [0, prefix) hold keys older than every query
    (all filled), slots [S - T, S) the chunk's own keys in order, any slots between are empty.
    q_pos (B, T), k_pos (B, Hp, S): the positions, as ``masked`` takes them, read only where no
    fused kernel gives the log-sum-exp (``sdpa.with_lse``: CUDA, autograd), which takes the
    masked call over the same views. -> (B, Hq, T, D).

    A dense cache's uniform chunk (token t in slot t) and a bounded cache's chunk after its kept
    slots are such chunks. The prefix is one fused call with no mask (the G query heads of a K/V
    head folded into the query axis, so the prefix is read once and never copied), the chunk's
    own part a causal call; the two are merged by their log-sum-exps. That is the work of a
    one-pass causal prefill's rows, where a mask over the whole span costs about twice as much
    on the CPU (every score masked, and the mask built per layer)."""
    T, S = q.shape[2], k.shape[2]
    if prefix == 0:
        return sdpa(q, k[:, :, S - T:], v[:, :, S - T:], is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
    merged = _merged(q, k, v, prefix)
    return masked(q, k, v, q_pos, k_pos) if merged is None else merged[0]


def after_prefix_with_weights(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                              k_pos: torch.Tensor, prefix: int, q_weight: torch.Tensor
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``after_prefix`` that also reports the attention each key received, as
    ``masked_with_weights`` does: q_weight (B, T) -> out (B, Hq, T, D), mass (B, Hkv, S) and
    seen (B, Hp, S) float32 (zero for the empty slots).

    The outputs are the fused calls' (with ``prefix`` 0, bit for bit the causal call of a dense
    prompt), and the mass is recomputed from their log-sum-exp: a query's weight on key s is
    exp(q . k_s / sqrt(D) - lse), so no softmax and no product with the values is repeated, and
    the weights exist for ``QUERY_BLOCK`` queries at a time. Where no fused kernel gives the
    log-sum-exp, the fused outputs and ``masked_with_weights``'s mass."""
    B, Hq, T, D = q.shape
    S = k.shape[2]
    merged = _merged(q, k, v, prefix)
    if merged is None:
        out = after_prefix(q, k, v, q_pos, k_pos, prefix)
        _, mass, seen = masked_with_weights(q, k, v, q_pos, k_pos, q_weight, outputs=False,
                                            in_order=prefix == 0 and S == T)
        return out, mass, seen
    out, lse = merged
    qw = q_weight.float()
    seen = qw.new_zeros(B, 1, S)
    seen[:, 0, :prefix] = qw.sum(1, keepdim=True)
    seen[:, 0, S - T:] = qw.flip(1).cumsum(1).flip(1)  # own key j is seen by queries j..T-1
    return out, _received(q, k, lse, prefix, qw), seen.repeat(1, k_pos.shape[1], 1)


def _merged(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int
            ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``after_prefix``'s fused calls: the outputs (B, Hq, T, D) and their log-sum-exp (B, Hq, T)
    float32, or None where ``with_lse`` has no kernel."""
    B, Hq, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G = Hq // Hkv
    # The chunk's own keys, one copy per query head: T of them, never the prefix.
    own = with_lse(q, k[:, :, S - T:].repeat_interleave(G, 1), v[:, :, S - T:].repeat_interleave(G, 1), is_causal=True)
    if own is None or prefix == 0:
        return own
    o1, l1 = with_lse(q.reshape(B, Hkv, G * T, D), k[:, :, :prefix], v[:, :, :prefix])
    (o1, l1), (o2, l2) = (o1.reshape(B, Hq, T, D), l1.reshape(B, Hq, T, 1)), (own[0], own[1][..., None])
    # Each part's softmax was normalized over its own keys: weigh each by its share of the total mass.
    top = torch.maximum(l1, l2)
    w1, w2 = (l1 - top).exp(), (l2 - top).exp()
    total = w1 + w2
    out = ((o1.float() * w1 + o2.float() * w2) / total).to(q.dtype)
    return out, (top + total.log()).squeeze(-1)


def _received(q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, prefix: int, qw: torch.Tensor) -> torch.Tensor:
    """(B, Hkv, S) float32: sum over queries t and the G heads of a group of qw[t] * the softmax
    weight of t on each key, from the log-sum-exp ``lse`` (B, Hq, T) of t's scores, for
    ``after_prefix``'s layout of ``k`` (B, Hkv, S, D); qw (B, T) float32.

    The weights of a block of queries are made ``KEY_BLOCK`` keys at a time: a block's weights
    then stay in the CPU's cache between the product that makes them, the exp and the sum
    (about half the time of one product over all the keys, at 4k keys)."""
    B, Hq, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G = Hq // Hkv
    mass = torch.zeros(B, Hkv, S, dtype=torch.float32, device=q.device)
    q = q * D**-0.5
    keys = k.transpose(-1, -2)
    for start in range(0, T, QUERY_BLOCK):
        stop = min(start + QUERY_BLOCK, T)
        n = stop - start
        qb = q[:, :, start:stop].reshape(B, Hkv, G * n, D)
        lb = lse[:, :, start:stop].reshape(B, Hkv, G * n, 1)
        wb = qw[:, start:stop].repeat(1, G)[:, None, None, :]  # (B, 1, 1, G*n), the queries' order in qb
        # The prefix, then the chunk's keys up to the block's last query (own key j at slot S - T + j).
        blocks = [(lo, min(lo + KEY_BLOCK, prefix)) for lo in range(0, prefix, KEY_BLOCK)]
        blocks += [(S - T + lo, S - T + min(lo + KEY_BLOCK, stop)) for lo in range(0, stop, KEY_BLOCK)]
        for lo, hi in blocks:
            weights = (qb @ keys[..., lo:hi]).float().sub_(lb).exp_()  # (B, Hkv, G*n, hi - lo)
            if hi > S - T + start:
                # Own keys after a query are its future.
                j = torch.arange(lo - (S - T), hi - (S - T), device=q.device)
                weights.view(B, Hkv, G, n, -1).masked_fill_(j > torch.arange(start, stop, device=q.device)[:, None], 0.0)
            mass[..., lo:hi] += (wb @ weights).squeeze(2)
    return mass


def masked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    *,
    window: int | None = None,
    sinks: int = 0,
    limit: int | None = None,
    all_visible: bool = False,
    scores: Scores | None = None,
) -> torch.Tensor:
    """Attention of queries at ``q_pos`` over key slots at ``k_pos`` (see ``visibility``).

    q: (B, Hq, T, D); k, v: (B, Hkv, S, D); q_pos: (B, T); k_pos: (B, Hp, S) -> (B, Hq, T, D).
    ``all_visible`` promises every key is visible to every query (a decode step over a dense,
    uniformly filled cache), which skips building the mask. ``scores``: see the module notes.
    """
    if scores is not None:
        return masked_with_weights(q, k, v, q_pos, k_pos, None, window=window, sinks=sinks, limit=limit,
                                   scores=scores)[0]
    if kernels.is_packed(k):
        return kernels.attend(q, k, v, q_pos, k_pos, window=window, sinks=sinks, limit=limit, all_visible=all_visible)[0]
    B, Hq, T, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    if all_visible and T == 1:
        # The decode step over a dense cache: one fused call, no mask, no copies.
        # reshape, never view, around the kernel: CUDA's kernels return (B, Hkv, G, D) as a view of a
        # (B, G, Hkv, D) buffer, and the rotated query of a batch need not be contiguous either.
        return sdpa(q.reshape(B, Hkv, G, D), k, v).reshape(B, Hq, 1, D)
    out = torch.empty_like(q)
    for start in range(0, T, QUERY_BLOCK):
        stop = min(start + QUERY_BLOCK, T)
        n = stop - start
        vis = None if all_visible else visibility(q_pos[:, start:stop], k_pos, window, sinks, limit)  # (B, Hp, n, S)
        if vis is None or vis.shape[1] == 1:
            # Slots shared by all heads: one (B, 1, n, S) mask broadcast over the query heads, and
            # the kernel's own grouped-head support (about 1.8 times as fast on CPU as the folded
            # layout below, whose mask must be copied G times).
            out[:, :, start:stop] = sdpa(
                q[:, :, start:stop], k, v, attn_mask=vis, enable_gqa=G > 1)
            continue
        # Per-head slots: fold the G query heads that share a K/V head into the query axis,
        # (B, Hkv, G*n, D), so each K/V head's mask applies to its own queries.
        qb = q[:, :, start:stop].reshape(B, Hkv, G * n, D)
        mask = vis.unsqueeze(2).expand(-1, -1, G, -1, -1).reshape(B, Hkv, G * n, -1)
        ob = sdpa(qb, k, v, attn_mask=mask)
        out[:, :, start:stop] = ob.reshape(B, Hq, n, D)  # not view: CUDA lays ob out as (B, G*n, Hkv, D)
    return out


def masked_with_weights(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    q_weight: torch.Tensor | None,
    *,
    window: int | None = None,
    sinks: int = 0,
    limit: int | None = None,
    q_sink: torch.Tensor | None = None,
    outputs: bool = True,
    in_order: bool = False,
    scores: Scores | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """``masked`` attention that also reports how much attention each key received.

    q_weight: (B, T) float weight of each query in the totals (0 for padding or for queries a
    policy does not listen to). Returns
        out:   (B, Hq, T, D) attention outputs (None with ``outputs=False``: the caller wants the
               totals alone, and the weights are not multiplied into the values),
        mass:  (B, Hkv, S) float32, sum over queries t and the G heads of a group of
               q_weight[t] * softmax weight(t -> s),
        seen:  (B, Hp, S) float32, sum over queries of q_weight[t] * [s visible to t].
    ``q_sink`` (B, Hq, T, D), if given, replaces q when scoring keys at positions < ``sinks``:
    queries rotated to renumbered positions (attention sinks, see ``cache.policies.sink``).
    ``in_order`` promises that key slot s holds position s and query t is at position t (a
    prompt alone in an empty cache): a block of queries then reads only the slots up to its
    last query, as no later one is visible to it (about half the work of a long prompt).
    ``scores`` is the family's rule (soft-capping, sink logits; None: plain softmax); with sink
    logits the mass a query gives the keys sums to less than one. ``q_weight`` None: the outputs
    alone, with a scores rule (the attention of a family whose softmax SDPA cannot compute); the
    totals are then not summed and come back None.
    The softmax weights exist only for ``QUERY_BLOCK`` queries at a time.
    """
    if kernels.is_packed(k) and scores is not None:
        k, v = _decoded(k, v)
    if q_weight is None and scores is None:
        raise ValueError("masked_with_weights: q_weight=None (outputs alone) is for a scores rule; without one "
                         "take masked, the fused kernel")
    if kernels.is_packed(k):
        out, mass, seen = kernels.attend(q, k, v, q_pos, k_pos, window=window, sinks=sinks, limit=limit,
                                         q_weight=q_weight, q_sink=q_sink)
        return (out if outputs else None), mass, seen
    B, Hq, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G = Hq // Hkv
    scale = D**-0.5
    rule = PLAIN if scores is None else scores
    out = torch.empty_like(q) if outputs else None
    totals = q_weight is not None
    mass = torch.zeros(B, Hkv, S, dtype=torch.float32, device=q.device) if totals else None
    seen = torch.zeros(B, k_pos.shape[1], S, dtype=torch.float32, device=q.device) if totals else None
    kt = k.transpose(-1, -2)
    # The scale goes on the queries (n x D), not on the scores (n x S).
    q = q * scale
    if q_sink is not None:
        q_sink = q_sink * scale
    for start in range(0, T, QUERY_BLOCK):
        stop = min(start + QUERY_BLOCK, T)
        n = stop - start
        # The key slots the block reads: all, or (``in_order``) those up to its last query.
        R = min(stop, S) if in_order else S
        kp, kb = k_pos[..., :R], kt[..., :R]
        vis = visibility(q_pos[:, start:stop], kp, window, sinks, limit)  # (B, Hp, n, R)
        logits = q[:, :, start:stop].reshape(B, Hkv, G * n, D) @ kb  # (B, Hkv, G*n, R)
        if q_sink is not None:
            sink_scores = q_sink[:, :, start:stop].reshape(B, Hkv, G * n, D) @ kb
            logits = torch.where((kp < sinks).unsqueeze(2), sink_scores, logits)
        # Rows with no visible key (padding) get uniform or zero weights, never NaN; only padding
        # has one (a real query sees itself), and padding weighs 0 in the totals and its output
        # is never read. The logits are a fresh product (or cast) that the softmax may overwrite.
        weights = rule.softmax(logits.view(B, Hkv, G, n, R).float(), ~vis.unsqueeze(2))
        if outputs:
            ob = weights.to(v.dtype).view(B, Hkv, G * n, R) @ v[:, :, :R]
            out[:, :, start:stop] = ob.view(B, Hq, n, D)
        # Weighted sums over queries as matrix-vector products: (B, 1, 1, G*n) @ (B, Hkv, G*n, R).
        # (A reduction over the G and query axes of the 5-d weights is several times slower.)
        if not totals:
            continue
        qw = q_weight[:, start:stop].float()
        mass[..., :R] += (qw.repeat(1, G)[:, None, None, :] @ weights.view(B, Hkv, G * n, R)).squeeze(2)
        seen[..., :R] += (qw[:, None, None, :] @ vis.float()).squeeze(2)
    return out, mass, seen


def decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    visible: torch.Tensor | None,
    *,
    q_sink: torch.Tensor | None = None,
    sink_slots: int = 0,
    want_mass: bool = False,
    outputs: bool = True,
    scores: Scores | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """One query per row against S key slots.

    q: (B, Hq, 1, D); k, v: (B, Hkv, S, D); visible: (B, Hp, S) bool or None (all visible).
    ``outputs=False`` (with ``want_mass``) returns None for the outputs and never reads ``v``.
    ``q_sink`` (B, Hq, 1, D), if given, scores the first ``sink_slots`` slots instead of q
    (renumbered attention sinks; fused path only). Returns out (B, Hq, 1, D) and, with
    ``want_mass``, the attention each slot received summed over the G query heads of its group:
    (B, Hkv, S) float32, from explicit softmax weights. ``scores`` (the family's rule) takes the
    explicit path too.
    """
    if kernels.is_packed(k) and scores is not None:
        k, v = _decoded(k, v)
    if kernels.is_packed(k):
        out, mass = kernels.decode(q, k, v, visible, q_sink=q_sink, sink_slots=sink_slots, want_mass=want_mass)
        return (out if outputs else None), mass
    if not (outputs or want_mass):
        raise ValueError("decode: outputs=False asks for the attention mass alone; pass want_mass=True")
    B, Hq, _, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    qh = q.reshape(B, Hkv, G, D)
    if not want_mass and scores is None:
        # reshape, not view: CUDA's kernels return (B, Hkv, G, D) laid out as (B, G, Hkv, D).
        return _decode_fused(qh, k, v, visible, q_sink, sink_slots).reshape(B, Hq, 1, D), None
    if q_sink is not None and scores is None:
        raise ValueError("decode: q_sink (renumbered sinks) is not supported together with want_mass")
    # Three-dimensional bmm over (B * Hkv) groups: the 4-d matmul costs a few extra dispatches per
    # call, which is a visible share of a decode step of a small model. k, v are slot views whose
    # (B, Hkv) dimensions merge without a copy. The scale goes on the query, not the S scores.
    S = k.shape[2]
    k3 = k.reshape(B * Hkv, S, D)
    logits = torch.bmm(qh.reshape(B * Hkv, G, D) * D**-0.5, k3.transpose(1, 2))
    if q_sink is not None and sink_slots:
        # Renumbered sinks: the first slots scored by the queries rotated to their new positions.
        q3 = q_sink.reshape(B * Hkv, G, D) * D**-0.5
        logits[..., :sink_slots] = torch.bmm(q3, k3[:, :sink_slots].transpose(1, 2))
    hidden = None if visible is None else ~visible[:, :, None, None, :]  # (B, Hp, 1, 1, S)
    weights = (PLAIN if scores is None else scores).softmax(logits.view(B, Hkv, G, 1, S).float(), hidden)
    weights = weights.view(B, Hkv, G, S)
    if not outputs:
        return None, weights.sum(2)
    out = torch.bmm(weights.to(v.dtype).view(B * Hkv, G, S), v.reshape(B * Hkv, S, D))
    return out.view(B, Hq, 1, D), weights.sum(2)


def sink_bias(q: torch.Tensor, q_sink: torch.Tensor, k: torch.Tensor, cols: slice | torch.Tensor) -> torch.Tensor:
    """The float mask through which one fused call scores renumbered sinks with ``q_sink``: zero,
    plus ``(q_sink - q) . k_s / sqrt(D)`` on the sink columns ``cols``, which turns q's score of a
    sink into q_sink's. Only those few columns are computed apart; the caller adds -inf where a
    key is not visible. q, q_sink: (B, Hq, n, D); k: (B, Hkv, S, D); cols: a slice or (ns,) long
    index of the sink slots -> (B, Hq, n, S) in q's dtype."""
    B, Hq, n, D = q.shape
    Hkv = k.shape[1]
    delta = (q_sink - q).reshape(B, Hkv, -1, D) @ k[:, :, cols].transpose(-1, -2)  # (B, Hkv, G*n, ns)
    bias = q.new_zeros(B, Hq, n, k.shape[2])
    bias[..., cols] = delta.view(B, Hq, n, -1) * D**-0.5
    return bias


def _decoded(k, v) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Packed keys and values read back at the model's dtype: the packed kernels apply no scores
    rule, so a model with one (soft caps, sink logits) attends its codes decoded, at the cost of
    a full-precision copy of the slots per call."""
    return k.decoded(), None if v is None else v.decoded()


def _decode_fused(qh, k, v, visible, q_sink, sink_slots) -> torch.Tensor:
    """``decode`` without weights, as one fused call. qh: (B, Hkv, G, D) -> (B, Hkv, G, D).
    Renumbered sinks take ``sink_bias``."""
    B, Hkv, G, D = qh.shape
    mask = None if visible is None else visible.unsqueeze(2)  # (B, Hp, 1, S)
    if q_sink is not None and sink_slots:
        # The G query heads of a group as G queries of one head: the layout sink_bias takes.
        bias = sink_bias(qh.reshape(B, Hkv * G, 1, D), q_sink, k, slice(0, sink_slots)).view(B, Hkv, G, -1)
        mask = bias if mask is None else bias.masked_fill(~mask, float("-inf"))
    return sdpa(qh, k, v, attn_mask=mask)
