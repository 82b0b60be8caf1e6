"""A chunk's attention over packed slots decoded one block at a time, through the fused kernel.

A chunk whose queries read every stored slot as its codes mean (per-token codes, where a token's
bits do not depend on its slot; KIVI as ``KiviStorage.attend_chunk`` arranges it) can attend the
decoded slots with the fused kernel (SDPA) rather than over the codes, at dense attention's cost.
Decoding the whole span first would hold a full-precision copy of the layer's stored cache, as
large as a dense cache, for as long as the chunk runs. Here each block of slots is decoded,
attended by every query of the chunk, and folded into the running output by the block's
log-sum-exp, which the CPU's fused kernel returns beside its output: what is held at once
follows the block (``BLOCK_BYTES``), not the cache.

Off the CPU the span is one block (the log-sum-exp kernel used here is the CPU's), as it is on
the CPU when it fits in one, and for queries that carry a gradient: one fused call per query
block, with nothing to fold.

Shapes: B rows, Hq query heads, Hkv K/V heads (G = Hq // Hkv), T queries, S slots, D head_dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..quant.packed import PackedKeys, PackedValues
from .visibility import visibility

# Decoded keys and values (float32 reckoning) held at once: 256 slots of 8 K/V heads of 128
# channels, 4096 of 2 heads of 128 (one layer of which, at 32k tokens, is 64 MiB decoded whole).
# Decoding a block takes a few temporaries of its size: 8 MiB blocks left a 4096-token chunked
# prefill 16-21% above dense's peak, 2 MiB ones 5-10%, at the same speed (benchmarks/prefill.py).
BLOCK_BYTES = 2**21
# Fewest slots per block (small heads would otherwise make many tiny fused calls).
MIN_BLOCK = 256
# Queries whose (queries x slots) mask and scores exist at a time.
QUERY_BLOCK = 1024


def slot_blocks(keys: PackedKeys, span: int, q: torch.Tensor, group: int = 0) -> list[tuple[int, int]]:
    """Slot ranges covering [0, span) of ``keys``' rows, each holding at most about
    ``BLOCK_BYTES`` decoded, a multiple of ``group`` slots (KIVI's key groups) when given.
    One block for queries ``q`` that carry a gradient (chunked training): the kernel's
    log-sum-exp carries none, so blocks could not be folded differentiably."""
    B, H, _, D = keys.codes.shape[0], keys.codes.shape[1], keys.slots, keys.head_dim
    if keys.device.type != "cpu" or span == 0 or (q.requires_grad and torch.is_grad_enabled()):
        return [(0, span)]
    step = max(MIN_BLOCK, BLOCK_BYTES // (2 * 4 * B * H * D))
    if group:
        step = max(group, step // group * group)
    return [(s, min(s + step, span)) for s in range(0, span, step)]


class Fold:
    """Queries' outputs over blocks of keys attended apart: a running output (float32) and
    log-sum-exp per query, combined in place as each block is added.

    q: (B, Hq, T, D). With ``blocks == 1`` nothing is folded: ``add`` writes the fused call's
    output as it is (the same numbers as one call over every slot), and gradients flow through
    it; several blocks are folded in place, for queries that carry no gradient (``slot_blocks``).
    """

    def __init__(self, q: torch.Tensor, blocks: int) -> None:
        self.q = q
        self.single = blocks == 1
        # Zero where no query saw a key (padding). Folding keeps float32 whatever q's dtype.
        self.acc = torch.zeros_like(q, dtype=q.dtype if self.single else torch.float32)
        self.lse = None if self.single else torch.full(q.shape[:-1], float("-inf"), device=q.device)

    def add(self, rows: slice, t0: int, t1: int, k: torch.Tensor, v: torch.Tensor, vis: torch.Tensor) -> None:
        """Fold in queries [t0, t1) of ``rows`` over one block: k, v (b, Hkv, m, D) decoded,
        vis (b, 1 or Hkv, n, m) bool, which keys each query may see."""
        q = self.q[rows, :, t0:t1]
        G = q.shape[1] // k.shape[1]
        if vis.shape[1] > 1 and G > 1:
            vis = vis.repeat_interleave(G, dim=1)  # per K/V head -> per query head
        if self.single:
            self.acc[rows, :, t0:t1] = F.scaled_dot_product_attention(q, k, v, attn_mask=vis, enable_gqa=G > 1)
            return
        seen = vis.any(-1)  # (b, 1 or Hq, n)
        if not bool(seen.any()):
            return
        bias = torch.zeros(vis.shape, dtype=q.dtype, device=q.device).masked_fill_(~vis, float("-inf"))
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=bias)
        # A query that sees no key of the block gets output 0 and log-sum-exp 0 from the kernel:
        # it must weigh nothing.
        lse = lse.masked_fill(~seen.expand_as(lse), float("-inf"))
        acc, acc_lse = self.acc[rows, :, t0:t1], self.lse[rows, :, t0:t1]
        total = torch.logaddexp(acc_lse, lse)
        safe = total.masked_fill(torch.isinf(total), 0.0)  # queries that have seen nothing yet
        acc.mul_((acc_lse - safe).exp_().unsqueeze(-1)).add_(out.float() * (lse - safe).exp_().unsqueeze(-1))
        acc_lse.copy_(total)

    def out(self) -> torch.Tensor:
        """(B, Hq, T, D) at q's dtype; 0 where no query saw a key (padding)."""
        return self.acc.to(self.q.dtype)


def attend_decoded(q: torch.Tensor, k: PackedKeys, v: PackedValues, q_pos: torch.Tensor, k_pos: torch.Tensor,
                   *, window: int | None = None) -> torch.Tensor:
    """``attention.masked(q, k.decoded(), v.decoded(), q_pos, k_pos, window=window)`` without
    decoding the views whole: for views whose slots every query reads alike (per-token codes).

    q: (B, Hq, T, D); q_pos: (B, T); k_pos: (B, Hp, S) -> (B, Hq, T, D).
    """
    T = q.shape[2]
    blocks = slot_blocks(k, k.slots, q)
    fold = Fold(q, len(blocks))
    rows = slice(0, q.shape[0])
    for s0, s1 in blocks:
        kb, vb = k.decode(s0, s1), v.decode(s0, s1)
        for t0 in range(0, T, QUERY_BLOCK):
            t1 = min(t0 + QUERY_BLOCK, T)
            fold.add(rows, t0, t1, kb, vb, visibility(q_pos[:, t0:t1], k_pos[..., s0:s1], window))
    return fold.out()
