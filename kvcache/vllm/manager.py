"""The scheduler side: a block manager that frees the blocks a running request no longer reads.

vLLM calls ``remove_skipped_blocks`` from ``allocate_slots`` before every step of a request, with
the tokens already computed and the prompt length, and before it allocates the step's blocks.
Every block the request's next query does not read (rule.BlockRule.kept_before) goes back to the
pool, where other requests take it, and its place in the request's table becomes vLLM's null
block (as vLLM's sliding-window managers do). This holds during the prompt too: under window and
sink a block leaves as soon as the window passes it, under a scoring policy when the prompt
chunk that evicts it is done. So a request holds at most its budget plus the blocks its step
writes (``BlockRule.bound``), which the KV cache spec reports to vLLM's start-up check and this
manager to its admission check (``max_admission_blocks_per_request``): a prompt longer than the
whole pool is admitted and served.

Each request has its own rule: the engine's configuration, or the one its
``SamplingParams(extra_args={"kvcache": {...}})`` gives (rule.request_rule).
"""

from __future__ import annotations

import weakref
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
        # Per request, where its prompt's calls ended (scoring policies, rule.py): kept while the
        # request lives, across preemptions, so that a recompute keeps what each call read.
        self._calls: weakref.WeakKeyDictionary[Request, list[int]] = weakref.WeakKeyDictionary()
        self.calls: dict[str, list[int]] = {}
        # vLLM's admission check (``allocate_slots(full_sequence_must_fit=True)``, and the blocks
        # it keeps free for prompts being computed) counts a request's blocks up to this many, as
        # for its sliding-window layers: what the engine's rule holds at most while a step of
        # vLLM's largest batch is computed (KVCacheAttentionSpec.max_memory_usage_bytes).
        self.max_admission_blocks_per_request = kv_cache_spec.admission_blocks()
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
        rid = request.request_id
        if rid not in self.rules:
            self.rules[rid] = request_rule(self.engine, options(request.sampling_params))
            self.calls[rid] = self._calls.setdefault(request, [])

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        n = processed_computed_tokens
        blocks = self.req_to_blocks.get(request_id)
        if num_prompt_tokens is None or not blocks:
            return
        rule = self.rules.get(request_id)
        if rule is None:
            raise RuntimeError(f"kvcache vLLM plugin: request {request_id!r} has computed tokens but its "
                               "configuration was never recorded (cache_blocks was not called)")
        calls = self.calls[request_id]
        if rule.scoring and (calls[-1] if calls else 0) < n <= num_prompt_tokens:
            # A prompt chunk computed for the first time ended here (steps end where calls do).
            calls.append(n)
        if n <= rule.cache_length:
            return
        kept = set(rule.kept_before(n, num_prompt_tokens, calls))
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
        self.calls.pop(request_id, None)
        return super().pop_blocks_for_free(request_id)

    def live_blocks(self, request_id: str) -> int:
        """Blocks the request holds now (its null entries are freed ones)."""
        return sum(not b.is_null for b in self.req_to_blocks.get(request_id, ()))

    def budget(self, request_id: str) -> int:
        """Blocks the request keeps between its steps, the one being filled included."""
        return -(-self.rules[request_id].cache_length // self.block_size)
