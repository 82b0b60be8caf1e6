"""A chunk's attention over packed slots decoded one block at a time, through the fused kernel.

A chunk whose queries read every stored slot as its codes mean (per-token codes, where a token's
bits do not depend on its slot; KIVI as ``KiviStorage.attend_chunk`` arranges it) can attend the
decoded slots with the fused kernel (SDPA) rather than over the codes, at dense attention's cost.
Decoding the whole span first would hold a full-precision copy of the layer's stored cache, as
large as a dense cache, for as long as the chunk runs. Here each block of slots is decoded,
attended by every query of the chunk, and folded into the running output by the block's
log-sum-exp, which the CPU's fused kernel returns beside its output: what is held at once
follows the block (``BLOCK_BYTES``), not the cache.

On the CPU, the leading slots of a block that every query of a query block sees (a chunk's
stored past) take a fused call without a mask, folded with the masked call over the rest.
Off the CPU the span is one block (the log-sum-exp kernel used here is the CPU's), as it is for
queries that carry a gradient: one fused call per query block, with nothing to fold.

Shapes: B rows, Hq query heads, Hkv K/V heads (G = Hq // Hkv), T queries, S slots, D head_dim.
"""

from __future__ import annotations

import torch

from ..quant.packed import PackedKeys, PackedValues
from .sdpa import sdpa
from .visibility import visibility

# Decoded keys and values (float32 reckoning) held at once: 256 slots of 8 K/V heads of 128
# channels, 4096 of 2 heads of 128 (one layer of which, at 32k tokens, is 64 MiB decoded whole).
# Decoding a block takes a few temporaries of its size: in one run each, 8 MiB blocks left a
# 4096-token chunked prefill 16-21% above dense's peak, 2 MiB ones 5-10%, times within 7%
# (benchmarks/prefill.py; peaks of that size move by as much from run to run).
BLOCK_BYTES = 2**21
# Fewest slots per block (small heads would otherwise make many tiny fused calls).
MIN_BLOCK = 256
# Queries whose (queries x slots) mask and scores exist at a time.
QUERY_BLOCK = 1024


# Fewest leading slots, visible to every query of a query block, worth a fused call of their own
# without a mask (14-21% faster than the masked call over the same slots, measured on the CPU).
MIN_UNMASKED = 256


def folds(q: torch.Tensor) -> bool:
    """Whether queries ``q`` can attend blocks apart and fold them: on the CPU, whose fused
    kernel returns the log-sum-exp, and without a gradient to carry (it carries none)."""
    return q.device.type == "cpu" and not (q.requires_grad and torch.is_grad_enabled())


def slot_blocks(keys: PackedKeys, span: int, q: torch.Tensor, group: int = 0, start: int = 0) -> list[tuple[int, int]]:
    """Slot ranges covering [start, span) of ``keys``' rows, each holding at most about
    ``BLOCK_BYTES`` decoded, a multiple of ``group`` slots (KIVI's key groups) when given.
    One block where queries ``q`` cannot fold blocks (``folds``)."""
    B, H, _, D = keys.codes.shape[0], keys.codes.shape[1], keys.slots, keys.head_dim
    if span <= start or not folds(q):
        return [(start, span)]
    step = max(MIN_BLOCK, BLOCK_BYTES // (2 * 4 * B * H * D))
    if group:
        step = max(group, step // group * group)
    return [(s, min(s + step, span)) for s in range(start, span, step)]


class Fold:
    """Queries' outputs over blocks of keys attended apart: a running output (float32) and
    log-sum-exp per query, combined in place as each block is added.

    q: (B, Hq, T, D). Where the queries cannot fold (``folds``: off the CPU, or carrying a
    gradient) each query range is added once, over its one block, and ``add`` writes the fused
    call's output as it is. Otherwise a block's leading slots that every query of the range sees
    take a call without a mask, the rest a masked one, both folded in place. ``acc`` (q's shape,
    float32) and ``lse`` (q's shape but D): what another fold of these queries has gathered, to
    go on from (views into it, which this fold then updates); default: nothing yet.
    """

    def __init__(self, q: torch.Tensor, acc: torch.Tensor | None = None, lse: torch.Tensor | None = None) -> None:
        self.q = q
        self.single = not folds(q)
        if acc is not None and (self.single or lse is None):
            raise ValueError("a fold goes on from another's acc and lse only where queries fold (folds(q))")
        # Zero where no query saw a key (padding). Folding keeps float32 whatever q's dtype.
        self.acc = acc if acc is not None else torch.zeros_like(q, dtype=q.dtype if self.single else torch.float32)
        self.lse = lse if acc is not None else (
            None if self.single else torch.full(q.shape[:-1], float("-inf"), device=q.device))

    def add(self, rows: slice, t0: int, t1: int, k: torch.Tensor, v: torch.Tensor, vis: torch.Tensor | None) -> None:
        """Fold in queries [t0, t1) of ``rows`` over one block: k, v (b, Hkv, m, D) decoded,
        vis (b, 1 or Hkv, n, m) bool, which keys each query may see (None: every one)."""
        q = self.q[rows, :, t0:t1]
        G = q.shape[1] // k.shape[1]
        if vis is not None and vis.shape[1] > 1 and G > 1:
            vis = vis.repeat_interleave(G, dim=1)  # per K/V head -> per query head
        if self.single:
            out = sdpa(q, k, v, attn_mask=vis, enable_gqa=G > 1)
            if vis is not None:
                # A query that sees no key (padding) gets 0, as ``out`` promises: the CPU's kernel
                # gives 0 there, CUDA's memory-efficient kernel the mean of the values.
                out = out.masked_fill(~vis.any(-1, keepdim=True), 0.0)
            self.acc[rows, :, t0:t1] = out
            return
        if vis is None:
            self._fold(rows, t0, t1, *_fused(q, k, v, None))
            return
        # Leading slots every query sees (the stored past of a chunk): one call without a mask.
        cut = int(vis.flatten(0, 2).all(0).cumprod(0).sum())
        if cut >= MIN_UNMASKED:
            self._fold(rows, t0, t1, *_fused(q, k[:, :, :cut], v[:, :, :cut], None))
            k, v, vis = k[:, :, cut:], v[:, :, cut:], vis[..., cut:]
            if k.shape[2] == 0:
                return
        seen = vis.any(-1)  # (b, 1 or Hq, n)
        if not bool(seen.any()):
            return
        out, lse = _fused(q, k, v, vis)
        # A query that sees no key of the block gets output 0 and log-sum-exp 0 from the kernel:
        # it must weigh nothing.
        self._fold(rows, t0, t1, out, lse.masked_fill(~seen.expand_as(lse), float("-inf")))

    def _fold(self, rows: slice, t0: int, t1: int, out: torch.Tensor, lse: torch.Tensor) -> None:
        """Fold one call's out (b, Hq, n, D) and lse (b, Hq, n) into queries [t0, t1) of ``rows``."""
        acc, acc_lse = self.acc[rows, :, t0:t1], self.lse[rows, :, t0:t1]
        total = torch.logaddexp(acc_lse, lse)
        safe = total.masked_fill(torch.isinf(total), 0.0)  # queries that have seen nothing yet
        acc.mul_((acc_lse - safe).exp_().unsqueeze(-1)).add_(out.float() * (lse - safe).exp_().unsqueeze(-1))
        acc_lse.copy_(total)

    def out(self) -> torch.Tensor:
        """(B, Hq, T, D) at q's dtype; 0 where no query saw a key (padding)."""
        return self.acc.to(self.q.dtype)


def _fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, vis: torch.Tensor | None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU's fused attention with each query's log-sum-exp: q (b, Hq, n, D), k, v (b, Hkv,
    m, D), vis (b, 1 or Hq, n, m) bool or None (every key visible) -> out (b, Hq, n, D), lse
    (b, Hq, n) float32."""
    bias = None if vis is None else torch.zeros(vis.shape, dtype=q.dtype, device=q.device).masked_fill_(
        ~vis, float("-inf"))
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=bias)


def attend_decoded(q: torch.Tensor, k: PackedKeys, v: PackedValues, q_pos: torch.Tensor, k_pos: torch.Tensor,
                   *, window: int | None = None) -> torch.Tensor:
    """``attention.masked(q, k.decoded(), v.decoded(), q_pos, k_pos, window=window)`` without
    decoding the views whole: for views whose slots every query reads alike (per-token codes).

    q: (B, Hq, T, D); q_pos: (B, T); k_pos: (B, Hp, S) -> (B, Hq, T, D).
    """
    T = q.shape[2]
    blocks = slot_blocks(k, k.slots, q)
    fold = Fold(q)
    rows = slice(0, q.shape[0])
    for s0, s1 in blocks:
        kb, vb = k.decode(s0, s1), v.decode(s0, s1)
        for t0 in range(0, T, QUERY_BLOCK):
            t1 = min(t0 + QUERY_BLOCK, T)
            fold.add(rows, t0, t1, kb, vb, visibility(q_pos[:, t0:t1], k_pos[..., s0:s1], window))
    return fold.out()
