"""lagkv: score each partition of ``lag`` tokens by how its keys and values stand out against the
next partition's range (Liang et al. 2025, kvpress's LagKVPress).

The competing tokens, in position order, are: the first ``sinks`` (always kept), then whole
partitions of ``lag`` tokens, then a tail of the last partition plus any remainder (kept). Each
token of a partition is normalised by the min and max of the NEXT partition, per channel; its
score is the softmax, over the partition, of the standard deviation over channels, averaged for
keys and values, and replaced by its rank within the partition over ``lag`` (in [0, 1)). Sinks
and tail score 1. Tokens with a distinctive lag-relative spread stay; no attention weights are
needed (query-agnostic). With fewer than ``sinks + 2 * lag`` tokens nothing is partitioned and
the newest tokens rank highest (kvpress's rule). kvpress compresses a prompt once; a decode step
into a full cache evicts the oldest non-sink token (snapkv's window fallback). Options:
    lag      partition size.
    sinks    first tokens always kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..base import CacheSpec
from ..candidates import Candidates
from ..evicting import PROTECTED, EvictingCache, require_room
from ..options import option


@dataclass(frozen=True)
class LagKVOptions:
    lag: int = option(128, "partition size: each partition is scored against the next")
    sinks: int = option(4, "first tokens always kept")

    def __post_init__(self) -> None:
        if self.lag <= 0:
            raise ValueError(f"lag must be positive, got {self.lag}")
        if self.sinks < 0:
            raise ValueError(f"sinks must be >= 0, got {self.sinks}")


def lag_scores(keys: torch.Tensor, values: torch.Tensor, sinks: int, lag: int) -> torch.Tensor:
    """(H, n) scores of n tokens in position order, keys and values (H, n, D)."""
    H, n, D = keys.shape
    if n < sinks + 2 * lag:
        score = torch.ones(H, n, dtype=torch.float32, device=keys.device)
        if n > sinks:
            score[:, sinks:] = torch.arange(n - sinks, device=keys.device) / (n - sinks)
        return score
    end = sinks + ((n - sinks) // lag) * lag
    tail = lag + n - end

    def spread(x: torch.Tensor) -> torch.Tensor:
        parts = x[:, sinks:end].float().reshape(H, -1, lag, D)  # (H, P, lag, D)
        ref, own = parts[:, 1:], parts[:, :-1]
        low, high = ref.amin(dim=-2, keepdim=True), ref.amax(dim=-2, keepdim=True)
        return ((own - low) / (high - low)).std(dim=-1).softmax(dim=-1)  # (H, P - 1, lag)

    mid = (spread(keys) + spread(values)) / 2
    mid = mid.argsort(dim=-1).argsort(dim=-1).float() / lag
    ones = torch.ones(H, sinks, device=keys.device), torch.ones(H, tail, device=keys.device)
    return torch.cat([ones[0], mid.reshape(H, -1), ones[1]], dim=-1)


class LagKVCache(EvictingCache):
    name = "lagkv"
    description = "score partitions against the next one's key/value range (LagKVPress), per row and K/V head"
    Options = LagKVOptions
    per_head = True

    @classmethod
    def options_for_budget(cls, cache_length: int) -> dict[str, object]:
        return {"sinks": max(0, min(4, cache_length // 4)), "lag": max(1, min(128, cache_length // 4))}

    def __init__(self, spec: CacheSpec, options: LagKVOptions) -> None:
        require_room(spec, "sinks", options.sinks)
        super().__init__(spec, options)

    def priority(self, c: Candidates) -> torch.Tensor:
        B, H, N, D = c.keys.shape
        if c.step.num_tokens == 1:
            # A decode step into a full cache (kvpress never takes one): the oldest non-sink token
            # goes, as snapkv's window fallback, with tensor operations only (captured decode).
            score = c.positions.float()
            return score.masked_fill(c.positions < self.options.sinks, PROTECTED) if self.options.sinks else score
        pos = c.positions.expand(B, H, N)
        room = c.keeps  # what each row keeps
        score = torch.zeros(B, H, N, device=c.keys.device)
        one = (c.step.valid.sum(1) <= 1).tolist()  # rows adding one token decode, as they would alone
        for b in range(B):  # rows hold different counts; each is scored over its own tokens
            if one[b]:
                score[b] = pos[b].float()
                continue
            order = pos[b].argsort(dim=-1, stable=True)  # (H, N): empty slots first
            filled = int((pos[b, 0] >= 0).sum())
            take = order[:, N - filled:]
            k = c.keys[b].gather(1, take[..., None].expand(H, filled, D))
            v = c.values[b].gather(1, take[..., None].expand(H, filled, D))
            s = lag_scores(k, v, self.options.sinks, self.options.lag)  # (H, filled), in [0, 1]
            # Ranks tie across partitions; the kept ones are chosen as kvpress chooses them, by
            # top-k over the tokens in position order, and lifted above the rest (scores are <= 1).
            chosen = s.topk(min(int(room[b]), filled), dim=-1).indices
            s = s.scatter_add(1, chosen, torch.full_like(chosen, 2.0, dtype=s.dtype))
            score[b].scatter_(1, take, s)
        if self.options.sinks:
            score = score.masked_fill(c.positions < self.options.sinks, PROTECTED)
        return score
