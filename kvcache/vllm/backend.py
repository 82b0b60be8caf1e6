"""The worker side: vLLM's CPU attention backend, unchanged but for three things.

* ``customize_spec`` attaches the checked kvcache configuration to each layer's KV cache spec
  (so the scheduler uses ``KVCacheBlockManager`` for it) and refuses what the plugin does not
  support, at engine start;
* the metadata builder hands the stock kernel, for every request that has evicted, prompt
  chunks included, a block table of the blocks its queries read only (in order) and a sequence
  length shortened by the freed blocks (several sequences where they read different blocks). Freed
  block ids stay in the worker's table and may already hold another request's tokens: with
  their columns dropped the kernel never reads them. Queries keep their true positions
  (``num_computed_tokens`` is the count of tokens seen, and RoPE was applied with it); within
  the shortened sequence the step's own tokens are still last, so causality is unchanged;
* after the kernel, each layer moves what a scoring policy keeps into the blocks that stay
  (scoring.py).
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
from vllm.v1.kv_cache_interface import AttentionSpec, FullAttentionSpec, SlidingWindowSpec

from ..model.scores import Scores
from .config import ROTARY, ConfigError, PluginConfig, parse
from .rule import request_rule
from .scoring import Work, after_step, needed, parts
from .spec import KVCacheAttentionSpec
from .state import BATCH, ENGINE


@dataclasses.dataclass(frozen=True)
class Phase:
    """Part of a step run on its own: query tokens [start, end), their metadata, and the
    scoring work of the sequences among them."""

    start: int
    end: int
    metadata: CPUAttentionMetadata
    works: list[Work]


@dataclasses.dataclass
class KVCacheAttentionMetadata(CPUAttentionMetadata):
    """The stock metadata, plus the sequences of requests under a scoring policy (``scoring``)
    and, where one of them evicts between two of its sequences (a recompute after a
    preemption), the parts the step runs in (``phases``)."""

    scoring: list[Work] = dataclasses.field(default_factory=list)
    phases: list[Phase] = dataclasses.field(default_factory=list)


class KVCacheCPUImpl(CPUAttentionBackendImpl):
    """vLLM's CPU attention, then, in each layer, what scoring policies keep (scoring.py)."""

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: CPUAttentionMetadata | None, output: torch.Tensor,
                output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        if not isinstance(attn_metadata, KVCacheAttentionMetadata):
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                   output_block_scale)
        queries = query.view(-1, self.num_heads, self.head_size)
        for phase in attn_metadata.phases or [Phase(0, len(query), attn_metadata, attn_metadata.scoring)]:
            a, b = phase.start, phase.end
            super().forward(layer, query[a:b], key[a:b], value[a:b], kv_cache, phase.metadata, output[a:b],
                            output_scale, output_block_scale)
            after_step(layer.layer_name, layer.isa, queries, kv_cache, phase.works)
        return output


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
    if vllm_config.cache_config.cache_dtype != "auto":
        raise ConfigError(f"kvcache vLLM plugin: kv_cache_dtype={vllm_config.cache_config.cache_dtype!r} is not "
                          "supported (scoring policies read keys and values at the model's precision); "
                          "leave kv_cache_dtype='auto'")
    if config.policy in ROTARY and rotary_frequencies(vllm_config) is None:
        raise ConfigError(f"kvcache vLLM plugin: the {config.policy} policy needs the model's rotary frequencies, "
                          f"which kvcache reads from the config of the model families it loads only")
    return config


def rotary_frequencies(vllm_config) -> torch.Tensor | None:
    """The model's rotary frequencies as kvcache's own model computes them from its config.json,
    or None for a model kvcache does not load (then expected_attention is refused)."""
    from ..model.config import ModelConfig
    from ..model.rope import inverse_frequencies

    try:
        cfg = ModelConfig.from_hf(vllm_config.model_config.hf_config.to_dict())
    except Exception:  # any model kvcache does not read: only expected_attention needs this
        return None
    return inverse_frequencies(cfg.rope, cfg.head_dim)


def scores_rule(vllm_config) -> Scores | None:
    """The soft cap of a model that caps its attention scores (Gemma 2), as a scores rule; None
    otherwise. (vLLM's kernel applies the cap to attention itself; scoring.py needs it for the
    weights a policy reads.)"""
    cap = getattr(vllm_config.model_config.hf_text_config, "attn_logit_softcapping", None)
    return None if cap is None else Scores(softcap=float(cap))


def check_pool(spec: KVCacheAttentionSpec, vllm_config) -> None:
    """Refuse, at start-up and saying what the bound is made of, a KV cache memory
    (``kv_cache_memory_bytes``) too small for one request under the policy, which vLLM's own
    start-up check would refuse in terms of ``max_model_len``. Counts the policy's layers only
    (vLLM's check adds the sliding layers'), so it refuses nothing vLLM would accept."""
    pool = None if vllm_config is None else vllm_config.cache_config.kv_cache_memory_bytes
    blocks = spec.admission_blocks()
    if not pool or blocks is None:
        return
    text = vllm_config.model_config.hf_text_config
    types = getattr(text, "layer_types", None)
    layers = types.count("full_attention") if types else text.num_hidden_layers
    need = spec.max_memory_usage_bytes(vllm_config) * layers
    if need <= pool:
        return
    raise ConfigError(
        f"kvcache vLLM plugin: one request holds at most cache_length ({spec.kvcache.cache_length}) tokens plus "
        f"the {spec.in_flight_tokens} one step may schedule (max_num_batched_tokens), {blocks} blocks of "
        f"{spec.block_size} per layer: {need} bytes over {layers} layers, more than the KV cache memory "
        f"(kv_cache_memory_bytes={pool}); lower --max-num-batched-tokens (or the cache_length), or give the KV "
        "cache more memory")


class KVCacheCPUBackend(CPUAttentionBackend):
    """vLLM's CPU attention backend (CPU_ATTN), with kvcache's blocks."""

    @staticmethod
    def get_impl_cls() -> type[CPUAttentionBackendImpl]:
        vllm_config = get_current_vllm_config_or_none()
        if vllm_config is not None:
            ENGINE.config = configured(vllm_config)
            ENGINE.inv_freq = rotary_frequencies(vllm_config)
            ENGINE.in_flight_tokens = vllm_config.max_in_flight_tokens
            ENGINE.vllm_config = vllm_config
            ENGINE.scores = scores_rule(vllm_config)
            ENGINE.known = True
        return KVCacheCPUImpl

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        spec = super().customize_spec(spec)
        config = ENGINE.config
        if config is None:
            return spec
        if type(spec) is SlidingWindowSpec:
            # A sliding layer of a hybrid model (Gemma 3, sliding-window Qwen): vLLM's own
            # sliding-window manager frees what its window passes; the policy bounds the others.
            return spec
        if type(spec) is not FullAttentionSpec or spec.sliding_window is not None or spec.attention_chunk_size:
            raise ConfigError(f"kvcache vLLM plugin: layers of kind {type(spec).__name__} (sliding window "
                              f"{spec.sliding_window}) are not supported; full and sliding-window attention only")
        spec = KVCacheAttentionSpec.of(spec, config, ENGINE.in_flight_tokens)
        check_pool(spec, ENGINE.vllm_config)
        return spec

    @staticmethod
    def get_builder_cls() -> type[CPUAttentionMetadataBuilder]:
        return KVCacheMetadataBuilder


class KVCacheMetadataBuilder(CPUAttentionMetadataBuilder):
    def __init__(self, kv_cache_spec: AttentionSpec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.engine = kv_cache_spec.kvcache if isinstance(kv_cache_spec, KVCacheAttentionSpec) else None
        if self.engine is not None and self.window_size != -1:
            raise ConfigError("kvcache vLLM plugin: models with sliding-window attention are not supported")
        if self.engine is not None and BATCH.rows is None:
            raise RuntimeError("kvcache vLLM plugin: vLLM did not load kvcache's logits processor "
                               "(kvcache.vllm.requests:KVCacheRequests, entry point group vllm.logits_processors), "
                               "which tells the plugin which request each row is; reinstall kvcache[vllm]")

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> CPUAttentionMetadata:
        if self.engine is None:
            return super().build(common_prefix_len, common_attn_metadata, fast_build)
        works: list[Work] = []
        cuts: list[int] = []
        kept = self.kept_only(common_attn_metadata, works, cuts)
        metadata = super().build(common_prefix_len, kept, fast_build)
        if not works:
            return metadata
        fields = {f.name: getattr(metadata, f.name) for f in dataclasses.fields(metadata)}
        phases = []
        if cuts:
            # The kernel must read a scoring request's blocks as they stood at each of its
            # sequences: the step runs in parts, each one's scoring (and moves) before the next.
            bounds = [0, *(c + 1 for c in cuts), kept.num_reqs]
            starts = kept.query_start_loc_cpu
            for i, j in zip(bounds, bounds[1:]):
                a, b = int(starts[i]), int(starts[j])
                phases.append(Phase(a, b, super().build(0, self.part(kept, i, j), fast_build),
                                    [w for w in works if a <= w.q_start < b]))
        return KVCacheAttentionMetadata(**fields, scoring=works, phases=phases)

    @staticmethod
    def part(cm: CommonAttentionMetadata, i: int, j: int) -> CommonAttentionMetadata:
        """``cm`` restricted to its sequences [i, j) (and their query tokens)."""
        starts = cm.query_start_loc_cpu
        a, b = int(starts[i]), int(starts[j])
        sub = starts[i : j + 1] - a
        replaced = dict(
            num_reqs=j - i, num_actual_tokens=b - a, query_start_loc=sub.to(cm.query_start_loc.device),
            query_start_loc_cpu=sub, seq_lens=cm.seq_lens[i:j], block_table_tensor=cm.block_table_tensor[i:j],
            slot_mapping=cm.slot_mapping[a:b], max_query_len=int((sub[1:] - sub[:-1]).max()),
            max_seq_len=int(cm.seq_lens[i:j].max()))
        for name in ("is_prefilling", "seq_lens_cpu_upper_bound"):
            value = getattr(cm, name)
            if value is not None:
                replaced[name] = value[i:j]
        return dataclasses.replace(cm, **replaced)

    def kept_only(self, cm: CommonAttentionMetadata, works: list[Work], cuts: list[int]) -> CommonAttentionMetadata:
        """``cm`` with each request's queries attending only what its rule keeps.

        A request's step becomes one or more sequences for the stock kernel (rule.segments),
        each with a block table of its kept columns only and a length shortened by the blocks
        dropped. The query tokens stay in order, so every other per-token input of the step is
        unchanged. ``works`` receives the calls (and parts of calls) of each request under a
        scoring policy that have something to score, and ``cuts`` the index of every sequence
        of such a request that evicts before the same request's next one."""
        N = self.block_size
        rows = BATCH.rows
        seq_lens = cm.seq_lens.cpu()
        starts = cm.query_start_loc_cpu
        table = cm.block_table_tensor
        pieces: list[tuple[int, int, int, tuple[int, ...] | None]] = []  # (row, query count, length, columns)
        changed = False
        for r in range(cm.num_reqs):
            total = int(seq_lens[r])
            count = int(starts[r + 1] - starts[r])
            seen = total - count
            row = rows.get(r)
            if row is None and count and total:
                raise RuntimeError(f"kvcache vLLM plugin: no request recorded at row {r} of the batch")
            rule = request_rule(self.engine, row.raw) if row is not None else None
            scoring = rule is not None and rule.scoring and count > 0
            if scoring and seen < row.prompt and min(total, row.prompt) > (row.calls[-1] if row.calls else 0):
                # A prompt chunk computed for the first time: a call of its own (rule.py).
                row.calls.append(min(total, row.prompt))
            if rule is None or total - 1 <= rule.cache_length:
                segments = [(seen, total, None)]  # nothing evicted yet: every query reads every block
            else:
                changed = True
                segments = rule.segments(seen, total, row.prompt, row.calls)
            ids = None
            for k, (start, end, columns) in enumerate(segments):
                if scoring:
                    first = int(starts[r]) + start - seen
                    for a, b, call in parts(rule, row, start, end):
                        work = Work(row, rule, first + a - start, first + b - start, a, b, None, call)
                        if needed(work):
                            if ids is None:
                                ids = table[r, : -(-total // N)].cpu()
                            works.append(dataclasses.replace(work, table=ids))
                    if k + 1 < len(segments):
                        cuts.append(len(pieces))
                if columns is None:
                    pieces.append((r, count, total, None))
                else:
                    # Every column is full but the last, which holds the segment's newest tokens.
                    pieces.append((r, end - start, (len(columns) - 1) * N + (end - (end - 1) // N * N), columns))
        if not changed:
            return cm
        width = max(len(c) if c is not None else -(-length // N) for _, _, length, c in pieces)
        new_table = torch.zeros(len(pieces), max(width, 1), dtype=table.dtype, device=table.device)
        for i, (r, _, length, columns) in enumerate(pieces):
            if columns is None:
                n = -(-length // N)
                new_table[i, :n] = table[r, :n]
            else:
                new_table[i, : len(columns)] = table[r, list(columns)]
        counts = torch.tensor([count for _, count, _, _ in pieces], dtype=starts.dtype)
        new_starts = torch.zeros(len(pieces) + 1, dtype=starts.dtype)
        torch.cumsum(counts, 0, out=new_starts[1:])
        new_lens = torch.tensor([length for _, _, length, _ in pieces], dtype=cm.seq_lens.dtype)
        source = [r for r, _, _, _ in pieces]
        replaced = dict(
            num_reqs=len(pieces), block_table_tensor=new_table,
            query_start_loc=new_starts.to(cm.query_start_loc.device), query_start_loc_cpu=new_starts,
            seq_lens=new_lens.to(cm.seq_lens.device), max_seq_len=int(new_lens.max()),
            max_query_len=int(counts.max()))
        # Per-request fields vLLM may fill, carried to each request's sequences.
        for name in ("is_prefilling", "seq_lens_cpu_upper_bound"):
            value = getattr(cm, name)
            if value is not None:
                replaced[name] = new_lens.clone() if name == "seq_lens_cpu_upper_bound" else value[source]
        return dataclasses.replace(cm, **replaced)
