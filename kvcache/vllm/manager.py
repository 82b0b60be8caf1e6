"""The scheduler side: a block manager that frees the blocks a running request no longer keeps.

vLLM calls ``remove_skipped_blocks`` from ``allocate_slots`` before every step of a request, with
the tokens already computed and the prompt length. While the prompt is being computed nothing is
freed (the prompt is attended whole); afterwards every block the policy does not keep of the
tokens computed so far goes back to the pool, where other requests take it, and its place in
the request's table becomes vLLM's null block (as vLLM's sliding-window managers do).
"""

from __future__ import annotations

from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

from .rule import BlockRule
from .spec import KVCacheAttentionSpec


class KVCacheBlockManager(FullAttentionManager):
    def __init__(self, kv_cache_spec: KVCacheAttentionSpec, **kwargs) -> None:
        super().__init__(kv_cache_spec, **kwargs)
        if kv_cache_spec.kvcache is None:
            raise ValueError("KVCacheBlockManager needs a KV cache spec with a kvcache configuration")
        if self.block_size != kv_cache_spec.kvcache.block:
            raise ValueError(f"vLLM's block size {self.block_size} differs from the kvcache rule's {kv_cache_spec.kvcache.block} "
                             "(context parallelism is not supported)")
        self.rule = BlockRule(kv_cache_spec.kvcache)

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        n = processed_computed_tokens
        if num_prompt_tokens is None or n < num_prompt_tokens or n <= self.rule.cache_length:
            return
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        kept = set(self.rule.kept_blocks(n))
        # Blocks at and after the one being filled hold tokens not yet computed: never freed here.
        freed = []
        for i in range(min(-(-n // self.block_size), len(blocks))):
            if i not in kept and not blocks[i].is_null:
                freed.append(blocks[i])
                blocks[i] = self._null_block
        if freed:
            self.block_pool.free_blocks(freed)

    def live_blocks(self, request_id: str) -> int:
        """Blocks the request holds now (its null entries are freed ones)."""
        return sum(not b.is_null for b in self.req_to_blocks.get(request_id, ()))
