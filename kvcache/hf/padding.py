"""Padding as transformers marks it, in the layout kvcache's ``Step`` takes.

transformers marks padding with a 2D ``attention_mask`` (B, seen + T) of ones and zeros over
every column the model has been fed, and ``generate`` pads a batch on the LEFT. A kvcache
``Step`` takes RIGHT padding: the first ``n_tokens[b]`` tokens of row b's chunk are real. So a
chunk whose real tokens form one contiguous run per row (left padding, right padding, or both)
is rotated along the token axis, per row, until each run starts at index 0; the layer cache
attends in that layout and the output is rotated back. A row whose padding lies between real
tokens has no such layout and is refused.

Only the chunk's own columns (the last T of the mask) matter: earlier padding was never stored.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Layout:
    """Where the real tokens of one (B, T) chunk are.

    n_tokens: (B,) long, CPU. Real tokens per row; None when every token is real.
    pad:      (B, T) bool, device. True at padding, in transformers' layout; None when none.
    front:    (B, T) long, device. ``front[b, t]`` is the column whose token goes to place t
              when each row's real run is moved to the front; None when every run already
              starts at column 0 (no left padding), so nothing moves.
    back:     (B, T) long, device. The inverse of ``front``.
    """

    n_tokens: torch.Tensor | None = None
    pad: torch.Tensor | None = None
    front: torch.Tensor | None = None
    back: torch.Tensor | None = None


def layout(attention_mask: torch.Tensor | None, batch: int, T: int) -> Layout:
    """The layout of a chunk of ``T`` tokens per row from transformers' ``attention_mask``
    (B, >= T), 1 or True for real tokens, or None (every token is real)."""
    if attention_mask is None:
        return Layout()
    if attention_mask.dim() != 2:
        raise ValueError(
            f"kvcache.hf takes the 2D padding mask (batch, tokens) as attention_mask, got shape "
            f"{tuple(attention_mask.shape)}: kvcache derives which keys each query sees from positions, so a "
            "prepared 4D mask cannot be honoured"
        )
    B, K = attention_mask.shape
    if B != batch or K < T:
        raise ValueError(
            f"attention_mask has shape {(B, K)} but the chunk is {batch} rows of {T} tokens: it must cover "
            "(batch, tokens seen before + tokens of this chunk)"
        )
    real = attention_mask[:, K - T:].bool()
    host = real.cpu()
    if bool(host.all()):
        return Layout()
    n = host.sum(1)
    first = host.long().argmax(1)  # index of the first real token (0 for a row without any)
    t = torch.arange(T)
    run = (t >= first[:, None]) & (t < (first + n)[:, None])
    if not torch.equal(run, host):
        row = int((run != host).any(1).long().argmax())
        raise ValueError(
            f"attention_mask row {row} has padding between real tokens in this chunk ({host[row].long().tolist()}); "
            "kvcache.hf takes padding before a row's tokens (left, as generate pads) or after them (right)"
        )
    pad = (~real).to(attention_mask.device)
    if not bool(first.any()):
        return Layout(n_tokens=n, pad=pad)
    dev = attention_mask.device
    front = ((t + first[:, None]) % T).to(dev)
    back = ((t - first[:, None]) % T).to(dev)
    return Layout(n_tokens=n, pad=pad, front=front, back=back)


def move(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x (B, H, T, D) with place t of row b taken from column ``index[b, t]``; index (B, T)."""
    return x.gather(2, index[:, None, :, None].expand_as(x))
