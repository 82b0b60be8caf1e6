"""Where vLLM's CPU kernel puts a token's key and value inside a KV block, found by asking it.

vLLM's CPU attention cache is ``(num_blocks, num_kv_heads, block_size, 2 * head_size)``: per block
and K/V head one slab of ``2 * block_size * head_size`` numbers, keys first, then values. How a
slab is ordered inside depends on the instruction set the kernel was built for (the ``vec`` path
stores each block's keys transposed, values in token order; others pack differently). Rather than
mirror each layout, the scoring worker (scoring.py) writes probe tokens through the kernel's own
``cpu_attn_reshape_and_cache`` once per layout and reads the order back: token indices, then
channel indices, both exact in any float type for blocks and heads of at most 256.

Moving whole slabs (a head's block) needs no layout at all; reading keys and values to score
them does.
"""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=16)
def slab_order(isa: str, dtype: torch.dtype, block: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(key_index, value_index), each (block, head_dim) long: the offset, within one head's slab
    of a block flattened to ``2 * block * head_dim``, of token t's channel d."""
    from vllm import _custom_ops as ops

    if max(block, head_dim) > 256:
        raise ValueError(f"kvcache vLLM plugin: blocks and heads of at most 256 are supported, got {block}, {head_dim}")
    t = torch.arange(block, dtype=torch.float32)[:, None, None].expand(block, 1, head_dim)
    d = torch.arange(head_dim, dtype=torch.float32)[None, None, :].expand(block, 1, head_dim)
    slots = torch.arange(block)

    def write(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cache = torch.full((1, 1, block, 2 * head_dim), -1.0, dtype=dtype)
        keys, values = cache.view(1, 1, 2 * block, head_dim).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(k.to(dtype).contiguous(), v.to(dtype).contiguous(), keys, values, slots, isa,
                                       k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
        return cache.reshape(-1).float()

    tokens, channels = write(t, -1.0 - t), write(d, -1.0 - d)
    n = block * head_dim
    # Keys were written as t and d, values as -1 - t and -1 - d: each half must hold its own.
    halves = ((tokens[:n], channels[:n]), (-1.0 - tokens[n:], -1.0 - channels[n:]))
    if any(bool((x < 0).any()) for half in halves for x in half):
        raise RuntimeError(f"kvcache vLLM plugin: vLLM's CPU kernel ({isa}) keeps keys and values outside their "
                           "halves of a KV block; this layout is not supported")
    order = []
    for base, (found_t, found_d) in zip((0, n), halves):
        index = torch.empty(n, dtype=torch.long)
        index[found_t.long() * head_dim + found_d.long()] = torch.arange(base, base + n)
        order.append(index.view(block, head_dim))
    key_index, value_index = order
    return key_index, value_index


def read(kv_cache: torch.Tensor, blocks: torch.Tensor, isa: str, values: bool = False) -> torch.Tensor:
    """The keys (or with ``values`` the values) of ``blocks`` (..., M) long, in order:
    (..., Hkv, M * block, D) in the cache's dtype, ``kv_cache`` being one layer's
    ``(num_blocks, Hkv, block, 2 * D)``. Keys the kernel stores transposed come back as the
    transpose of a contiguous (..., Hkv, D, M * block) tensor: one copy after the gather, and
    ``k.transpose(-1, -2)`` (what attention multiplies by) is contiguous."""
    nb, H, N, D2 = kv_cache.shape
    D = D2 // 2
    lead, M = blocks.shape[:-1], blocks.shape[-1]
    half = kv_cache.view(nb, H, 2, N * D)[:, :, int(values)]  # (num_blocks, Hkv, N D), one half
    index = slab_order(isa, kv_cache.dtype, N, D)[int(values)] - int(values) * N * D
    out = _by_head(half[blocks.reshape(-1)].view(-1, M, H, N * D), index, N, D)
    return out.reshape(*lead, H, M * N, D)


def _by_head(half: torch.Tensor, index: torch.Tensor, N: int, D: int) -> torch.Tensor:
    """(R, Hkv, M N, D) from one half of each slab, ``half`` (R, M, Hkv, N D), laid out as
    ``index`` (N, D) says: token order or transposed (the ``vec`` kernel's keys) by a permuted
    copy, anything else by a gather."""
    R, M, H = half.shape[:3]
    flat = torch.arange(N * D)
    if torch.equal(index, flat.view(D, N).t()):
        # (R, M, H, D, N) -> (R, H, D, M, N): the transpose of the result, contiguous.
        return half.view(R, M, H, D, N).permute(0, 2, 3, 1, 4).reshape(R, H, D, M * N).transpose(-1, -2)
    if not torch.equal(index.reshape(-1), flat):
        half = half[..., index.reshape(-1)]
    return half.view(R, M, H, N, D).permute(0, 2, 1, 3, 4).reshape(R, H, M * N, D)
