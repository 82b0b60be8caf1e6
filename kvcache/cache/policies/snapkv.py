"""snapkv (prefill compression): the last ``window`` prompt tokens vote for the tokens to keep.

When a multi-token chunk (a prompt) overflows the cache, each K/V head keeps the observation
window (the chunk's last ``window`` real tokens) plus the tokens that window attended most,
after pooling the votes over neighbouring positions (``kernel``) so that whole phrases survive.
Decoding then appends while there is room; once full it evicts by ``fallback``:
``window`` (oldest first) or ``tova`` (least attended by the newest query).
With a chunked prefill every overflowing chunk is compressed by its own window.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..base import Step
from ..candidates import Candidates
from ..evicting import PROTECTED, EvictingCache, require_room
from ..options import option

FALLBACKS = ("window", "tova")
POOLINGS = ("avg", "max")


@dataclass(frozen=True)
class SnapKVOptions:
    window: int = option(32, "observation window: the prompt's last tokens, which vote")
    kernel: int = option(7, "width of the pooling over neighbouring positions (odd)")
    pooling: str = option("avg", "how votes are pooled over neighbours", POOLINGS)
    fallback: str = option("window", "how a full cache evicts while decoding: oldest first, or least "
                                     "attended by the newest query", FALLBACKS)

    def __post_init__(self) -> None:
        if self.window <= 0:
            raise ValueError(f"window must be positive, got {self.window}")
        if self.kernel <= 0 or self.kernel % 2 == 0:
            raise ValueError(f"kernel must be a positive odd number, got {self.kernel}")


class SnapKVCache(EvictingCache):
    name = "snapkv"
    description = "SnapKV: the prompt's last `window` tokens vote (pooled) per head; then `fallback`"
    Options = SnapKVOptions
    per_head = True
    stat_names = ("score",)
    needs_attention = True

    @classmethod
    def options_for_budget(cls, cache_length: int) -> dict[str, object]:
        # The paper observes 32 tokens; a small budget observes a quarter of itself.
        return {"window": max(1, min(32, cache_length // 4))}

    def __init__(self, spec, options: SnapKVOptions) -> None:
        require_room(spec, "window", options.window)
        super().__init__(spec, options)

    @staticmethod
    def _decoding(step: Step) -> torch.Tensor:
        """(B, 1, 1) bool: the row adds one token (a decode step, evicted by the fallback); more
        tokens are a prompt (evicted by votes). Decided per row, whatever the padded width."""
        return (step.valid.sum(1) <= 1)[:, None, None]

    def query_weight(self, step: Step) -> torch.Tensor:
        t = torch.arange(step.num_tokens, device=step.valid.device)
        first = step.last_index[:, None] + 1 - self.options.window
        return (step.valid & (t >= first)).float()

    def observe(self, c: Candidates) -> None:
        # A one-token row's window is that token alone, so its mass is the tova fallback's score.
        if c.step.num_tokens == 1:
            c.stats["score"].copy_(c.mass)
        else:
            pooled = pool_votes(c.mass, c.positions, self.options.kernel, self.options.pooling)
            c.stats["score"].copy_(torch.where(self._decoding(c.step), c.mass, pooled))

    def priority(self, c: Candidates) -> torch.Tensor:
        fallback = c.positions.float() if self.options.fallback == "window" else c.stats["score"]
        if c.step.num_tokens == 1:
            return fallback
        voted = c.stats["score"] + PROTECTED * (c.positions > c.newest - self.options.window)
        return torch.where(self._decoding(c.step), fallback, voted)


def pool_votes(votes: torch.Tensor, pos: torch.Tensor, kernel: int, pooling: str) -> torch.Tensor:
    """Votes (B, H, N) pooled over ``kernel`` neighbouring positions (``pos`` (B, H, N)), so that
    a phrase survives as a whole. Neighbours are neighbours in position, not in slot order."""
    order = pos.argsort(dim=-1)
    B, H, N = votes.shape
    x = votes.gather(2, order).reshape(B * H, 1, N)
    pool = F.avg_pool1d if pooling == "avg" else F.max_pool1d
    pooled = pool(x, kernel, stride=1, padding=kernel // 2).reshape(B, H, N)
    return torch.empty_like(pooled).scatter_(2, order, pooled)
