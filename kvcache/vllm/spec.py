"""The KV cache spec of layers under a kvcache policy: full attention plus the checked
configuration, which is how the scheduler's block manager (created from the spec alone) learns it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from vllm.v1.kv_cache_interface import FullAttentionSpec

from .config import PluginConfig


@dataclass(frozen=True, kw_only=True)
class KVCacheAttentionSpec(FullAttentionSpec):
    kvcache: PluginConfig | None = None

    @classmethod
    def merge(cls, specs: list[KVCacheAttentionSpec]) -> KVCacheAttentionSpec:
        # FullAttentionSpec.merge rebuilds the spec from vLLM's own fields; every layer of a
        # group carries the same configuration, which is put back.
        configs = {spec.kvcache for spec in specs}
        if len(configs) != 1:
            raise ValueError(f"the layers of one KV cache group have different kvcache configurations: {configs}")
        return dataclasses.replace(super().merge(specs), kvcache=configs.pop())

    @classmethod
    def of(cls, spec: FullAttentionSpec, config: PluginConfig) -> KVCacheAttentionSpec:
        """``spec`` with ``config`` attached."""
        fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if f.init}
        return cls(**fields, kvcache=config)
