"""tova (Token Omission Via Attention): evict the token the newest query attends least.

A token's score is the attention the newest query of its row gives it, averaged over all query
heads; scores are replaced, not accumulated, at every step. All heads keep the same tokens.
"""

from __future__ import annotations

import torch

from ..base import Step
from ..candidates import Candidates
from ..evicting import EvictingCache


def newest_query(step: Step) -> torch.Tensor:
    """(B, T) one-hot weight on each row's last real token of the chunk."""
    t = torch.arange(step.num_tokens, device=step.valid.device)
    return ((t == step.last_index[:, None]) & step.valid).float()


class TOVACache(EvictingCache):
    name = "tova"
    description = "TOVA: evict the token the newest query attends least (mean over heads)"
    stat_names = ("score",)
    needs_attention = True

    def query_weight(self, step: Step) -> torch.Tensor:
        return newest_query(step)

    def observe(self, c: Candidates) -> None:
        # mass sums the G query heads of each K/V head; the mean over K/V heads is then G times
        # the mean over query heads, the same ranking.
        c.stats["score"].copy_(c.mass.mean(1, keepdim=True))

    def priority(self, c: Candidates) -> torch.Tensor:
        return c.stats["score"]
