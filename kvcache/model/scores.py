"""What a family does to attention scores between the scaled dot product and the softmax.

Two families need more than ``softmax(q . k / sqrt(D))``:

- Gemma 2 soft-caps every score: ``s -> cap * tanh(s / cap)`` (``attn_logit_softcapping``).
- gpt-oss adds one learned logit per query head to every softmax, an extra column with no key and
  no value ("attention sinks" in its paper; here ``sink_logits``, as kvcache's ``sinks`` are the
  first tokens a policy keeps): each query's weights then sum to less than one.

Neither fits a fused SDPA call, so attention with ``Scores`` takes the explicit-softmax path of
``kvcache.kernels.attention`` (query blocks of bounded size, never a T x T buffer).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Scores:
    """softcap: the cap of Gemma 2's soft-capping, or None.
    sink_logits: (Hq,) the learned per-head logit of gpt-oss's extra softmax column, or None
    (the model's parameter itself, so gradients reach it)."""

    softcap: float | None = None
    sink_logits: torch.Tensor | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.softcap is not None and not self.softcap > 0:
            raise ValueError(f"softcap must be positive or None, got {self.softcap}")

    def capped(self, scores: torch.Tensor) -> torch.Tensor:
        """Scaled scores (any shape) after soft-capping, in their dtype."""
        if self.softcap is None:
            return scores
        return torch.tanh(scores / self.softcap) * self.softcap

    def softmax(self, scores: torch.Tensor, hidden: torch.Tensor | None) -> torch.Tensor:
        """Softmax weights over the last axis of float32 ``scores`` (B, Hkv, G, n, S) (query head
        h = kv_head * G + g), with the keys where ``hidden`` (broadcastable bool) is True left out
        and the sink column, if any, in the denominator only. A row that sees no key gets zero
        weights with a sink and uniform ones without (padding, which no one reads). ``scores`` may
        be overwritten."""
        scores = self.capped(scores)
        if hidden is not None:
            # In place: callers pass a fresh product (or cast) that nothing else holds, so the fill
            # takes no second buffer of the block's size; a large finite fill (not -inf) keeps a row
            # with no visible key free of NaN.
            scores = scores.masked_fill_(hidden, torch.finfo(scores.dtype).min)
        if self.sink_logits is None:
            return scores.softmax(-1)
        _, Hkv, G = scores.shape[:3]
        sink = self.sink_logits.float().view(1, Hkv, G, 1, 1)
        top = torch.maximum(scores.amax(-1, keepdim=True), sink)
        e = torch.exp(scores - top)
        return e / (e.sum(-1, keepdim=True) + torch.exp(sink - top))
