"""The scheduler side: a block manager that frees the blocks a running request no longer keeps.

vLLM calls ``remove_skipped_blocks`` from ``allocate_slots`` before every step of a request, with
the tokens already computed and the prompt length. While the prompt is being computed nothing is
freed (the prompt is attended whole); afterwards every block the request's rule does not keep of
the tokens computed so far goes back to the pool, where other requests take it, and its place in
the request's table becomes vLLM's null block (as vLLM's sliding-window managers do).

Each request has its own rule: the engine's configuration, or the one its
``SamplingParams(extra_args={"kvcache": {...}})`` gives (rule.request_rule).
"""

from __future__ import annotations

from collections.abc import Sequence

from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.request import Request

from .requests import options
from .rule import BlockRule, request_rule
from .spec import KVCacheAttentionSpec


class KVCacheBlockManager(FullAttentionManager):
    def __init__(self, kv_cache_spec: KVCacheAttentionSpec, **kwargs) -> None:
        super().__init__(kv_cache_spec, **kwargs)
        if kv_cache_spec.kvcache is None:
            raise ValueError("KVCacheBlockManager needs a KV cache spec with a kvcache configuration")
        if self.block_size != kv_cache_spec.kvcache.block:
            raise ValueError(f"vLLM's block size {self.block_size} differs from the kvcache rule's {kv_cache_spec.kvcache.block} "
                             "(context parallelism is not supported)")
        self.engine = kv_cache_spec.kvcache
        self.rules: dict[str, BlockRule] = {}
        # Prefix caching is refused at engine start, so this manager caches nothing; but
        # cache_blocks is the one call vLLM makes to a manager with the request itself (after
        # every allocation, before the request's first step), and only to managers that cache.
        # It is where the request's own options are read (cache_blocks below).
        self.enable_caching = True

    def cache_blocks(self, request: Request, num_tokens: int, retention_interval: int | None = None, *,
                     replay_boundaries: Sequence[int]) -> None:
        """Not prefix caching: records the rule of ``request`` (its extra_args["kvcache"] over
        the engine's configuration), once per admission (a preempted request is freed, then
        admitted again)."""
        if request.request_id not in self.rules:
            self.rules[request.request_id] = request_rule(self.engine, options(request.sampling_params))

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        n = processed_computed_tokens
        if num_prompt_tokens is None or n < num_prompt_tokens:
            return
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        rule = self.rules.get(request_id)
        if rule is None:
            raise RuntimeError(f"kvcache vLLM plugin: request {request_id!r} has computed its prompt but its "
                               "configuration was never recorded (cache_blocks was not called)")
        if n <= rule.cache_length:
            return
        kept = set(rule.kept_blocks(n))
        # Blocks at and after the one being filled hold tokens not yet computed: never freed here.
        freed = []
        for i in range(min(-(-n // self.block_size), len(blocks))):
            if i not in kept and not blocks[i].is_null:
                freed.append(blocks[i])
                blocks[i] = self._null_block
        if freed:
            self.block_pool.free_blocks(freed)

    def pop_blocks_for_free(self, request_id: str) -> list:
        # Every way vLLM frees a request (finished, aborted, preempted) comes through here.
        self.rules.pop(request_id, None)
        return super().pop_blocks_for_free(request_id)

    def live_blocks(self, request_id: str) -> int:
        """Blocks the request holds now (its null entries are freed ones)."""
        return sum(not b.is_null for b in self.req_to_blocks.get(request_id, ()))

    def budget(self, request_id: str) -> int:
        """Blocks the request may hold after its prompt, besides the one being filled."""
        return -(-self.rules[request_id].cache_length // self.block_size)
