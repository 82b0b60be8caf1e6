"""The transformer: embedding, blocks of grouped-query attention and a gated MLP, head.

The family's config picks the parts (kvcache/parts: the norm, the MLP's activation, the block
layout) and each layer's geometry (``ModelConfig.layer``: global or sliding attention, its rotary).

No cache logic lives here. With a cache, each attention layer hands its rotated queries and keys
and its values to its layer of the cache and gets the attention output back; without one it calls
the fused causal kernel directly. Module names follow the Hugging Face layout (minus the leading
``model.``), so checkpoints load without a renaming table.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch import nn

from ..cache.base import KVCache, LayerCache, Step
from ..errors import KVCacheWarning
from ..kernels import attention
from ..runtime import devices
from .config import ModelConfig
from .experts import Experts
from .mlp import MLP
from .norm import make_norm
from .rope import apply_rope, inverse_frequencies, rope_angles
from .scores import Scores

# Called at the start of every block with (layer index, hidden states (B, T, hidden_size)); a
# returned tensor of the same shape replaces the block's input, None leaves it unchanged.
LayerHook = Callable[[int, torch.Tensor], "torch.Tensor | None"]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        self.cfg = cfg
        geometry = cfg.layer(index)
        # This layer's sliding window, None for global attention (ModelConfig.layer).
        self.window = geometry.window
        D = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * D, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * D, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * D, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * D, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = make_norm(cfg.norm, D, cfg.rms_norm_eps)
            self.k_norm = make_norm(cfg.norm, D, cfg.rms_norm_eps)
        # Every attention kernel scales scores by D ** -0.5; a model with its own scale (Gemma's
        # query_pre_attn_scalar, YaRN's factor on queries and keys) hands the caches queries
        # pre-scaled by the ratio, so that no kernel, policy or storage needs to know.
        ratio = cfg.attention_scale * D**0.5 * geometry.rope.magnitude**2
        self.query_ratio = None if ratio == 1.0 else ratio
        # gpt-oss's learned logit per query head (its checkpoints name it ``sinks``; it is not
        # kvcache's sink tokens).
        self.sinks = nn.Parameter(torch.zeros(cfg.num_heads)) if cfg.sink_logits else None
        self.softcap = cfg.attn_softcap

    @property
    def scores(self) -> Scores | None:
        """This layer's rule for attention scores (soft-capping, sink logits), None if plain."""
        if self.sinks is None and self.softcap is None:
            return None
        return Scores(softcap=self.softcap, sink_logits=self.sinks)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        layer_cache: LayerCache | None,
        step: Step | None,
    ) -> torch.Tensor:
        """x: (B, T, hidden); cos, sin: (B or 1, T, D), this layer's rotary -> (B, T, hidden)."""
        B, T, _ = x.shape
        D = self.cfg.head_dim
        q = self.q_proj(x).view(B, T, -1, D)
        k = self.k_proj(x).view(B, T, -1, D)
        v = self.v_proj(x).view(B, T, -1, D)
        if self.cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
        # (B, T, H, D) -> (B, H, T, D)
        q = apply_rope(q, cos, sin).transpose(1, 2)
        k = apply_rope(k, cos, sin).transpose(1, 2)
        v = v.transpose(1, 2)
        if self.query_ratio is not None:
            q = q * self.query_ratio
        if layer_cache is None:
            out = attention.causal(q, k, v, window=self.window, scores=self.scores)
        else:
            out = layer_cache.attend(q, k, v, step)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class Block(nn.Module):
    """Pre-norm: x + attn(norm(x)), then x + mlp(norm(x)) (Llama, Mistral, Qwen)."""

    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        self.input_layernorm = make_norm(cfg.norm, cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, index)
        self.post_attention_layernorm = make_norm(cfg.norm, cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = Experts(cfg) if cfg.mlp == "experts" else MLP(cfg)

    def forward(self, x, cos, sin, layer_cache: LayerCache | None, step: Step | None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, layer_cache, step)
        return x + self.mlp(self.post_attention_layernorm(x))


class SandwichBlock(Block):
    """Norms before and after each sublayer: x + norm(attn(norm(x))), then x + norm(mlp(norm(x)))
    (Gemma 2 and 3; their ``post_attention_layernorm`` follows attention, where Llama's precedes
    the MLP)."""

    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__(cfg, index)
        self.pre_feedforward_layernorm = make_norm(cfg.norm, cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = make_norm(cfg.norm, cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, layer_cache: LayerCache | None, step: Step | None) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, layer_cache, step))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


BLOCKS: dict[str, type[Block]] = {"pre_norm": Block, "sandwich": SandwichBlock}


class Transformer(nn.Module):
    """A decoder-only language model.

    ``model(ids)`` is the plain causal forward of ``ids`` (B, T) from position 0. ``model(ids,
    cache=cache)`` processes the next chunk of every row: the cache knows how many tokens each row
    has seen, so callers never pass positions.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        block = BLOCKS[cfg.block]
        self.layers = nn.ModuleList(block(cfg, i) for i in range(cfg.num_layers))
        self.norm = make_norm(cfg.norm, cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # One rotary per distinct layer geometry: ``inv_freq`` for the global layers (and every
        # layer of a family with one rotary), ``inv_freq_local`` for sliding layers with their own.
        self._ropes = sorted({layer.rope for layer in cfg.layers}, key=lambda r: r != cfg.rope)
        self._rope_of = [self._ropes.index(layer.rope) for layer in cfg.layers]
        self.register_buffer("inv_freq", torch.empty(0), persistent=False)
        self.register_buffer("inv_freq_local", torch.empty(0), persistent=False)
        # longrope (Phi-3): the global rotary's frequencies once a row is past the original context.
        self.register_buffer("inv_freq_long", torch.empty(0), persistent=False)
        # Gemma multiplies its embeddings by sqrt(hidden) rounded to the model's dtype.
        self.register_buffer("embed_scale", torch.tensor(float(cfg.hidden_size) ** 0.5), persistent=False)
        self.reset_rope()
        self.layer_hook: LayerHook | None = None
        # A long generation would repeat the warning at every step: it is given once per model.
        self._warned_positions = False

    def reset_rope(self) -> None:
        """Recompute the rotary frequencies and the embedding scale (after the model was built on
        the meta device)."""
        device = self.embed_tokens.weight.device
        freqs = [inverse_frequencies(rope, self.config.head_dim).to(device) for rope in self._ropes]
        self.inv_freq = freqs[0]
        self.inv_freq_local = freqs[1] if len(freqs) > 1 else freqs[0][:0]
        rope = self._ropes[0]
        long = inverse_frequencies(rope, self.config.head_dim, long=True) if rope.length_dependent else freqs[0][:0]
        self.inv_freq_long = long.to(device)
        if any(r.length_dependent for r in self._ropes[1:]):
            raise ValueError("a length-dependent rotary (longrope) is supported on the global layers only")
        self.embed_scale = torch.tensor(float(self.config.hidden_size) ** 0.5, device=device)

    def lay_out_head(self, hidden_major: bool) -> None:
        """Keep the head's (vocab, hidden) weight hidden-major in memory (a transposed view of a
        (hidden, vocab) buffer) or row-major, the tied embedding with it; its values, and what
        the model computes, stay the same. On the CPU, torch's matrix-vector product reads a
        large head laid out hidden-major at about twice the bandwidth (Gemma 3's 262,144 x 640:
        49 against 96 ms a token on one thread), and a decode step of a model with a large
        vocabulary is mostly that product: ``kvcache.load`` lays it out so there. FSDP2 shards
        row-major parameters only (train/shard.py lays it back)."""
        head = self.lm_head.weight
        if (head.t() if hidden_major else head).is_contiguous():
            return
        data = head.detach().t().contiguous().t() if hidden_major else head.detach().contiguous()
        moved = nn.Parameter(data, requires_grad=head.requires_grad)
        self.lm_head.weight = moved
        if self.config.tie_word_embeddings:
            self.embed_tokens.weight = moved

    def rotary(self, layer: int) -> torch.Tensor | None:
        """(head_dim // 2,) float32 rotary frequencies of layer ``layer``; None where they change
        with the sequence's length (longrope), so that no policy re-rotates a stored key by them."""
        if self._rope_of[layer] == 0:
            return None if self._ropes[0].length_dependent else self.inv_freq
        return self.inv_freq_local

    def scores(self, layer: int) -> Scores | None:
        """Layer ``layer``'s rule for attention scores (soft-capping, sink logits), None if plain."""
        return self.layers[layer].self_attn.scores

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits (..., vocab) of final normed hidden states (..., hidden): the output projection,
        soft-capped where the family caps its logits (Gemma 2)."""
        logits = self.lm_head(hidden)
        cap = self.config.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def forward(
        self,
        input_ids: torch.Tensor,
        cache: KVCache | None = None,
        *,
        n_tokens: torch.Tensor | list[int] | None = None,
        last_only: bool = False,
        skip_lm_head: bool = False,
    ) -> torch.Tensor:
        """Run a chunk.

        input_ids: (B, T) long. With a cache, ``n_tokens`` (B,) says how many leading tokens of each
        row are real (the rest is right padding, neither stored nor attended); default all T.
        Returns logits (B, T, vocab), or (B, 1, vocab) at each row's last real token with
        ``last_only``; ``skip_lm_head`` returns the final normed hidden states (B, T or 1, hidden).
        """
        if input_ids.dim() != 2 or input_ids.dtype not in (torch.long, torch.int32, torch.int64):
            raise ValueError(
                f"input_ids must be a (batch, tokens) integer tensor, got shape {tuple(input_ids.shape)} "
                f"and dtype {input_ids.dtype}"
            )
        B, T = input_ids.shape
        if T == 0:
            raise ValueError("input_ids has no tokens (shape (batch, 0))")
        # Before the ids are read: reading them on another device fails inside torch, unclearly.
        # A model that is not the cache's is named first (its device may be the one that differs).
        if cache is not None:
            cache.check_model(self)
        device = self.embed_tokens.weight.device
        if not devices.same(input_ids.device, device):
            raise ValueError(f"input_ids is on {input_ids.device} but the model is on {device}; move the ids "
                             f"to {device} (ids.to({str(device)!r}))")
        self.check_token_ids(input_ids)
        if cache is None:
            if n_tokens is not None:
                raise ValueError("n_tokens (ragged chunks) needs a cache; without one every row has T tokens")
            step = None
            positions = torch.arange(T, device=input_ids.device).unsqueeze(0)  # (1, T)
            last = torch.full((B,), T - 1, device=input_ids.device)
            self.warn_past_max_positions(T)
        else:
            step = cache.begin(input_ids, n_tokens)
            positions = step.positions  # (B, T)
            last = step.last_index
            self.warn_past_max_positions(step.span_end)
        out = self.run(input_ids, positions, cache, step, last if last_only else None, skip_lm_head)
        if cache is not None:
            cache.commit(step)
        return out

    def decode(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """One decode step with tokens sampled from this model's own logits (a decode loop's):
        tokens (B, 1) long on the model's device -> (B, vocab) logits of each row's next token.

        ``forward`` without the check of the ids against the vocabulary, which would wait for
        the device every step (sampled ids lie in it); every other check stays. Ids from
        anywhere else go through ``forward``."""
        if tokens.dim() != 2 or tokens.shape[1] != 1:
            raise ValueError(f"decode takes one token per row, shape (batch, 1); got {tuple(tokens.shape)}")
        step = cache.begin(tokens, None, self)
        self.warn_past_max_positions(step.span_end)
        logits = self.run(tokens, step.positions, cache, step)[:, -1]
        cache.commit(step)
        return logits

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache | None,
        step: Step | None,
        last: torch.Tensor | None = None,
        skip_lm_head: bool = False,
    ) -> torch.Tensor:
        """The computation of ``forward`` without its checks and bookkeeping: nothing here reads
        the host or branches on data, so a decode step can be captured (see compile.py).

        input_ids: (B, T); positions: (B or 1, T) long; ``step`` describes the chunk to the layer
        caches (None without a cache). ``last`` (B,): keep only these token indices (logits
        (B, 1, vocab)). Returns logits, or the final normed hidden states with ``skip_lm_head``.
        """
        dtype = self.embed_tokens.weight.dtype
        freqs = (self.inv_freq, self.inv_freq_local)[: len(self._ropes)]
        angles = [rope_angles(f, positions, dtype) for f in freqs]  # one (cos, sin) per rotary
        if self.inv_freq_long.numel():
            angles[0] = self._longrope(angles[0], positions, step, dtype)
        x = self.embed_tokens(input_ids)
        if self.config.scale_embeddings:
            x = x * self.embed_scale.to(x.dtype)
        for i, block in enumerate(self.layers):
            if self.layer_hook is not None:
                replaced = self.layer_hook(i, x)
                if replaced is not None:
                    x = replaced
            cos, sin = angles[self._rope_of[i]]
            x = block(x, cos, sin, None if cache is None else cache.layers[i], step)
        if last is not None:
            x = x[torch.arange(x.shape[0], device=x.device), last].unsqueeze(1)
        x = self.norm(x)
        return x if skip_lm_head else self.head(x)

    def _longrope(self, short: tuple[torch.Tensor, torch.Tensor], positions: torch.Tensor, step: Step | None,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """longrope's (cos, sin) for the chunk: the long factors' for a row whose sequence, after the
        chunk, is longer than the original context, else ``short``. Keys stored before keep the
        rotation they were stored with, as in transformers, which decides by the longest row of a
        batch; here each row decides alone, so a row computes what it would alone."""
        long = rope_angles(self.inv_freq_long, positions, dtype)
        newest = positions.amax(-1) if step is None else step.newest  # (B or 1,)
        past = (newest + 1 > self._ropes[0].original_max_position_embeddings).view(-1, 1, 1)
        return torch.where(past, long[0], short[0]), torch.where(past, long[1], short[1])

    def check_token_ids(self, input_ids: torch.Tensor) -> None:
        """Reject ids outside [0, vocab_size), padding included, before any kernel reads them and
        before a cache is touched. input_ids: (B, T) integer tensor.

        On the host, on every device: an id out of range reaching the embedding on CUDA is a
        device-side assert, which leaves the process's CUDA context unusable. The check waits for
        the device once per call; the decode loop's own sampled tokens skip it (``decode``).
        """
        V = self.config.vocab_size
        lo, hi = input_ids.aminmax()
        if int(lo) < 0 or int(hi) >= V:
            bad = input_ids[(input_ids < 0) | (input_ids >= V)].unique()
            raise ValueError(
                f"input_ids holds token ids outside [0, {V}) (the model's vocab_size is {V}): "
                f"{bad[:8].tolist()}{' ...' if len(bad) > 8 else ''}. Encode text with the model's own tokenizer."
            )

    def warn_past_max_positions(self, length: int) -> None:
        """Warn, once per model, when a sequence of ``length`` tokens reaches positions beyond
        ``max_position_embeddings``. ``forward`` calls it for every chunk and ``decode`` (and the
        captured step, compile.py) for every step: it comes when such a position is computed,
        not before (a run that stops earlier never reaches it)."""
        limit = self.config.max_position_embeddings
        if length <= limit or self._warned_positions:
            return
        self._warned_positions = True
        warnings.warn(
            f"a sequence reached position {length - 1}, beyond the model's max_position_embeddings={limit} "
            f"(positions 0 to {limit - 1}); the model was not configured for such positions and its "
            "output may degrade. (A sink cache with positions='renumbered' keeps attention distances "
            "within its cache_length.) This warning is given once per model.",
            KVCacheWarning,
            stacklevel=2,
        )
