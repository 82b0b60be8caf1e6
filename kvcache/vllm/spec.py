"""The KV cache spec of layers under a kvcache policy: full attention plus the checked
configuration, which is how the scheduler's block manager (created from the spec alone) learns it.

The spec also tells vLLM how much KV memory one request needs at most. vLLM's own answer for full
attention is the whole ``max_model_len``; under a kvcache policy a request frees what its rule
drops after every step, prompt chunks included (manager.py), so it holds at most its budget plus
the blocks of the step being computed. vLLM's start-up check (one request of ``max_model_len``
must fit the KV memory) and its admission check (manager.py) use this bound, as they do for
sliding-window layers; a prompt longer than the whole pool can then be served.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from vllm.v1.kv_cache_interface import FullAttentionSpec

from .config import PluginConfig


@dataclass(frozen=True, kw_only=True)
class KVCacheAttentionSpec(FullAttentionSpec):
    kvcache: PluginConfig | None = None
    # Tokens vLLM may schedule for one step (``VllmConfig.max_in_flight_tokens``): the most a
    # request's step can add to its blocks. 0: unknown (then no bound is claimed).
    in_flight_tokens: int = 0

    @classmethod
    def merge(cls, specs: list[KVCacheAttentionSpec]) -> KVCacheAttentionSpec:
        # FullAttentionSpec.merge rebuilds the spec from vLLM's own fields; every layer of a
        # group carries the same configuration, which is put back.
        configs = {(spec.kvcache, spec.in_flight_tokens) for spec in specs}
        if len(configs) != 1:
            raise ValueError(f"the layers of one KV cache group have different kvcache configurations: {configs}")
        config, in_flight = configs.pop()
        return dataclasses.replace(super().merge(specs), kvcache=config, in_flight_tokens=in_flight)

    @classmethod
    def of(cls, spec: FullAttentionSpec, config: PluginConfig, in_flight_tokens: int = 0) -> KVCacheAttentionSpec:
        """``spec`` with ``config`` attached."""
        fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if f.init}
        return cls(**fields, kvcache=config, in_flight_tokens=in_flight_tokens)

    def admission_blocks(self, in_flight_tokens: int | None = None) -> int | None:
        """The most blocks a request under the engine's configuration holds while a step of
        ``in_flight_tokens`` (default: the spec's) is computed: the blocks its rule keeps (the
        one being filled included) plus those the step starts. None where unknown."""
        tokens = self.in_flight_tokens if in_flight_tokens is None else in_flight_tokens
        if self.kvcache is None or tokens <= 0:
            return None
        N = self.block_size
        return -(-self.kvcache.cache_length // N) + -(-tokens // N)

    def max_memory_usage_bytes(self, vllm_config) -> int:
        whole = super().max_memory_usage_bytes(vllm_config)
        bound = self.admission_blocks(vllm_config.max_in_flight_tokens)
        return whole if bound is None else min(whole, bound * self.page_size_bytes)
