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

What is kept is kvcache's own rule (cache/blocks.py) over kvcache's own policy code: the
policy's ``observe`` and ``priority`` get a ``Candidates`` of the tokens in the columns the step
read (the prompt whole at its end; afterwards the kept blocks and the step's own), with the
attention mass of the queries the policy listens to, as kvcache's model computes it. Prompt
chunks add their listened queries' mass as they come, so a chunked prompt scores as the prompt
in one call. Per request and layer the worker keeps the first position of the block in each
live column (per head) and the policy's per-token statistics, bounded by the budget after the
prompt.
"""

from __future__ import annotations

import dataclasses

import torch

from .. import attention
from ..cache.base import Step
from ..cache.blocks import EMPTY, keep_whole_blocks
from ..cache.candidates import Candidates
from .layout import read
from .rule import BlockRule
from .state import Row


@dataclasses.dataclass(frozen=True)
class Work:
    """One scoring request's part of a step: its row, rule, query rows ``[q_start, q_end)`` in
    the step's query tensor, the tokens it had seen and has seen after the step, and its block
    ids by column (CPU, the worker's table row)."""

    row: Row
    rule: BlockRule
    q_start: int
    q_end: int
    seen: int
    total: int
    table: torch.Tensor


@dataclasses.dataclass
class LayerState:
    """A request's state in one layer. Columns from ``first`` on: ``base`` (Hp, W) long, the
    first position of the block each column holds per head (columns past ``first + W`` hold
    their own positions); ``stats`` (S, Hp, W, N) float32, the policy's per-token statistics.
    While the prompt is computed, ``mass`` (Hkv, L) and ``seen`` (Hp, L) add up the attention of
    its listened queries."""

    first: int = 0
    base: torch.Tensor | None = None
    stats: torch.Tensor | None = None
    mass: torch.Tensor | None = None
    seen: torch.Tensor | None = None


def step_of(start: int, end: int) -> Step:
    """kvcache's Step for one request's tokens [start, end), as one call."""
    T = end - start
    positions = torch.arange(start, end)[None]
    return Step(positions=positions, valid=torch.ones(1, T, dtype=torch.bool), append_slot=positions,
                last_index=torch.tensor([T - 1]), newest=torch.tensor([end - 1]), start=torch.tensor([start]),
                n_tokens=torch.tensor([T]), fresh=start == 0, uniform=True, span_end=end, min_start=start,
                start0=start, decode=T == 1)


def after_step(layer_name: str, isa: str, query: torch.Tensor, kv_cache: torch.Tensor, works: list[Work]) -> None:
    """Score and move what each scoring request's policy keeps in this layer, after the kernel
    attended the step. query: (tokens, Hq, D); kv_cache: (num_blocks, Hkv, N, 2 D)."""
    for work in works:
        state = work.row.scores.setdefault(layer_name, LayerState())
        _one(state, work, isa, query[work.q_start: work.q_end], kv_cache)


def _one(state: LayerState, work: Work, isa: str, query: torch.Tensor, kv_cache: torch.Tensor) -> None:
    rule, policy = work.rule, work.rule.policy
    N, C, P = rule.block, rule.cache_length, work.row.prompt
    seen, total = work.seen, work.total
    Hkv = kv_cache.shape[1]
    Hp = Hkv if policy.per_head else 1
    if seen < P:
        # A prompt chunk: its listened queries' attention, over the prompt so far, adds up.
        if policy.needs_attention and (policy.observe_every_step or P > C):
            _add_prompt_mass(state, policy, _queries(query), work, isa, kv_cache, Hp)
        if total < P:
            return
        columns = list(range(-(-total // N)))
    else:
        columns = list(rule.read_by(total - 1, P))
    after = list(rule.kept_blocks(total))
    evicts = after != columns
    observes = policy._observes and (policy.observe_every_step or evicts or not policy.needs_attention)
    if not (evicts or observes):
        return  # most steps of a policy that scores only when it evicts
    step = step_of(0, total) if seen < P else step_of(seen, total)
    q = _queries(query)
    base = _base(state, columns, Hp, N)  # (Hp, K)
    positions = base[:, :, None] + torch.arange(N)  # (Hp, K, N)
    positions = torch.where(positions < total, positions, -1).reshape(1, Hp, -1)
    keys, values = read(kv_cache, work.table[columns], isa)
    keys, values = keys.float()[None], values.float()[None]  # (1, Hkv, K N, D)
    stats = {name: s.reshape(1, Hp, -1) for name, s in zip(policy.stat_names, _stats(state, policy, columns, Hp, N))}
    mass, seen_by = None, 1.0
    if policy.needs_attention and (observes or evicts):
        if step.fresh:
            mass = _natural(state.mass, positions, Hkv)
            seen_by = _natural(state.seen, positions, Hp)
        else:
            weight = policy.query_weight(step)
            _, mass, seen_by = attention.masked_with_weights(q, keys, values, step.positions, positions, weight)
    c = Candidates(keys, values, positions, stats, q, step, mass, seen_by)
    if observes and (mass is not None or not policy.needs_attention):
        policy.observe(c)
    state.mass = state.seen = None
    if not evicts:
        _remember(state, columns, base, stats, policy, Hp, N)
        return
    priority = policy.priority(c).masked_fill(positions < 0, EMPTY)
    priority, _ = keep_whole_blocks(priority, positions, N, total - 1, torch.tensor([C]))
    kept = (priority[0] == 0).view(Hp, len(columns), N).any(-1)  # (Hp, K) columns whose block stays
    newest = columns.index((total - 1) // N)
    targets = [i for i in after if i != columns[newest]]
    order = []  # per head: the candidate columns moved to ``targets``, oldest block first
    for h in range(Hp):
        chosen = [j for j in kept[h].nonzero().flatten().tolist() if j != newest]
        if len(chosen) != len(targets):
            raise RuntimeError(f"kvcache vLLM plugin: the {type(policy).name} policy kept {len(chosen)} blocks where "
                               f"vLLM keeps {len(targets)}")
        order.append(sorted(chosen, key=lambda j: int(base[h, j])) + [newest])
    _move(kv_cache, work.table, columns, targets + [columns[newest]], order, Hp)
    index = torch.tensor(order)  # (Hp, len(after))
    new_base = base.gather(1, index)
    new_stats = {name: s.view(Hp, len(columns), N).gather(1, index[..., None].expand(-1, -1, N))
                 for name, s in ((n, t[0]) for n, t in stats.items())}
    _remember(state, after, new_base, {n: s[None] for n, s in new_stats.items()}, policy, Hp, N)


def _queries(query: torch.Tensor) -> torch.Tensor:
    """A request's queries (T, Hq, D) as kvcache's attention takes them: (1, Hq, T, D) float32."""
    return query.float().transpose(0, 1)[None]


def _add_prompt_mass(state: LayerState, policy, q: torch.Tensor, work: Work, isa: str, kv_cache: torch.Tensor,
                     Hp: int) -> None:
    P, seen, total, N = work.row.prompt, work.seen, work.total, work.rule.block
    weight = policy.query_weight(step_of(0, P))[0]  # (P,) the prompt as one call
    chunk = torch.zeros(total - seen)
    inside = min(total, P) - seen
    chunk[:inside] = weight[seen: seen + inside]
    listened = chunk.nonzero().flatten()
    if state.mass is None:
        state.mass = torch.zeros(kv_cache.shape[1], 0)
        state.seen = torch.zeros(Hp, 0)
    grow = total - state.mass.shape[1]
    if grow > 0:
        state.mass = torch.cat((state.mass, state.mass.new_zeros(state.mass.shape[0], grow)), 1)
        state.seen = torch.cat((state.seen, state.seen.new_zeros(Hp, grow)), 1)
    if not listened.numel():
        return
    columns = list(range(-(-total // N)))
    keys, values = read(kv_cache, work.table[columns], isa)
    keys, values = keys[:, :total].float()[None], values[:, :total].float()[None]
    k_pos = torch.arange(total)[None, None].expand(1, Hp, total)
    q_pos = (seen + listened)[None]
    _, mass, seen_by = attention.masked_with_weights(q[:, :, listened], keys, values, q_pos, k_pos,
                                                     chunk[listened][None])
    state.mass[:, :total] += mass[0]
    state.seen[:, :total] += seen_by[0]


def _natural(acc: torch.Tensor | None, positions: torch.Tensor, H: int) -> torch.Tensor:
    """Per-position sums ``acc`` (H, L) on the prompt's unmoved columns, whose slot i holds
    position i (``positions`` (1, Hp, M)): (1, H, M), 0 where nothing was added."""
    M = positions.shape[2]
    out = torch.zeros(H, M)
    if acc is not None:
        n = min(M, acc.shape[1])
        out[:, :n] = acc[:, :n]
    return out[None]


def _base(state: LayerState, columns: list[int], Hp: int, N: int) -> torch.Tensor:
    """(Hp, K) the first position held by each of ``columns``, per head."""
    out = torch.tensor(columns)[None].expand(Hp, -1) * N
    if state.base is None:
        return out.clone()
    out = out.clone()
    W = state.base.shape[1]
    for j, col in enumerate(columns):
        if state.first <= col < state.first + W:
            out[:, j] = state.base[:, col - state.first]
    return out


def _stats(state: LayerState, policy, columns: list[int], Hp: int, N: int) -> list[torch.Tensor]:
    """The policy's statistics over ``columns``: each (Hp, K, N), zero for a new column."""
    out = torch.zeros(len(policy.stat_names), Hp, len(columns), N)
    if state.stats is not None:
        W = state.stats.shape[2]
        for j, col in enumerate(columns):
            if state.first <= col < state.first + W:
                out[:, :, j] = state.stats[:, :, col - state.first]
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
