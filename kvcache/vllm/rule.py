"""Which of a request's blocks a policy keeps, from token counts alone, and which each query reads.

kvcache's block rule (cache/blocks.py) ranks candidates by the policy's ``priority``; for window
and sink that priority depends on positions only, so the blocks a request keeps once it has seen
``n`` tokens are a function of ``n``. A scoring policy's requests keep window's columns, into
which each layer moves the blocks the policy keeps (scoring.py). vLLM's scheduler (which frees blocks, manager.py) and its
attention metadata (which skips them, backend.py) both call this rule and so agree.

The semantics are kvcache's with ``block=N``, a request being a sequence of calls: each call
attends over what the rule kept before it plus its own tokens, then the rule evicts.

* window and sink: every token is a call of its own, prompt included (kvcache's own model fed
  one token at a time). What a token reads depends on its position alone, so a prompt gives the
  same keys however vLLM chunks it, and blocks leave as soon as the window passes them.
* scoring policies: each prompt chunk vLLM computes is a call (kvcache's own model fed the same
  chunks), then every generated token. ``calls`` lists where the prompt's calls ended; after a
  preemption the request is computed again in other chunks, and each token still reads what it
  read in its call.
"""

from __future__ import annotations

import bisect
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
        N, C = self.block, self.cache_length
        self._sink_blocks = -(-self.layer.sinks() // N)
        # From this block on the newest C + N positions lie clear of the sink blocks.
        self._far = self._sink_blocks + -(-C // N) + 2
        self._memo: dict[int, tuple[int, ...]] = {}

    def kept_blocks(self, n: int) -> tuple[int, ...]:
        """Sorted indices of the blocks kept once ``n`` tokens have been seen (every block
        while they fit the budget, as kvcache appends without evicting)."""
        N, C = self.block, self.cache_length
        if n <= C:
            return tuple(range(-(-n // N)))
        k = (n - 1) // N
        if k <= self._far:
            return self._kept(n)
        # Far from the sinks the rule is the same at every block: what it keeps at the same offset
        # within block ``_far``, moved by as many blocks (the sink blocks stay where they are).
        shift = k - self._far
        return tuple(b if b < self._sink_blocks else b + shift for b in self._kept(self._far * N + n - k * N))

    def _kept(self, n: int) -> tuple[int, ...]:
        """``kept_blocks(n)`` by kvcache's own rule, computed once per ``n`` (``kept_blocks``
        asks for at most ``(_far + 1) * block`` of them)."""
        if n in self._memo:
            return self._memo[n]
        N, C = self.block, self.cache_length
        # Candidates: the sink blocks and the newest C + N positions. Nothing else can be kept
        # (kept tokens number at most C, the sinks' blocks outrank all, then the newest), and the
        # rule over these equals the rule over [0, n), at a cost bounded by the budget.
        sinks = min(n, self._sink_blocks * N)
        tail = max(sinks, n - C - N)
        positions = torch.cat((torch.arange(sinks), torch.arange(tail, n)))[None, None]  # (1, 1, M)
        c = Candidates(stored_keys=None, stored_values=None, positions=positions, stats={}, queries=None, step=None)
        priority, _ = keep_whole_blocks(self.layer.priority(c), positions, N, n - 1, torch.tensor([C]))
        kept = positions[priority == 0]
        self._memo[n] = out = tuple(sorted(set((kept // N).tolist())))
        return out

    def call_start(self, t: int, prompt: int, calls: list[int] | None = None) -> int:
        """Where the call that computes position ``t`` begins: ``t`` itself for window and sink
        and for every generated token; for a prompt token under a scoring policy, the last of
        ``calls`` (the ends of the prompt's calls so far) at or before ``t``."""
        if not self.scoring or t >= prompt:
            return t
        i = bisect.bisect_right(calls or (), t)
        return calls[i - 1] if i else 0

    def read_by(self, t: int, start: int) -> tuple[int, ...]:
        """Blocks the query at position ``t`` reads in a call that began at ``start``: the blocks
        kept of the ``start`` tokens before the call, then the call's own up to ``t``'s."""
        first = start // self.block
        return tuple(b for b in self.kept_blocks(start) if b < first) + tuple(range(first, t // self.block + 1))

    def segments(self, seen: int, total: int, prompt: int,
                 calls: list[int] | None = None) -> list[tuple[int, int, tuple[int, ...]]]:
        """The queries [seen, total) of one step of a request, split where what they read stops
        being "the same blocks plus the step's own tokens": a list of ``(start, end, columns)``,
        each attended by the stock kernel as one causal sequence over ``columns`` (block
        indices, the last ones those that [start, end) occupy). Under window and sink a new
        segment begins wherever a block leaves; under a scoring policy, at each call that
        follows an eviction (a step of the prompt, or of a recompute, may hold several)."""
        N = self.block
        out: list[tuple[int, int, tuple[int, ...]]] = []
        start, prefix = seen, None
        for t in range(seen, total):
            reads = self.read_by(t, self.call_start(t, prompt, calls))
            if prefix is not None and reads == prefix + tuple(range(start // N, t // N + 1)):
                continue
            if prefix is not None:
                out.append((start, t, prefix + tuple(range(start // N, (t - 1) // N + 1))))
            start, prefix = t, tuple(b for b in reads if b < t // N)
        if prefix is not None:
            out.append((start, total, prefix + tuple(range(start // N, (total - 1) // N + 1))))
        return out

    def kept_before(self, n: int, prompt: int, calls: list[int] | None = None) -> tuple[int, ...]:
        """Blocks a request must still hold once it has computed ``n`` tokens: those its next
        query reads (the ones it will write are not allocated yet)."""
        return self.read_by(n, self.call_start(n, prompt, calls))


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
