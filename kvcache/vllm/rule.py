"""Which of a request's blocks a policy keeps, from token counts alone.

kvcache's block rule (cache/blocks.py) ranks candidates by the policy's ``priority``; for window
and sink that priority depends on positions only, so the blocks a request keeps once it has seen
``n`` tokens are a function of ``n``. vLLM's scheduler (which frees blocks, manager.py) and its
attention metadata (which skips them, backend.py) both call ``kept_blocks`` and so agree.

The semantics are kvcache's with ``block=N``: the prompt is attended whole (however vLLM chunks
it), then, before each later step, a request keeps what the rule keeps of the tokens seen so far;
a step attends over that and its own tokens.
"""

from __future__ import annotations

import functools

import torch

from ..cache.blocks import keep_whole_blocks
from ..cache.candidates import Candidates
from .config import PluginConfig


class BlockRule:
    """kvcache's block rule for one policy configuration, in block indices of a request."""

    def __init__(self, config: PluginConfig) -> None:
        self.layer = config.layer()
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

    def kept_columns(self, seen: int, total: int) -> list[int]:
        """Block-table columns a step reads: the blocks kept of ``seen`` tokens, then those the
        step's own tokens [seen, total) occupy."""
        first_new = seen // self.block
        return [b for b in self.kept_blocks(seen) if b < first_new] + list(range(first_new, -(-total // self.block)))
