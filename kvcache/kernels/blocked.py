"""Attention over packed codes, one block of slots at a time (any device; the CPU path).

Keys and values stay packed: each block of slots (1-4 MiB of float32) is converted from codes
to float32 (the scales go on queries, weights and scores, see packed.py), scored, and folded into an online
softmax (running max m, running sum l, running output), so extra memory follows the block and
the query block, never the cache. Grouped query heads are folded into the query axis,
(B, Hq, T, D) -> (B, Hkv, G * T, D): every K/V head is read once for its G query heads and
never repeated. Masks come from positions (or a given visibility vector) one block at a time.

A decode step scores a span of blocks at a time (``SPAN`` slots) before folding it into the
online softmax, so that per-token scales apply to a whole span of scores at once; with the
attention mass it keeps the scores (G per slot) and normalises them at the end. A chunk keeps
one block of scores per query block; for the attention mass it sweeps the blocks a second time
with the final max and sum.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..quant.packed import CHANNEL, RESIDUAL, TOKEN, PackedKeys, PackedValues, as_float, rotated
from ..runtime import devices
from .visibility import visibility

# Slots converted from codes at a time: as many as make BLOCK_BYTES of float32 over the rows and
# K/V heads in a chunk (256 slots for 8 heads of 128 channels; a query block's scores against a
# block exist at once), DECODE_BLOCK_BYTES in a decode step (1024 slots), between MIN_BLOCK and
# BLOCK, and a multiple of the KIVI key group. Measured on the project's CPU at 16k slots
# (benchmarks/quantized.py): 4 MiB blocks decode 8-bit 10-15% and 4-bit 25% faster than 1 MiB
# ones (fewer, larger ops), 8 MiB ones no faster, and 16 MiB ones, which leave the cache, 1.5x
# slower. Fewer heads or channels take longer blocks, so the per-block overhead of small models
# stays small.
BLOCK = 4096
MIN_BLOCK = 64
BLOCK_BYTES = 2**20
DECODE_BLOCK_BYTES = 2**22
# Queries whose scores against one block of slots exist at a time.
QUERY_BLOCK = 256
# Slots of a decode step whose scores exist at a time: at least SPAN, more while their scores
# (G query heads per slot and row) take at most SPAN_BYTES (4096 slots for 32 query heads; the
# whole of 16k slots for 4 query heads, whose spans would otherwise cost more in per-span
# operations than in arithmetic).
SPAN = 4096
SPAN_BYTES = 2**19


def _blocks(k: PackedKeys, block_bytes: int = BLOCK_BYTES) -> list[tuple[int, int]]:
    """Slot ranges: the packed slots in blocks of about ``block_bytes`` of float32, aligned to
    key groups, then the tail."""
    B, H, S, D = k.codes.shape[0], k.codes.shape[1], k.slots, k.head_dim
    step = max(MIN_BLOCK, min(BLOCK, block_bytes // (4 * B * H * D)))
    if k.group:
        step = max(k.group, step // k.group * k.group)
    spans = [(s, min(s + step, S)) for s in range(0, S, step)]
    total = k.shape[2]
    spans += [(s, min(s + step, total)) for s in range(S, total, step)]
    return spans


def _presence(k: PackedKeys, blocks: list[tuple[int, int]]) -> list[tuple[bool, bool, bool]] | list[None]:
    """For each block of a KIVI view, whether it holds CHANNEL, TOKEN and RESIDUAL keys: one host
    read per call rather than several per block (None for blocks of other views, and where a host
    read is not free: then every branch is computed)."""
    if k.mode is None or not devices.host_reads_free(k.mode):
        return [None] * len(blocks)
    S = k.slots
    edges = torch.tensor([min(s0, S) for s0, _ in blocks] + [S], device=k.mode.device)
    present = []
    for mode in (CHANNEL, TOKEN, RESIDUAL):
        counts = torch.nn.functional.pad((k.mode == mode).flatten(0, 1).any(0).cumsum(0), (1, 0))
        present.append(counts[edges])
    rows = torch.stack(present).diff(dim=1).gt(0).T.tolist()
    return [tuple(r) for r in rows]


def _scores(k: PackedKeys, q: torch.Tensor, q_pos: torch.Tensor | None, s0: int, s1: int,
            work: torch.Tensor | None = None, present=None) -> torch.Tensor:
    """q (B, H, R, D) float32 against slots [s0, s1) (packed or tail): (B, H, R, s1 - s0)."""
    S = k.slots
    if s0 >= S:
        return q @ k.tail[:, :, s0 - S : s1 - S].float().transpose(-1, -2)
    return k.scores(q, q_pos, s0, s1, work, present)


def _mix(v: PackedValues, p: torch.Tensor, s0: int, s1: int, q_pos: torch.Tensor | None,
         work: torch.Tensor | None = None, present=None) -> torch.Tensor:
    S = v.slots
    if s0 >= S:
        return p @ v.tail[:, :, s0 - S : s1 - S].float()
    return v.mix(p, s0, s1, q_pos, work, present)


def _work(q: torch.Tensor, k: PackedKeys, blocks: list[tuple[int, int]]) -> torch.Tensor:
    """A float32 buffer (B, H, rows, D) to convert a block's codes into: rows for the widest
    block, rounded up to whole KIVI groups, so that per-channel scores read a partial last
    group's missing slots from the rows past it instead of copying the block (PackedKeys)."""
    rows = max(s1 - s0 for s0, s1 in blocks)
    if k.group:
        rows = -(-rows // k.group) * k.group
    return q.new_empty(q.shape[0], k.codes.shape[1], rows, k.head_dim, dtype=torch.float32)


def _plain(x) -> bool:
    """Per-token codes with one scale per token and head, and nothing appended: a decode step
    can apply every scale once, to all scores (or weights) together."""
    return x.tail is None and getattr(x, "mode", None) is None and x.meta.shape[-1] == 2


def _fold(x: torch.Tensor, H: int) -> torch.Tensor:
    """(B, Hq, T, D) -> (B, H, G * T, D), query head h * G + g of token t at row g * T + t."""
    B, Hq, T, D = x.shape
    return x.reshape(B, H, (Hq // H) * T, D)


def _rows(x: torch.Tensor, G: int) -> torch.Tensor:
    """A per-query (B, ..., T, S) tensor repeated for the G heads of a group: (B, ..., G * T, S)."""
    return x.unsqueeze(-3).expand(*x.shape[:-2], G, *x.shape[-2:]).flatten(-3, -2)


class _Softmax:
    """Online softmax state over key blocks for (B, H, R) query rows."""

    def __init__(self, B: int, H: int, R: int, D: int, device: torch.device) -> None:
        self.m = torch.full((B, H, R, 1), float("-inf"), device=device)
        self.l = torch.zeros(B, H, R, 1, device=device)
        self.acc = torch.zeros(B, H, R, D, device=device)

    def add(self, scores: torch.Tensor, v: PackedValues, s0: int, s1: int, q_pos: torch.Tensor | None,
            work: torch.Tensor | None = None, present=None) -> None:
        """Fold in the scores (B, H, R, s1 - s0) of slots [s0, s1)."""
        self.fold(scores, lambda p: _mix(v, p, s0, s1, q_pos, work, present))

    def fold(self, scores: torch.Tensor, mix) -> None:
        """Fold in ``scores`` (B, H, R, n); ``mix(p)`` sums their values weighted by p (B, H, R, n)."""
        m = torch.maximum(self.m, scores.amax(-1, keepdim=True))
        # Rows that have seen no visible key yet keep max -inf: shift them by 0 instead.
        m_safe = torch.where(torch.isinf(m), 0.0, m)
        p = torch.exp(scores - m_safe)
        alpha = torch.exp(self.m - m_safe)
        self.l = self.l * alpha + p.sum(-1, keepdim=True)
        self.acc = self.acc * alpha + mix(p)
        self.m = m

    def out(self) -> torch.Tensor:
        # A row with no visible key (padding) gets 0, not NaN; its output is never read.
        return self.acc / self.l.clamp(min=torch.finfo(torch.float32).tiny)

    def weights(self, scores: torch.Tensor) -> torch.Tensor:
        """Normalised softmax weights of ``scores`` (masked entries -inf) under the final state."""
        m_safe = torch.where(torch.isinf(self.m), 0.0, self.m)
        return torch.exp(scores - m_safe) / self.l.clamp(min=torch.finfo(torch.float32).tiny)


def attend(
    q: torch.Tensor,
    k: PackedKeys,
    v: PackedValues,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    *,
    window: int | None = None,
    sinks: int = 0,
    limit: int | None = None,
    all_visible: bool = False,
    q_weight: torch.Tensor | None = None,
    q_sink: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Queries at ``q_pos`` against packed slots at ``k_pos``, as ``attention.masked`` (and,
    with ``q_weight``, ``attention.masked_with_weights``).

    q: (B, Hq, T, D); q_pos: (B, T); k_pos: (B, Hp, S); visibility as ``visibility.visibility``.
    ``q_sink`` (B, Hq, T, D) scores keys at positions below ``sinks`` instead of q.
    Returns out (B, Hq, T, D) and, with ``q_weight`` (B, T), mass (B, Hkv, S) and seen (B, Hp, S)
    as ``masked_with_weights`` defines them (else None, None).
    """
    B, Hq, T, D = q.shape
    H = k.shape[1]
    if k.shape[2] == 0:
        # No slot at all (a chunk of padding alone into an empty cache): nothing is attended,
        # as with the full-precision kernels.
        if q_weight is None:
            return torch.zeros_like(q), None, None
        return (torch.zeros_like(q), q.new_zeros(B, H, 0, dtype=torch.float32),
                q.new_zeros(B, k_pos.shape[1], 0, dtype=torch.float32))
    G = Hq // H
    blocks = _SlotBlocks(q, k, k_pos, window=window, sinks=sinks, limit=limit, all_visible=all_visible,
                         sink_queries=q_sink is not None)
    scale = D**-0.5
    out = torch.empty_like(q)
    mass = seen = None
    if q_weight is not None:
        mass = torch.zeros(B, H, k.shape[2], device=q.device)
        seen = torch.zeros(B, k_pos.shape[1], k.shape[2], device=q.device)
    for t0 in range(0, T, QUERY_BLOCK):
        t1 = min(t0 + QUERY_BLOCK, T)
        n = t1 - t0
        qb = _fold(q[:, :, t0:t1].float() * scale, H)  # (B, H, G * n, D)
        qs = None if q_sink is None else _fold(q_sink[:, :, t0:t1].float() * scale, H)
        queries = _Queries(qb, qs, q_pos[:, t0:t1], q_pos[:, t0:t1].repeat(1, G), G)
        live = blocks.live(int(q_pos[:, t0:t1].max()))
        state = _Softmax(B, H, G * n, D, q.device)
        for i in live:
            sc, _ = blocks.scores(i, queries)
            state.add(sc, v, *blocks.spans[i], queries.pos_rows, blocks.work, blocks.present[i])
        out[:, :, t0:t1] = state.out().view(B, Hq, n, D).to(q.dtype)
        if q_weight is not None:
            blocks.add_totals(mass, seen, state, queries, live, q_weight[:, t0:t1].float())
    return out, mass, seen


@dataclass
class _Queries:
    """One block of n queries of an ``attend`` call, the G query heads of a group folded into the
    rows: qb (B, H, G * n, D) float32, scaled; qs the same of ``q_sink`` (or None); q_pos (B, n)
    their positions, pos_rows (B, G * n) those of the rows."""

    qb: torch.Tensor
    qs: torch.Tensor | None
    q_pos: torch.Tensor
    pos_rows: torch.Tensor
    G: int


class _SlotBlocks:
    """The packed slots of an ``attend`` call in blocks (``_blocks``), as its query blocks read
    them: each block's lowest position (to skip the blocks a query block cannot see), and each
    block's scores, masked by visibility as ``visibility.visibility`` takes it.

    q: (B, Hq, T, D), the call's queries (the conversion buffer follows them); k: the packed keys
    at k_pos (B, Hp, S); ``sink_queries``: whether sink slots are scored by ``q_sink``."""

    def __init__(self, q: torch.Tensor, k: PackedKeys, k_pos: torch.Tensor, *, window: int | None,
                 sinks: int, limit: int | None, all_visible: bool, sink_queries: bool) -> None:
        self.k, self.k_pos = k, k_pos
        self.window, self.sinks, self.limit, self.all_visible = window, sinks, limit, all_visible
        self.spans = _blocks(k)
        self.present = _presence(k, self.spans)
        # Host-side bounds of each block's positions, to skip blocks no query of a query block can
        # see (the future half of a causal prefill): one device sync per call.
        kp = k_pos.long().masked_fill(k_pos < 0, torch.iinfo(torch.long).max)  # (stored positions may be narrower)
        self.lows = torch.stack([kp[..., s0:s1].amin() for s0, s1 in self.spans]).tolist()
        self.has_sink = [lo < sinks for lo in self.lows] if sink_queries else [False] * len(self.spans)
        self.work = _work(q, k, self.spans)

    def live(self, newest: int) -> list[int]:
        """The blocks holding a position at or before ``newest``, a query block's newest."""
        return [i for i, lo in enumerate(self.lows) if lo <= newest]

    def scores(self, i: int, queries: _Queries) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The queries' scores (B, H, G * n, m) against block ``i`` of m slots, -inf where a query
        does not see a slot, and that visibility (B, Hp, n, m) (None with ``all_visible``)."""
        s0, s1 = self.spans[i]
        k, k_pos, sinks = self.k, self.k_pos, self.sinks
        sc = _scores(k, queries.qb, queries.pos_rows, s0, s1, self.work, self.present[i])
        if self.has_sink[i]:
            sink_cols = (k_pos[..., s0:s1] < sinks).unsqueeze(2)  # (B, Hp, 1, m)
            sc = torch.where(sink_cols, _scores(k, queries.qs, queries.pos_rows, s0, s1, self.work, self.present[i]), sc)
        if self.all_visible:
            return sc, None
        vis = visibility(queries.q_pos, k_pos[..., s0:s1], self.window, sinks, self.limit)  # (B, Hp, n, m)
        return sc.masked_fill(~_rows(vis, queries.G), float("-inf")), vis

    def add_totals(self, mass: torch.Tensor, seen: torch.Tensor, state: _Softmax, queries: _Queries,
                   live: list[int], w: torch.Tensor) -> None:
        """Add to ``mass`` (B, Hkv, S) and ``seen`` (B, Hp, S) what the queries weighted by ``w``
        (B, n) float32 gave the ``live`` blocks: the blocks scored again, under the final state."""
        B, n = w.shape
        w_rows = w.repeat(1, queries.G)[:, None, None, :]  # (B, 1, 1, G * n)
        for i in live:
            s0, s1 = self.spans[i]
            sc, vis = self.scores(i, queries)
            mass[..., s0:s1] += (w_rows @ state.weights(sc)).squeeze(2)
            vis_f = torch.ones(B, 1, n, s1 - s0, device=mass.device) if vis is None else vis.float()
            seen[..., s0:s1] += (w[:, None, None, :] @ vis_f).squeeze(2)


def decode(
    q: torch.Tensor,
    k: PackedKeys,
    v: PackedValues,
    visible: torch.Tensor | None,
    *,
    q_sink: torch.Tensor | None = None,
    sink_slots: int = 0,
    want_mass: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One query per row against the packed slots, as ``attention.decode``.

    q: (B, Hq, 1, D); visible: (B, Hp, S) bool or None (all visible); ``q_sink`` scores slots
    [0, sink_slots). Returns out (B, Hq, 1, D) and, with ``want_mass``, the attention each slot
    received summed over the G query heads of its group: (B, Hkv, S) float32.

    The slots go in spans of ``SPAN`` slots or more (``SPAN_BYTES``): a span's blocks are
    scored (codes converted into one reused buffer, per-token scales applied to the span's
    scores at once), the span is
    folded into an online softmax, and its values are mixed block by block. With ``want_mass``
    each span's scores are kept (G per slot, as the mass itself is one per slot and K/V head)
    and normalised at the end.
    """
    B, Hq, _, D = q.shape
    H = k.shape[1]
    if k.shape[2] == 0:
        # No slot at all (a chunk of padding alone into an empty cache): nothing is attended,
        # as with the full-precision kernels.
        return torch.zeros_like(q), (q.new_zeros(B, H, 0, dtype=torch.float32) if want_mass else None)
    G = Hq // H
    scale = D**-0.5
    qr = q.float().reshape(B, H, G, D) * scale
    qs = None if q_sink is None else q_sink.float().reshape(B, H, G, D) * scale
    blocks = _blocks(k, DECODE_BLOCK_BYTES)
    present = dict(zip(blocks, _presence(k, blocks)))
    work = _work(q, k, blocks)
    plain = _plain(k) and _plain(v)
    # The plain path reads codes itself: in rotated codes' coordinates, the query goes in rotated
    # and the output comes out rotated back (quant/rotation.py).
    qk = rotated(qr, k.rotation) if plain else qr
    state = _Softmax(B, H, G, D, q.device)
    kept = []
    for span in _spans(blocks, max(SPAN, SPAN_BYTES // (4 * B * Hq))):
        a, b = span[0][0], span[-1][1]
        scores = torch.empty(B, H, G, b - a, device=q.device)
        for s0, s1 in span:
            if plain:
                # One scale and zero point per token: applied to the span's scores at once.
                scores[..., s0 - a : s1 - a] = qk @ as_float(k.codes[:, :, s0:s1], k.bits, work).transpose(-1, -2)
            else:
                # A decode query follows every group completion, so staged copies are never read.
                scores[..., s0 - a : s1 - a] = _scores(k, qr, None, s0, s1, work, present[s0, s1])
        if plain:
            scale_k, zero_k = k.meta[:, :, a:b].float().unbind(-1)  # (B, H, b - a)
            scores = scores * scale_k.unsqueeze(2) + qk.sum(-1, keepdim=True) * zero_k.unsqueeze(2)
        if qs is not None and a < sink_slots:
            n = min(sink_slots, b) - a
            scores[..., :n] = _scores(k, qs, None, a, a + n)
        if visible is not None:
            scores = scores.masked_fill(~visible[..., a:b].unsqueeze(2), float("-inf"))

        def mix(p: torch.Tensor, span=span, a=a, b=b) -> torch.Tensor:
            if not plain:
                return sum(_mix(v, p[..., s0 - a : s1 - a], s0, s1, None, work, present[s0, s1]) for s0, s1 in span)
            scale_v, zero_v = v.meta[:, :, a:b].float().unbind(-1)
            scaled = p * scale_v.unsqueeze(2)
            out = p @ zero_v.unsqueeze(-1)  # (B, H, G, 1): the zero points, for every channel
            for s0, s1 in span:
                out = out + scaled[..., s0 - a : s1 - a] @ as_float(v.codes[:, :, s0:s1], v.bits, work)
            return out if v.rotation is None else out @ v.rotation.transpose(-1, -2)

        state.fold(scores, mix)
        if want_mass:
            kept.append(scores)
    out = state.out().view(B, Hq, 1, D).to(q.dtype)
    return out, state.weights(torch.cat(kept, -1)).sum(2) if want_mass else None


def _spans(blocks: list[tuple[int, int]], slots: int) -> list[list[tuple[int, int]]]:
    """Consecutive blocks grouped into spans of at least ``slots`` slots (the last may be shorter)."""
    spans, current = [], []
    for block in blocks:
        current.append(block)
        if current[-1][1] - current[0][0] >= slots:
            spans.append(current)
            current = []
    return spans + ([current] if current else [])
