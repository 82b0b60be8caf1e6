"""expected_attention: keep the keys that future queries are expected to attend most (Devoto et
al. 2025, kvpress's ExpectedAttentionPress).

The queries seen so far (before RoPE, past the first ``sinks`` positions) give a mean mu and a
covariance S per query head. A future query at position p is modelled as R(p) q with q ~ N(mu, S);
over the next ``future`` positions the rotation is replaced by its average R. For a Gaussian
query, E[exp(q . k / sqrt(D))] = exp(k . R mu / sqrt(D) + k^T R S R^T k / (2 D)), so a key's score
is the softmax over keys of that exponent, averaged over the query heads of its group and, with
``value_norm``, scaled by its value's norm (a key whose value is near zero changes little).

The statistics are running sums over every query the cache has seen since ``reset`` (the whole
prompt, as kvpress computes them from the prompt it compresses), kept per row and query head:
(B, Hq, D) and (B, Hq, D, D) float32 per layer. Eviction is per row and K/V head. Scoring needs
no attention weights, so attention takes the fused kernel; the covariance term costs D times a
key's dot product per query head, which is why ``reserve`` (batched eviction) suits this policy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...model.rope import apply_rope, rope_angles
from ..base import CacheSpec, Step
from ..candidates import Candidates
from ..evicting import PROTECTED, EvictingCache, require_room
from ..options import option
from ..snapshot import check_tensors


@dataclass(frozen=True)
class ExpectedAttentionOptions:
    future: int = option(512, "future positions whose average rotation the expected query takes")
    sinks: int = option(4, "first tokens always kept, and left out of the query statistics")
    covariance: bool = option(True, "use the queries' covariance, not only their mean")
    value_norm: bool = option(True, "scale each score by the norm of the token's value")
    epsilon: float = option(0.0, "added to a score before the value-norm scaling")
    recent: int = option(0, "newest tokens always kept")

    def __post_init__(self) -> None:
        if self.future <= 0:
            raise ValueError(f"future must be positive, got {self.future}")
        if self.sinks < 0 or self.recent < 0:
            raise ValueError(f"sinks and recent must be >= 0, got {self.sinks}, {self.recent}")
        if self.epsilon < 0:
            raise ValueError(f"epsilon must be >= 0, got {self.epsilon}")


class ExpectedAttentionCache(EvictingCache):
    name = "expected_attention"
    description = "keep the keys future queries are expected to attend most (ExpectedAttentionPress), per K/V head"
    Options = ExpectedAttentionOptions
    per_head = True

    @classmethod
    def options_for_budget(cls, cache_length: int) -> dict[str, object]:
        return {"sinks": max(1, min(4, cache_length // 4))}

    def __init__(self, spec: CacheSpec, options: ExpectedAttentionOptions) -> None:
        require_room(spec, "recent + sinks", options.recent + options.sinks)
        if spec.inv_freq is None:
            raise ValueError("expected_attention needs the model's rotary frequencies (spec.inv_freq)")
        super().__init__(spec, options)
        # Running query sums: count (B,), sum (B, Hq, D), sum of outer products (B, Hq, D, D).
        # Allocated by the first call, which is the first to know the number of query heads.
        self._count = torch.zeros(spec.batch_size, device=spec.device)
        self._sum: torch.Tensor | None = None
        self._outer: torch.Tensor | None = None

    def reset(self) -> None:
        super().reset()
        self._count.zero_()
        if self._sum is not None:
            self._sum.zero_()
            self._outer.zero_()

    def nbytes(self) -> int:
        stats = [t for t in (self._count, self._sum, self._outer) if t is not None]
        return super().nbytes() + sum(t.numel() * t.element_size() for t in stats)

    # ----- state (snapshots): the query sums besides the slots -------------------------------
    # Before the first call the sums are not allocated (the number of query heads is unknown);
    # they are then given as zero query heads, (B, 0, D) and (B, 0, D, D). Unallocated sums and
    # zero sums behave alike, since every call observes (and allocates) before it ranks.
    def state(self) -> dict[str, torch.Tensor]:
        state = super().state()
        B, D = self.spec.batch_size, self.spec.head_dim
        state["query_count"] = self._count
        state["query_sum"] = self._count.new_zeros(B, 0, D) if self._sum is None else self._sum
        state["query_outer"] = self._count.new_zeros(B, 0, D, D) if self._outer is None else self._outer
        return state

    def check_state(self, state, rows: int) -> None:
        sums = ("query_sum", "query_outer")
        live = {k: t for k, t in self.state().items() if k not in sums}
        check_tensors(live, {k: t for k, t in state.items() if k not in sums}, rows, "the expected_attention layer")
        Hkv, D = self.spec.num_kv_heads, self.spec.head_dim
        s, o = state["query_sum"], state["query_outer"]
        Hq = s.shape[1] if s.dim() == 3 else -1
        mine = None if self._sum is None else self._sum.shape[1]
        if (s.dtype != torch.float32 or o.dtype != torch.float32 or s.shape != (rows, Hq, D)
                or o.shape != (rows, Hq, D, D) or Hq % Hkv or (Hq and mine not in (None, Hq))):
            raise ValueError(
                f"the expected_attention layer: query sums of shapes {tuple(s.shape)} and {tuple(o.shape)} "
                f"do not fit (B, Hq, {D}) and (B, Hq, {D}, {D}) float32 with Hq a multiple of {Hkv}"
                + (f" equal to {mine}" if mine is not None else "")
            )

    def load_state(self, state, rows: torch.Tensor) -> None:
        sums = ("query_sum", "query_outer")
        super().load_state({k: t for k, t in state.items() if k not in sums}, rows)
        s, o = state["query_sum"], state["query_outer"]
        if s.shape[1] and self._sum is None:
            # Ordinary tensors even under inference mode, so the cache works outside it too.
            with torch.inference_mode(False):
                self._sum = self._count.new_zeros(self.spec.batch_size, *s.shape[1:])
                self._outer = self._count.new_zeros(self.spec.batch_size, *o.shape[1:])
        if self._sum is None:
            return
        if s.shape[1]:
            self._sum.index_copy_(0, rows.to(self._sum.device), s.to(self._sum.device))
            self._outer.index_copy_(0, rows.to(self._outer.device), o.to(self._outer.device))
        else:
            self._sum[rows.to(self._sum.device)] = 0.0
            self._outer[rows.to(self._outer.device)] = 0.0

    def observe(self, c: Candidates) -> None:
        q, step = c.queries.float(), c.step
        B, Hq, T, D = q.shape
        if self._sum is None:
            self._sum = q.new_zeros(B, Hq, D)
            self._outer = q.new_zeros(B, Hq, D, D)
        # Undo RoPE: the statistics describe queries before rotation, so that they can be rotated
        # to any future position.
        cos, sin = rope_angles(self.spec.inv_freq, -step.positions, torch.float32)  # (B, T, D)
        q = apply_rope(q, cos.unsqueeze(1), sin.unsqueeze(1))
        weight = (step.valid & (step.positions >= self.options.sinks)).float()  # (B, T)
        qw = q * weight[:, None, :, None]
        self._count += weight.sum(1)
        self._sum += qw.sum(2)
        if self.options.covariance:
            self._outer += qw.transpose(-1, -2) @ q

    def priority(self, c: Candidates) -> torch.Tensor:
        keys, values, pos = c.keys.float(), c.values, c.positions
        B, Hkv, N, D = keys.shape
        if self._sum is None:  # nothing observed yet: every query is a sink
            score = keys.new_zeros(B, Hkv, N)
        else:
            score = self._expected(keys, pos, c.step)
        if self.options.value_norm:
            score = (score + self.options.epsilon) * torch.linalg.vector_norm(values, dim=-1, dtype=torch.float32)
        protected = pos > c.newest - self.options.recent
        if self.options.sinks:
            protected |= pos < self.options.sinks
        return score.masked_fill(protected, PROTECTED)

    def _average_rotation(self, step: Step) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (B, 1, D) of the rotation averaged over each row's next ``future`` positions;
        the same in every layer of a call, so the first layer computes it for all."""
        key = ("expected_attention_rotation", self.options.future)
        if key not in step.shared:
            ahead = step.newest[:, None] + 1 + torch.arange(self.options.future, device=step.newest.device)  # (B, F)
            cos, sin = rope_angles(self.spec.inv_freq, ahead, torch.float32)
            step.shared[key] = cos.mean(1, keepdim=True), sin.mean(1, keepdim=True)
        return step.shared[key]

    def _expected(self, keys: torch.Tensor, pos: torch.Tensor, step: Step) -> torch.Tensor:
        """(B, Hkv, N) expected attention of keys (B, Hkv, N, D) at positions pos (B, Hkv, N),
        normalised over each head's non-sink keys and averaged over the query heads of a group."""
        B, Hkv, N, D = keys.shape
        Hq = self._sum.shape[1]
        n = self._count.clamp(min=1.0)[:, None, None]
        mean = self._sum / n  # (B, Hq, D)
        # The average rotation over the next ``future`` positions of each row: R = diag(cos) +
        # diag(sin) P, applied to a vector x as x * cos + rotate_half(x) * sin.
        cos, sin = self._average_rotation(step)
        mean = apply_rope(mean, cos, sin)  # R mu
        G = Hq // Hkv
        logits = (keys @ mean.reshape(B, Hkv, G, D).transpose(-1, -2)).transpose(-1, -2) * D**-0.5  # (B, Hkv, G, N)
        if self.options.covariance:
            cov = self._outer / n[..., None] - mean_outer(self._sum / n)
            # R S R^T: rotate the rows, then the columns (S is symmetric).
            cov = apply_rope(apply_rope(cov, cos[:, None], sin[:, None]).transpose(-1, -2), cos[:, None], sin[:, None])
            spread = ((keys.unsqueeze(2) @ cov.reshape(B, Hkv, G, D, D)) * keys.unsqueeze(2)).sum(-1)  # (B, Hkv, G, N)
            logits = logits + spread / (2 * D)
        # Sinks are kept anyway and empty slots never: neither takes a share of the softmax.
        outside = (pos < self.options.sinks) | (pos < 0)
        logits = logits.masked_fill(outside.unsqueeze(2), torch.finfo(torch.float32).min)
        return logits.softmax(-1).mean(2)


def mean_outer(mean: torch.Tensor) -> torch.Tensor:
    """(..., D) -> (..., D, D): the outer product of a mean with itself."""
    return mean.unsqueeze(-1) * mean.unsqueeze(-2)
