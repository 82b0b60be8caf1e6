"""The worker side of scoring policies (snapkv, tova, knorm, keydiff, h2o): what each layer keeps.

vLLM frees blocks on its scheduler, from token counts, and one block table serves every layer;
a scoring policy decides on the worker, from keys and attention, and each layer (and, for a
per-head policy, each K/V head) keeps different tokens. The two meet through the contents of
the blocks rather than their ids: a scoring request's blocks are freed exactly as window's are
(the newest blocks that fit ``cache_length`` stay, rule.BlockRule), and at the end of every step
that evicts, each layer moves the blocks its policy keeps into the columns window keeps, per
K/V head. A column is the request's i-th block; after a move it holds, for each head, some kept
block of that head's tokens (RoPE was applied at their true positions, so where they sit does
not matter to attention). Nothing is passed back to the scheduler, and the kernel and the
attention metadata are window's.

What is kept is kvcache's own rule (cache/blocks.py) over kvcache's own policy code: at the end
of each call (a prompt chunk, or a generated token; rule.py) the policy's ``observe`` and
``priority`` get a ``Candidates`` of the tokens in the columns the call read (the blocks kept
before it and its own), with the attention mass of the queries the policy listens to, as
kvcache's model computes it for that call. A call that vLLM computes in several steps (a prompt
chunk recomputed after a preemption, in other chunks) keeps its listened queries until its last
part. Per request and layer the worker keeps the first position of the block in each live column
(per head) and the policy's per-token statistics, bounded by the budget.
"""

from __future__ import annotations

import bisect
import dataclasses

import torch

from ..cache.base import Step
from ..cache.blocks import EMPTY, keep_whole_blocks
from ..cache.candidates import Candidates
from ..kernels import attention
from .layout import read
from .rule import BlockRule
from .state import ENGINE, Row


@dataclasses.dataclass(frozen=True)
class Work:
    """One scoring request's part of a step: its row, rule, query rows ``[q_start, q_end)`` in
    the step's query tensor, the tokens it had seen and has seen after the part, its block ids by
    column (CPU, the worker's table row), and ``call``: the prompt call ``(start, end)`` the part
    belongs to, or None for generated tokens (each one a call)."""

    row: Row
    rule: BlockRule
    q_start: int
    q_end: int
    seen: int
    total: int
    table: torch.Tensor
    call: tuple[int, int] | None = None


@dataclasses.dataclass
class LayerState:
    """A request's state in one layer. Columns from ``first`` on: ``base`` (Hp, W) long, the
    first position of the block each column holds per head (columns past ``first + W`` hold
    their own positions); ``stats`` (S, Hp, W, N) float32, the policy's per-token statistics.
    ``pending``: the listened queries of a call computed so far in earlier steps, as
    (queries (1, Hq, L, D), positions (L,), weights (L,))."""

    first: int = 0
    policy: object = None  # the request's own policy instance, for a policy with state (rule.stateful)
    base: torch.Tensor | None = None
    stats: torch.Tensor | None = None
    pending: list = dataclasses.field(default_factory=list)


class Values:
    """The values of some blocks, read from the paged cache only if a policy asks for them
    (``decoded()``, as ``Candidates`` reads a packed view): h2o's value norms, expected_attention's
    value scaling. Scores need none, since they are the attention weights alone."""

    def __init__(self, kv_cache: torch.Tensor, blocks: torch.Tensor, isa: str) -> None:
        self.kv_cache, self.blocks, self.isa = kv_cache, blocks, isa

    def decoded(self) -> torch.Tensor:
        """(..., Hkv, M N, D) float32."""
        return read(self.kv_cache, self.blocks, self.isa, values=True).float()


def step_of(start: int, end: int) -> Step:
    """kvcache's Step for one request's tokens [start, end), as one call."""
    T = end - start
    positions = torch.arange(start, end)[None]
    return Step(positions=positions, valid=torch.ones(1, T, dtype=torch.bool), append_slot=positions,
                last_index=torch.tensor([T - 1]), newest=torch.tensor([end - 1]), start=torch.tensor([start]),
                n_tokens=torch.tensor([T]), fresh=start == 0, uniform=True, span_end=end, min_start=start,
                start0=start, decode=T == 1)


def evicts(rule: BlockRule, start: int, end: int) -> bool:
    """Whether the call [start, end) evicts: it read more than the rule keeps after it."""
    return rule.kept_blocks(end) != rule.read_by(end - 1, start)


def needed(work: Work) -> bool:
    """Whether ``work`` has anything to do on the worker: a call that evicts (or a part of one),
    and any call of a policy that observes every call (h2o's attention, expected_attention's
    queries). Most decode steps of snapkv, tova, knorm and keydiff have nothing to do."""
    policy = work.rule.policy
    if policy._observes and (policy.observe_every_step or not policy.needs_attention):
        return True
    if work.call is not None:
        return evicts(work.rule, *work.call)
    return evicts(work.rule, work.total - 1, work.total)


def parts(rule: BlockRule, row: Row, seen: int, total: int) -> list[tuple[int, int, tuple[int, int] | None]]:
    """[seen, total) cut into the parts of the calls it holds: ``(start, end, call)``, ``call``
    the prompt call (start, end) or None for generated tokens (scored together, one by one)."""
    P, calls = row.prompt, row.calls
    out = []
    t = seen
    while t < total:
        if t >= P:
            out.append((t, total, None))
            break
        i = bisect.bisect_right(calls, t)
        end = calls[i] if i < len(calls) else P
        out.append((t, min(total, end), (rule.call_start(t, P, calls), end)))
        t = min(total, end)
    return out


def after_step(layer_name: str, isa: str, query: torch.Tensor, kv_cache: torch.Tensor, works: list[Work]) -> None:
    """Score and move what each scoring request's policy keeps in this layer, after the kernel
    attended the step. query: (tokens, Hq, D); kv_cache: (num_blocks, Hkv, N, 2 D)."""
    observed: dict[int, list[Work]] = {}  # decode steps that only observe (h2o's), by rule
    for work in works:
        if _only_observes(work):
            observed.setdefault(id(work.rule), []).append(work)
            continue
        state = work.row.scores.get(layer_name)
        if state is None:
            state = work.row.scores[layer_name] = LayerState(policy=_own_policy(work.rule))
        _score(state, work, isa, query[work.q_start: work.q_end], kv_cache)
    for group in observed.values():
        _observe_decode(layer_name, group, isa, query, kv_cache)


def _own_policy(rule: BlockRule):
    """A fresh instance of the rule's policy for one request and layer, where the policy keeps
    state of its own (expected_attention's query moments, with the model's rotary
    frequencies); None where the rule's shared instance serves every request."""
    if not rule.stateful:
        return None
    if ENGINE.inv_freq is None:
        raise RuntimeError(f"kvcache vLLM plugin: the {rule.config.policy} policy needs the model's rotary "
                           "frequencies, and kvcache cannot read this model's config")
    return rule.config.layer(ENGINE.inv_freq)


def _only_observes(work: Work) -> bool:
    """Whether ``work`` is a decode step that evicts nothing, of a policy that observes every
    step's attention (h2o): all its layer does is add that attention to its statistics, which
    is done for all such requests at once."""
    rule, policy = work.rule, work.rule.policy
    if not (policy.observe_every_step and policy.needs_attention) or work.total - work.seen != 1:
        return False
    return work.call is None and not evicts(rule, work.total - 1, work.total)


def _observe_decode(layer_name: str, works: list[Work], isa: str, query: torch.Tensor, kv_cache: torch.Tensor) -> None:
    """The observing decode steps of requests under one rule, as one batch of rows: each row's
    query over the blocks it read (padded to the longest), with kvcache's decode attention."""
    rule = works[0].rule
    policy, N = rule.policy, rule.block
    Hkv = kv_cache.shape[1]
    Hp = Hkv if policy.per_head else 1
    columns = [list(rule.read_by(w.total - 1, w.total - 1)) for w in works]
    K = max(len(c) for c in columns)
    states = [w.row.scores.setdefault(layer_name, LayerState()) for w in works]
    ids = torch.stack([w.table[c + [c[-1]] * (K - len(c))] for w, c in zip(works, columns)])  # (R, K)
    keys = read(kv_cache, ids, isa).float()  # (R, Hkv, K N, D)
    values = Values(kv_cache, ids, isa)
    R = len(works)
    positions = torch.full((R, Hp, K * N), -1, dtype=torch.long)
    stats = torch.zeros(len(policy.stat_names), R, Hp, K * N)
    bases = []
    for r, (w, c, state) in enumerate(zip(works, columns, states)):
        base = _base(state, c, Hp, N)
        bases.append(base)
        pos = base[:, :, None] + torch.arange(N)
        positions[r, :, : len(c) * N] = torch.where(pos < w.total, pos, -1).reshape(Hp, -1)
        if policy.stat_names:
            stats[:, r, :, : len(c) * N] = torch.stack(_stats(state, policy, c, Hp, N)).reshape(-1, Hp, len(c) * N)
    q = torch.stack([query[w.q_start] for w in works]).float()[:, :, None]  # (R, Hq, 1, D)
    visible = positions >= 0
    _, mass = attention.decode(q, keys, None, visible, want_mass=True, outputs=False, scores=ENGINE.scores)
    step = Step(positions=torch.tensor([[w.seen] for w in works]), valid=torch.ones(R, 1, dtype=torch.bool),
                append_slot=torch.tensor([[w.seen] for w in works]), last_index=torch.zeros(R, dtype=torch.long),
                newest=torch.tensor([w.seen for w in works]), start=torch.tensor([w.seen for w in works]),
                n_tokens=torch.ones(R, dtype=torch.long), fresh=False, uniform=False,
                span_end=max(w.total for w in works), min_start=min(w.seen for w in works), start0=works[0].seen,
                decode=True)
    named = dict(zip(policy.stat_names, stats))
    policy.observe(Candidates(keys, values, positions, named, q, step, mass, visible.float()))
    for r, (c, state, base) in enumerate(zip(columns, states, bases)):
        _remember(state, c, base, {n: s[r : r + 1, :, : len(c) * N] for n, s in named.items()}, policy, Hp, N)


def _score(state: LayerState, work: Work, isa: str, query: torch.Tensor, kv_cache: torch.Tensor) -> None:
    """One request's part of a call in one layer (its queries (T, Hq, D)): at the end of a call
    that evicts or that the policy observes, run the policy over the blocks the call read; where
    it evicts, move the blocks kept into window's columns and keep their positions and
    statistics. A part that does not end its call keeps the queries the policy listens to."""
    rule = work.rule
    policy = state.policy or rule.policy
    N = rule.block
    seen, total = work.seen, work.total
    Hkv = kv_cache.shape[1]
    Hp = Hkv if policy.per_head else 1
    q = _queries(query)  # (1, Hq, T, D)
    if policy._observes and not policy.needs_attention:
        # Statistics of the queries alone (expected_attention): every call adds its own, so the
        # parts of a call and the tokens of a recompute add up as the calls they stand for.
        policy.observe(Candidates(None, None, torch.full((1, Hp, 0), -1), {}, q, step_of(seen, total)))
    call = _call_of(work)
    part = _Part(state, work, policy, call, isa, kv_cache)
    observes = policy._observes and policy.needs_attention and (policy.observe_every_step or call.evicting)
    if policy.needs_attention and (observes or call.evicting):
        state.pending.append(_listened(part, q))
    if total < call.end:
        return  # the call goes on in a later step
    pending, state.pending = state.pending, []
    if not (call.evicting or observes):
        return  # most calls of a policy that scores only when it evicts
    base = _base(state, call.columns, Hp, N)  # (Hp, K)
    c = _candidates(part, base, pending, q)
    if observes and c.mass is not None:
        policy.observe(c)
    if not call.evicting:
        _remember(state, call.columns, base, c.stats, policy, Hp, N)
        return
    _evict(part, c, base)


@dataclasses.dataclass(frozen=True)
class _Call:
    """The call a part of a request belongs to, as one layer scores it: tokens [start, end) as
    kvcache's ``step``, the columns it read (the blocks kept before it, then its own, consecutive)
    and whether it evicts."""

    start: int
    end: int
    step: Step
    columns: list[int]
    evicting: bool


@dataclasses.dataclass(frozen=True)
class _Part:
    """One request's part of a call in one layer, as ``_score`` handles it: the request's state in
    the layer, its ``Work``, the policy instance that scores it (the request's own or the rule's),
    the call the part belongs to, and the layer's paged cache (num_blocks, Hkv, N, 2 D) with the
    layout it is read in (``isa``)."""

    state: LayerState
    work: Work
    policy: object
    call: _Call
    isa: str
    kv_cache: torch.Tensor


def _call_of(work: Work) -> _Call:
    """The call ``work`` is a part of."""
    rule = work.rule
    if work.call is not None:
        # A prompt call [start, end): the blocks kept before it, then its own.
        start, end = work.call
        return _Call(start, end, step_of(start, end), list(rule.read_by(end - 1, start)), evicts(rule, start, end))
    # Generated tokens, each a call of its own. A step of several (a recompute after a
    # preemption, between two evictions) is scored as its tokens one by one: observed every
    # step, each query's attention adds up; scored only when evicting, the newest query's.
    start, end = work.total - 1, work.total
    return _Call(start, end, step_of(start, end), list(rule.read_by(start, start)), evicts(rule, start, end))


def _listened(part: _Part, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The queries of the part (q (1, Hq, T, D), at positions [seen, total)) the policy listens
    to, as ``LayerState.pending`` keeps them: (queries (1, Hq, L, D), positions (L,), weights (L,))."""
    policy, work, call = part.policy, part.work, part.call
    seen, total = work.seen, work.total
    if work.call is not None:
        weight = policy.query_weight(call.step)[0, seen - call.start: total - call.start]
        first = seen
    else:
        first = seen if policy.observe_every_step else total - 1
        weight = torch.cat([policy.query_weight(step_of(t, t + 1)) for t in range(first, total)], 1)[0]
    listened = weight.nonzero().flatten()
    heard = q[:, :, first - seen:][:, :, listened]
    return heard, first + listened, weight[listened]


def _candidates(part: _Part, base: torch.Tensor, pending: list, q: torch.Tensor) -> Candidates:
    """The tokens of the blocks the call read, as the policy's hooks take them: keys and values
    of its columns (K of them), positions (1, Hp, K N) from ``base`` (Hp, K) (-1 past the call's
    end), the statistics kept, the part's queries q (1, Hq, T, D) (at most the call's), and the
    attention mass of the ``pending`` listened queries (``LayerState.pending``)."""
    work, call, policy, isa, kv_cache = part.work, part.call, part.policy, part.isa, part.kv_cache
    Hp, N = base.shape[0], work.rule.block
    positions = base[:, :, None] + torch.arange(N)  # (Hp, K, N)
    positions = torch.where(positions < call.end, positions, -1).reshape(1, Hp, -1)
    keys = read(kv_cache, work.table[call.columns][None], isa).float()  # (1, Hkv, K N, D)
    values = Values(kv_cache, work.table[call.columns][None], isa)
    stats = {name: s.reshape(1, Hp, -1) for name, s in zip(policy.stat_names, _stats(part.state, policy, call.columns, Hp, N))}
    mass, seen_by = None, 1.0
    if policy.needs_attention:
        heard = torch.cat([h for h, _, _ in pending], 2)
        q_pos = torch.cat([p for _, p, _ in pending])[None]
        weight = torch.cat([w for _, _, w in pending])[None]
        _, mass, seen_by = attention.masked_with_weights(heard, keys, None, q_pos, positions, weight, outputs=False,
                                                         scores=ENGINE.scores)
    queries = q[:, :, -min(q.shape[2], call.end - call.start):]
    return Candidates(keys, values, positions, stats, queries, call.step, mass, seen_by)


def _evict(part: _Part, c: Candidates, base: torch.Tensor) -> None:
    """The eviction at the end of a call: per head, the blocks the policy keeps (by its priority
    over ``c``, whole blocks) move into the columns window keeps, oldest block first, the newest
    block staying in its column; the state keeps their positions (from ``base`` (Hp, K), the
    call's columns) and statistics."""
    work, policy, columns, end = part.work, part.policy, part.call.columns, part.call.end
    rule = work.rule
    N, C = rule.block, rule.cache_length
    Hp = base.shape[0]
    after = list(rule.kept_blocks(end))
    priority = policy.priority(c).masked_fill(c.positions < 0, EMPTY)
    priority, _ = keep_whole_blocks(priority, c.positions, N, end - 1, torch.tensor([C]))
    kept = (priority[0] == 0).view(Hp, len(columns), N).any(-1)  # (Hp, K) columns whose block stays
    newest = columns.index((end - 1) // N)
    targets = [i for i in after if i != columns[newest]]
    order = []  # per head: the candidate columns moved to ``targets``, oldest block first
    for h in range(Hp):
        chosen = [j for j in kept[h].nonzero().flatten().tolist() if j != newest]
        if len(chosen) != len(targets):
            raise RuntimeError(f"kvcache vLLM plugin: the {type(policy).name} policy kept {len(chosen)} blocks where "
                               f"vLLM keeps {len(targets)}")
        order.append(sorted(chosen, key=lambda j: int(base[h, j])) + [newest])
    _move(part.kv_cache, work.table, columns, targets + [columns[newest]], order, Hp)
    index = torch.tensor(order)  # (Hp, len(after))
    new_base = base.gather(1, index)
    new_stats = {name: s.view(Hp, len(columns), N).gather(1, index[..., None].expand(-1, -1, N))
                 for name, s in ((n, t[0]) for n, t in c.stats.items())}
    _remember(part.state, after, new_base, {n: s[None] for n, s in new_stats.items()}, policy, Hp, N)


def _queries(query: torch.Tensor) -> torch.Tensor:
    """A request's queries (T, Hq, D) as kvcache's attention takes them: (1, Hq, T, D) float32."""
    return query.float().transpose(0, 1)[None]


def _overlap(state: LayerState, columns: list[int], width: int) -> tuple[slice, slice]:
    """Where consecutive ``columns`` meet the ``width`` columns the state holds from ``first``:
    (slice of ``columns``, slice of the state's)."""
    lo, hi = max(columns[0], state.first), min(columns[-1] + 1, state.first + width)
    if lo >= hi:
        return slice(0, 0), slice(0, 0)
    return slice(lo - columns[0], hi - columns[0]), slice(lo - state.first, hi - state.first)


def _base(state: LayerState, columns: list[int], Hp: int, N: int) -> torch.Tensor:
    """(Hp, K) the first position held by each of ``columns`` (consecutive), per head."""
    out = (torch.arange(columns[0], columns[-1] + 1) * N).expand(Hp, -1).clone()
    if state.base is not None:
        mine, theirs = _overlap(state, columns, state.base.shape[1])
        out[:, mine] = state.base[:, theirs]
    return out


def _stats(state: LayerState, policy, columns: list[int], Hp: int, N: int) -> list[torch.Tensor]:
    """The policy's statistics over ``columns`` (consecutive): each (Hp, K, N), zero for a new
    column."""
    out = torch.zeros(len(policy.stat_names), Hp, len(columns), N)
    if state.stats is not None:
        mine, theirs = _overlap(state, columns, state.stats.shape[2])
        out[:, :, mine] = state.stats[:, :, theirs]
    return list(out)


def _remember(state: LayerState, columns: list[int], base: torch.Tensor, stats: dict, policy, Hp: int, N: int) -> None:
    """Keep ``base`` (Hp, K) and ``stats`` (name -> (1, Hp, K N)) for ``columns``, which are
    consecutive (window's kept blocks, or a prompt's)."""
    if columns != list(range(columns[0], columns[0] + len(columns))):
        raise RuntimeError(f"kvcache vLLM plugin: columns {columns} are not consecutive")
    state.first = columns[0]
    state.base = base
    state.stats = torch.stack([stats[name].reshape(Hp, len(columns), N) for name in policy.stat_names]) \
        if policy.stat_names else None


def _move(kv_cache: torch.Tensor, table: torch.Tensor, columns: list[int], targets: list[int],
          order: list[list[int]], Hp: int) -> None:
    """Copy, per head, the block in column ``columns[order[h][i]]`` to column ``targets[i]``.
    One head's block is one contiguous slab, whatever the kernel's layout inside it."""
    dst = table[targets]
    for h, chosen in enumerate(order):
        src = table[[columns[j] for j in chosen]]
        if torch.equal(src, dst):
            continue
        heads = slice(None) if Hp == 1 else h
        kv_cache[dst, heads] = kv_cache[src, heads].clone()
