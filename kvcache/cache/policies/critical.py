"""critical: CriticalKV over a scoring policy (Feng et al. 2025, kvpress's CriticalKVPress).

A token's worth is not only how much attention it gets but what its value adds to the layer's
output: the value projected by the output projection, ``V_h W_o,h``. CriticalKV keeps tokens in
two stages over the ``k`` a row keeps: the ``int(first_stage * k)`` best by the base policy's
score, then the rest by the base score times the L1 norm of ``V_h W_o,h`` (averaged over the
query heads of each K/V head), plus ``epsilon``. ``base`` is any policy whose scores need only
the competing tokens (no running statistics of its own), with the options its paper sets at the
budget (``budget_options``). Needs the layer's output projection, which kvcache's own model
gives the cache (``CacheSpec.out_proj``); caches made through kvcache.hf do not have it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..base import CacheSpec
from ..candidates import Candidates
from ..evicting import EvictingCache, coarse, rank_newest_first
from ..options import option
from . import lookup

BASES = ("knorm", "keydiff", "lagkv", "random", "h2o", "tova", "snapkv")


@dataclass(frozen=True)
class CriticalOptions:
    base: str = option("knorm", "the policy whose scores are reweighted", BASES)
    first_stage: float = option(0.5, "share of the kept tokens chosen by the base score alone")
    epsilon: float = option(1e-4, "added to a base score before it is weighted by the projected value norm")

    def __post_init__(self) -> None:
        if not 0 <= self.first_stage <= 1:
            raise ValueError(f"first_stage is a share of the kept tokens, in [0, 1], got {self.first_stage}")
        if self.epsilon < 0:
            raise ValueError(f"epsilon must be >= 0, got {self.epsilon}")


def projected_value_norms(values: torch.Tensor, out_proj: torch.Tensor) -> torch.Tensor:
    """(B, Hkv, N): the L1 norm of each value times its query heads' slice of the output
    projection, averaged over the query heads of each K/V head. values (B, Hkv, N, D),
    out_proj (hidden, Hq * D)."""
    B, Hkv, N, D = values.shape
    Hq = out_proj.shape[1] // D
    wo = out_proj.detach().float().t().reshape(Hq, D, -1)  # (Hq, D, hidden); scores carry no gradient
    group = Hq // Hkv
    norms = []
    for h in range(Hq):  # one head at a time: a (B, N, hidden) product, not (B, Hq, N, hidden)
        norms.append((values[:, h // group].float() @ wo[h]).abs().sum(-1))  # (B, N)
    return torch.stack(norms, 1).reshape(B, Hkv, group, N).mean(2)


class CriticalCache(EvictingCache):
    name = "critical"
    description = "CriticalKV: a base policy's scores reweighted by projected value norms (CriticalKVPress)"
    Options = CriticalOptions
    per_head = True

    def __init__(self, spec: CacheSpec, options) -> None:
        if spec.out_proj is None:
            raise ValueError("critical needs the layer's output projection, which kvcache's own model gives "
                             "(kvcache.make_cache); a cache made through kvcache.hf has none")
        base = lookup(options.base)
        # The base is a scorer here: a policy of this budget, with the options its paper sets
        # for it, built on the meta device (its slots allocate nothing). This cache holds the
        # tokens and their statistics, and its own reserve and blocks (what a row keeps reaches
        # the base as ``Candidates.keeps``); the base scores them from the candidates alone.
        settings = base.Options(**base.options_for_budget(spec.cache_length))
        self.base = base(dataclasses.replace(spec, device=torch.device("meta"), reserve=0, block=1), settings)
        self.stat_names = self.base.stat_names
        self.needs_attention = self.base.needs_attention
        self.observe_every_step = self.base.observe_every_step
        super().__init__(spec, options)
        self._observes = self.base._observes

    def observe(self, c: Candidates) -> None:
        self.base.observe(c)

    def priority(self, c: Candidates) -> torch.Tensor:
        B, H, N, _ = c.keys.shape
        score = self.base.priority(c).float().masked_fill(c.empty, float("-inf"))
        # Cut (``coarse``), as knorm's norms: a token that comes twice has one value norm in the
        # first layer, and ties go by the ranking's rule (the newer), not by rounding.
        weighted = coarse((score + self.options.epsilon) * projected_value_norms(c.values, self.spec.out_proj))
        top = torch.finfo(torch.float32).max
        C = self.spec.cache_length
        if c.step.num_tokens == 1:
            # A decode step: every row keeps cache_length, so the first stage has one size, and
            # the step is tensor operations only (the same eager and captured).
            first = int(C * self.options.first_stage)
            return weighted.scatter(-1, rank_newest_first(score, c.positions)[..., :first], top) if first else weighted
        for b in range(B):
            first = int(int(c.keeps[b]) * self.options.first_stage)
            if first:
                weighted[b].scatter_(-1, rank_newest_first(score[b], c.positions[b])[..., :first], top)
        return weighted
