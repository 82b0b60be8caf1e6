"""Block granularity (``block=N``, an option of every policy): evict whole aligned blocks.

Positions are grouped into aligned blocks ``[k N, (k + 1) N)``, the unit a paged serving engine
allocates and frees (and ChunkKV's chunks). With ``block > 1`` an evicting cache keeps whole
blocks only, and the one rule, applied wherever candidates are ranked (evicting.py), is:

    * a block's priority is the sum of its tokens' priorities (a protected token, a sink or a
      recent one, protects its block); ties go to the newer block;
    * the block that holds the row's newest position (the block being filled) is always kept;
    * blocks are kept in priority order while the tokens they hold fit in the row's room
      (``cache_length``, or ``cache_length - reserve`` when the call overflows).

So every kept block is complete except the newest, and no row holds more than ``cache_length``
tokens. Attention then sees exactly the kept tokens and the call's own (no per-query window): a
call attends over what is kept plus its chunk and evicts afterwards, as a paged engine that frees
a request's blocks between its steps does. ``block = 1`` is the token-level behaviour of each
policy, unchanged.
"""

from __future__ import annotations

import torch

EMPTY = float("-inf")


def check_block(block: object, policy: str, evicts: bool, smallest_room: int) -> None:
    """The one place ``block`` is validated: a positive int that leaves room for a whole block in
    every layer's (and head's) budget less ``reserve`` (``smallest_room``)."""
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"block must be a positive int (positions per block; 1 evicts single tokens), got {block!r}")
    if block > 1 and evicts and block > smallest_room:
        raise ValueError(
            f"block={block} does not fit the {policy} policy's smallest budget less reserve ({smallest_room} "
            f"tokens): the block being filled is always kept, so raise cache_length or lower block"
        )


def keep_whole_blocks(
    priority: torch.Tensor, positions: torch.Tensor, block: int, newest: torch.Tensor | int, room: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply the block rule to N candidates.

    priority:  (B, Hp, N) float, EMPTY for an empty candidate.
    positions: (B, Hp, N) long, -1 for an empty candidate.
    newest:    each row's newest position, an int or (B, 1, 1).
    room:      (B,) long: tokens each row may keep.
    Returns the priorities with every candidate outside a kept block set to EMPTY and the kept
    ones to 0 (so a top-``cache_length`` selection takes exactly the kept ones), and (B,) long
    (CPU), the tokens each row keeps (the most over its heads).
    """
    B, Hp, N = positions.shape
    device = positions.device
    filled = positions >= 0
    ids = torch.where(filled, positions // block, 0)  # (B, Hp, N) block of each candidate
    K = int(ids.max()) + 1 if N else 1
    # Sums in float64: protected priorities (1e30) added to ordinary scores keep their order.
    score = torch.zeros(B, Hp, K, dtype=torch.float64, device=device)
    score.scatter_add_(2, ids, torch.where(filled, priority.double(), 0.0))
    size = torch.zeros(B, Hp, K, dtype=torch.long, device=device)
    size.scatter_add_(2, ids, filled.long())
    index = torch.arange(K, device=device)
    newest_block = newest // block if isinstance(newest, int) else (newest // block).to(device)
    score = torch.where(index == newest_block, float("inf"), score).masked_fill(size == 0, EMPTY)
    # Newest block first, then a stable sort by priority: ties keep the newer block.
    newest_first = index.flip(0)
    ranked = newest_first[score[..., newest_first].sort(dim=-1, descending=True, stable=True).indices]  # (B, Hp, K)
    held = size.gather(2, ranked).cumsum(-1)
    fits = held <= room.to(device)[:, None, None]
    kept_block = torch.zeros(B, Hp, K, dtype=torch.bool, device=device).scatter_(2, ranked, fits)
    kept = kept_block.gather(2, ids) & filled
    return torch.where(kept, 0.0, EMPTY).to(priority.dtype), kept.sum(-1).amax(-1).cpu()
