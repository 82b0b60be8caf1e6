"""The worker side: vLLM's CPU attention backend, unchanged but for two things.

* ``customize_spec`` attaches the checked kvcache configuration to each layer's KV cache spec
  (so the scheduler uses ``KVCacheBlockManager`` for it) and refuses what the plugin does not
  support, at engine start;
* the metadata builder hands the stock kernel, for every request past its prompt, a block table
  of the kept blocks only (in order) and a sequence length shortened by the freed blocks. Freed
  block ids stay in the worker's table and may already hold another request's tokens: with
  their columns dropped the kernel never reads them. Queries keep their true positions
  (``num_computed_tokens`` is the count of tokens seen, and RoPE was applied with it); within
  the shortened sequence the step's own tokens are still last, so causality is unchanged.
"""

from __future__ import annotations

import dataclasses

import torch
from vllm.config import get_current_vllm_config_or_none
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)
from vllm.v1.kv_cache_interface import AttentionSpec, FullAttentionSpec

from .config import ConfigError, PluginConfig, parse
from .rule import BlockRule
from .spec import KVCacheAttentionSpec


def configured(vllm_config) -> PluginConfig | None:
    """The checked kvcache configuration of an engine, or None when it has none. Refuses the
    vLLM features the plugin cannot serve exactly."""
    extra = vllm_config.additional_config
    if not isinstance(extra, dict) or "kvcache" not in extra:
        return None
    config = parse(extra["kvcache"], vllm_config.cache_config.block_size)
    if vllm_config.cache_config.enable_prefix_caching:
        raise ConfigError(
            "kvcache vLLM plugin: prefix caching shares the blocks of generated tokens, whose keys depend on "
            "what was evicted before them; start the engine with enable_prefix_caching=False "
            "(vllm serve --no-enable-prefix-caching)")
    if vllm_config.parallel_config.decode_context_parallel_size > 1:
        raise ConfigError("kvcache vLLM plugin: decode context parallelism is not supported")
    if vllm_config.speculative_config is not None:
        raise ConfigError("kvcache vLLM plugin: speculative decoding is not supported")
    return config


@dataclasses.dataclass
class _EngineConfig:
    """The configuration of the engine whose model was built last in this process.

    vLLM asks the backend to customize a layer's KV cache spec through a classmethod that is
    given the spec alone, outside any current vLLM config; each attention layer asks the backend
    for its implementation class earlier, while the model is built inside that config, and the
    backend records it then. One process builds one model at a time, and builds it before it
    asks for the model's KV cache specs."""

    config: PluginConfig | None = None


_ENGINE = _EngineConfig()


class KVCacheCPUBackend(CPUAttentionBackend):
    """vLLM's CPU attention backend (CPU_ATTN), with kvcache's blocks."""

    @staticmethod
    def get_impl_cls() -> type[CPUAttentionBackendImpl]:
        vllm_config = get_current_vllm_config_or_none()
        if vllm_config is not None:
            _ENGINE.config = configured(vllm_config)
        return CPUAttentionBackendImpl

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        spec = super().customize_spec(spec)
        config = _ENGINE.config
        if config is None:
            return spec
        if type(spec) is not FullAttentionSpec or spec.sliding_window is not None or spec.attention_chunk_size:
            raise ConfigError(f"kvcache vLLM plugin: layers of kind {type(spec).__name__} (sliding window "
                              f"{spec.sliding_window}) are not supported; full attention only")
        return KVCacheAttentionSpec.of(spec, config)

    @staticmethod
    def get_builder_cls() -> type[CPUAttentionMetadataBuilder]:
        return KVCacheMetadataBuilder


class KVCacheMetadataBuilder(CPUAttentionMetadataBuilder):
    def __init__(self, kv_cache_spec: AttentionSpec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        config = kv_cache_spec.kvcache if isinstance(kv_cache_spec, KVCacheAttentionSpec) else None
        self.rule = None if config is None else BlockRule(config)
        if self.rule is not None and self.window_size != -1:
            raise ConfigError("kvcache vLLM plugin: models with sliding-window attention are not supported")

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> CPUAttentionMetadata:
        if self.rule is not None:
            common_attn_metadata = self.kept_only(common_attn_metadata)
        return super().build(common_prefix_len, common_attn_metadata, fast_build)

    def kept_only(self, cm: CommonAttentionMetadata) -> CommonAttentionMetadata:
        """``cm`` with each request's block table reduced to its kept columns and its sequence
        length to the tokens they hold (requests still in their prompt are left whole)."""
        if cm.is_prefilling is None:
            raise RuntimeError("kvcache vLLM plugin: this vLLM gives no is_prefilling in the attention metadata")
        N = self.block_size
        seq_lens = cm.seq_lens.cpu()
        starts = cm.query_start_loc_cpu
        prefilling = cm.is_prefilling.cpu()
        rows: list[list[int] | None] = []
        for r in range(cm.num_reqs):
            total = int(seq_lens[r])
            seen = total - int(starts[r + 1] - starts[r])
            rows.append(None if bool(prefilling[r]) or seen <= self.rule.cache_length
                        else self.rule.kept_columns(seen, total))
        if all(row is None for row in rows):
            return cm
        table = cm.block_table_tensor
        width = max(len(row) if row is not None else -(-int(seq_lens[r]) // N) for r, row in enumerate(rows))
        new_table = torch.zeros(table.shape[0], max(width, 1), dtype=table.dtype, device=table.device)
        new_lens = seq_lens.clone()
        for r, row in enumerate(rows):
            total = int(seq_lens[r])
            if row is None:
                n = -(-total // N)
                new_table[r, :n] = table[r, :n]
            else:
                new_table[r, : len(row)] = table[r, row]
                # Every kept column is full but the last, which holds the newest tokens.
                new_lens[r] = (len(row) - 1) * N + (total - (total - 1) // N * N)
        new_table[cm.num_reqs:] = table[cm.num_reqs:, : new_table.shape[1]]
        new_lens = new_lens.to(cm.seq_lens.device)
        return dataclasses.replace(cm, block_table_tensor=new_table, seq_lens=new_lens,
                                   max_seq_len=int(new_lens[: cm.num_reqs].max()))
