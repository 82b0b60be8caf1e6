"""Which of a request's blocks a policy keeps, from token counts alone.

kvcache's block rule (cache/blocks.py) ranks candidates by the policy's ``priority``; for window
and sink that priority depends on positions only, so the blocks a request keeps once it has seen
``n`` tokens are a function of ``n``. A scoring policy's requests keep window's columns, into
which each layer moves the blocks the policy keeps (scoring.py). vLLM's scheduler (which frees blocks, manager.py) and its
attention metadata (which skips them, backend.py) both call ``kept_blocks`` and so agree.

The semantics are kvcache's with ``block=N``: the prompt is attended whole (however vLLM chunks
it), then, before each later step, a request keeps what the rule keeps of the tokens seen so far;
a step attends over that and its own tokens.
"""

from __future__ import annotations

import functools
import logging

import torch

from ..cache.blocks import keep_whole_blocks
from ..cache.candidates import Candidates
from ..cache.evicting import EvictingCache
from .config import ConfigError, PluginConfig, for_request, request_key


class BlockRule:
    """kvcache's block rule for one policy configuration, in block indices of a request.

    ``policy`` is the policy's kvcache layer cache; ``layer`` the one whose priority decides which
    columns (a request's i-th blocks) stay: the policy itself for window and sink, window's for a
    scoring policy, whose worker moves the blocks it keeps into those columns (scoring.py)."""

    def __init__(self, config: PluginConfig) -> None:
        self.config = config
        self.policy = config.layer()
        # A policy that keeps state of its own beyond per-token statistics (expected_attention's
        # query moments) needs an instance per request and layer (scoring.py).
        self.stateful = type(self.policy).reset is not EvictingCache.reset
        self.scoring = config.scoring
        self.layer = PluginConfig("window", config.cache_length, (), config.block).layer() if self.scoring else self.policy
        self.block = config.block
        self.cache_length = config.cache_length

    @functools.lru_cache(maxsize=4096)
    def kept_blocks(self, n: int) -> tuple[int, ...]:
        """Sorted indices of the blocks kept once ``n`` tokens have been seen (every block
        while they fit the budget, as kvcache appends without evicting)."""
        N, C = self.block, self.cache_length
        if n <= C:
            return tuple(range(-(-n // N)))
        # Candidates: the sink blocks and the newest C + N positions. Nothing else can be kept
        # (kept tokens number at most C, the sinks' blocks outrank all, then the newest), and the
        # rule over these equals the rule over [0, n), at a cost bounded by the budget.
        sinks = min(n, -(-self.layer.sinks() // N) * N)
        tail = max(sinks, n - C - N)
        positions = torch.cat((torch.arange(sinks), torch.arange(tail, n)))[None, None]  # (1, 1, M)
        c = Candidates(stored_keys=None, stored_values=None, positions=positions, stats={}, queries=None, step=None)
        priority, _ = keep_whole_blocks(self.layer.priority(c), positions, N, n - 1, torch.tensor([C]))
        kept = positions[priority == 0]
        return tuple(sorted(set((kept // N).tolist())))

    def read_by(self, t: int, prompt: int) -> tuple[int, ...]:
        """Blocks the query at position ``t`` reads, in a request whose prompt has ``prompt``
        tokens: a prompt query reads every block up to its own (the prompt is attended whole);
        a later one (a generated token) the blocks kept of the ``t`` tokens before it, then its own."""
        own = t // self.block
        if t < prompt or t <= self.cache_length:
            return tuple(range(own + 1))
        return tuple(b for b in self.kept_blocks(t) if b < own) + (own,)

    def segments(self, seen: int, total: int, prompt: int) -> list[tuple[int, int, tuple[int, ...]]]:
        """The queries [seen, total) of one step of a request, split where what they read stops
        being "the same blocks plus the step's own tokens": a list of ``(start, end, columns)``,
        each attended by the stock kernel as one causal sequence over ``columns`` (block
        indices, the last ones those that [start, end) occupy). A decode step or a chunk of the
        prompt is one segment; a request recomputing its generated tokens after a preemption
        gets one per eviction, so each token reads what it read when it was first generated."""
        N = self.block
        out: list[tuple[int, int, tuple[int, ...]]] = []
        start, prefix = seen, None
        for t in range(seen, total):
            reads = self.read_by(t, prompt)
            if prefix is not None and reads == prefix + tuple(range(start // N, t // N + 1)):
                continue
            if prefix is not None:
                out.append((start, t, prefix + tuple(range(start // N, (t - 1) // N + 1))))
            start, prefix = t, tuple(b for b in reads if b < t // N)
        if prefix is not None:
            out.append((start, total, prefix + tuple(range(start // N, (total - 1) // N + 1))))
        return out


_RULES: dict[object, BlockRule] = {}
# Rules kept at most: requests may each bring options of their own, and a server must not keep
# one rule per request ever seen. Past this the cache starts again (a rule is cheap to build).
MAX_RULES = 4096


def _remember(key: object, rule: BlockRule) -> BlockRule:
    if len(_RULES) >= MAX_RULES:
        _RULES.clear()
    _RULES[key] = rule
    return rule


def rule_of(config: PluginConfig) -> BlockRule:
    """The rule of ``config``, built once per process."""
    return _RULES[config] if config in _RULES else _remember(config, BlockRule(config))


def request_rule(engine: PluginConfig, raw: object) -> BlockRule:
    """The rule of a request whose ``extra_args["kvcache"]`` is ``raw`` (None: the engine's).

    vLLM checks requests where they arrive (requests.py), with the engine's configuration when
    that process knows it. Where it does not (an API server in a process of its own), a request
    whose options fail only against the engine (a budget below one vLLM block) reaches the
    engine: it then runs under the engine's configuration, with a warning, and never stops the
    engine. The scheduler and the workers call this alike, so they agree on every request."""
    if raw is None:
        return rule_of(engine)
    key = (engine, request_key(raw))
    if key in _RULES:
        return _RULES[key]
    try:
        rule = rule_of(for_request(engine, raw))
    except ConfigError as e:
        logging.getLogger(__name__).warning("%s; the request runs with the engine's configuration", e)
        rule = rule_of(engine)
    return _remember(key, rule)
