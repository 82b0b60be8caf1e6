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
from ..evicting import PROTECTED, EvictingCache, newest

FALLBACKS = ("window", "tova")
POOLINGS = ("avg", "max")


@dataclass(frozen=True)
class SnapKVOptions:
    window: int = 32
    kernel: int = 7
    pooling: str = "avg"
    fallback: str = "window"

    def __post_init__(self) -> None:
        if self.window <= 0:
            raise ValueError(f"window must be positive, got {self.window}")
        if self.kernel <= 0 or self.kernel % 2 == 0:
            raise ValueError(f"kernel must be a positive odd number, got {self.kernel}")
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}, got {self.pooling!r}")
        if self.fallback not in FALLBACKS:
            raise ValueError(f"fallback must be one of {', '.join(FALLBACKS)}, got {self.fallback!r}")


class SnapKVCache(EvictingCache):
    name = "snapkv"
    description = "SnapKV: the prompt's last `window` tokens vote (pooled) per head; then `fallback`"
    Options = SnapKVOptions
    per_head = True
    stats = ("score",)
    needs_attention = True

    def __init__(self, spec, options: SnapKVOptions) -> None:
        if options.window >= spec.cache_length - spec.reserve:
            raise ValueError(
                f"window ({options.window}) must be smaller than cache_length ({spec.cache_length})"
                + (f" - reserve ({spec.reserve})" if spec.reserve else "")
            )
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

    def observe(self, stat, mass, seen, pos, values, step: Step) -> None:
        # A one-token row's window is that token alone, so its mass is the tova fallback's score.
        if step.num_tokens == 1:
            stat["score"].copy_(mass)
        else:
            stat["score"].copy_(torch.where(self._decoding(step), mass, self._pool(mass, pos)))

    def _pool(self, votes: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        # Neighbours are neighbours in position, not in slot order: pool in position order.
        order = pos.argsort(dim=-1)
        B, H, N = votes.shape
        x = votes.gather(2, order).reshape(B * H, 1, N)
        k = self.options.kernel
        pool = F.avg_pool1d if self.options.pooling == "avg" else F.max_pool1d
        pooled = pool(x, k, stride=1, padding=k // 2).reshape(B, H, N)
        return torch.empty_like(pooled).scatter_(2, order, pooled)

    def priority(self, stat, pos: torch.Tensor, step: Step) -> torch.Tensor:
        fallback = pos.float() if self.options.fallback == "window" else stat["score"]
        if step.num_tokens == 1:
            return fallback
        voted = stat["score"] + PROTECTED * (pos > newest(step) - self.options.window)
        return torch.where(self._decoding(step), fallback, voted)
