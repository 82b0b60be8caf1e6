"""kvcache's attention as transformers' ``attn_implementation="kvcache"``.

Two functions are registered under ``NAME``, through transformers' own registries (no
transformers code is replaced):

- ``attention`` in ``AttentionInterface``: the function every attention module calls with its
  rotated query (B, Hq, T, D), the key and value (B, Hkv, T, D) that ``past_key_values.update``
  returned (the chunk's own, see cache.py), the mask, and keyword arguments. It hands them to
  the cache's layer and returns the output as transformers expects it, (B, T, Hq, D), with no
  attention weights.
- ``padding_mask`` in ``AttentionMaskInterface``: what the model's mask builders return for
  this implementation. It builds nothing and passes transformers' 2D padding mask (B, seen + T)
  through, so no (T x keys) mask is ever materialised; the cache reads which tokens of the chunk
  are padding from it, and derives what each query sees from positions.

Scaling: kvcache's kernels scale scores by 1/sqrt(D). A module whose ``scaling`` differs
(granite's ``attention_multiplier``, gemma2's ``query_pre_attn_scalar``) gets its queries
multiplied by ``scaling * sqrt(D)`` first, which gives the same scores. Gemma 2's soft cap and
gpt-oss's sink logits are the layer cache's scores rule (read with the geometry); the ``softcap``
and ``s_aux`` a module passes are checked against it. Attention features the kernels do not have
(position biases, bidirectional attention, dropout while training) raise
``UnsupportedModelError`` instead of computing something else.
"""

from __future__ import annotations

import math

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from .cache import take_pending
from .geometry import UnsupportedModelError

NAME = "kvcache"

# Keyword arguments of the attention interface that would change what attention computes,
# with what they are (modules pass None, or False for is_causal, when they are off).
UNSUPPORTED = {
    "sinks": "attention-sink logits passed as 'sinks'",
    "position_bias": "an additive position bias",
}


def attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The attention of one layer for one chunk, computed by the layer's kvcache cache.

    query: (B, Hq, T, D) rotated; key, value: (B, Hkv, T, D), the chunk's rotated keys and its
    values; attention_mask: the 2D padding mask (B, seen + T) or None (see ``padding_mask``).
    Returns ((B, T, Hq, D), None). ``kwargs`` is the interface's open set of model-specific
    arguments: ``position_ids`` (B or 1, T) is checked against the cache's positions,
    ``sliding_window`` against the window the cache applies, the features in ``UNSUPPORTED``
    raise, and the rest (``use_cache``, ``output_attentions``, flash-attention lengths) does not
    affect what is computed here.
    """
    layer_idx = module.layer_idx
    cache = take_pending(layer_idx, key)
    spec = cache.kv.layers[layer_idx].spec
    _check_supported(module, dropout, kwargs, spec.sliding_window)
    _check_scores(module, kwargs.get("softcap"), kwargs.get("s_aux"), spec.scores)
    D = query.shape[-1]
    if scaling is not None and scaling != D**-0.5:
        query = query * (scaling * math.sqrt(D))
    out = cache.attend(layer_idx, query, key, value, attention_mask, kwargs.get("position_ids"))
    return out.transpose(1, 2).contiguous(), None


def padding_mask(attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor | None:
    """The mask the model's mask builders make for ``NAME``: transformers' 2D padding mask
    (B, seen + T) itself, or None. ``kwargs`` (sizes, dtype, the mask function, config) is what
    the mask interface passes to every builder; none of it is needed."""
    return attention_mask


def register() -> None:
    """Make ``attn_implementation="kvcache"`` available to every transformers model."""
    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, padding_mask)


def _check_scores(module: torch.nn.Module, softcap: float | None, sinks: torch.Tensor | None, rule) -> None:
    """The module's soft cap and sink logits are the ones the layer cache applies."""
    want_cap = None if rule is None else rule.softcap
    want_sinks = None if rule is None else rule.sink_logits
    if softcap != want_cap or (sinks is None) != (want_sinks is None) or (sinks is not None and sinks is not want_sinks):
        raise UnsupportedModelError(
            f"{type(module).__name__} (layer {module.layer_idx}) attends with softcap={softcap} and "
            f"{'no' if sinks is None else 'its own'} sink logits, but the cache was made with softcap={want_cap} and "
            f"{'no' if want_sinks is None else 'other'} sink logits: make the cache for this model with "
            "kvcache.hf.make_cache(model, ...)"
        )


def _check_supported(module: torch.nn.Module, dropout: float, kwargs: dict, window: int | None) -> None:
    used = [what for name, what in UNSUPPORTED.items() if kwargs.get(name) is not None]
    if kwargs.get("is_causal", getattr(module, "is_causal", True)) is False:
        used.append("bidirectional (non-causal) attention")
    if dropout and module.training:
        used.append(f"attention dropout while training (p={dropout})")
    if used:
        raise UnsupportedModelError(
            f"{type(module).__name__} (layer {module.layer_idx}) uses {', '.join(used)}, which kvcache's attention "
            "does not implement"
        )
    model_window = kwargs.get("sliding_window")
    if model_window is not None and model_window != window:
        raise UnsupportedModelError(
            f"{type(module).__name__} (layer {module.layer_idx}) attends within a window of {model_window} tokens, "
            f"but the cache applies {window}: make the cache for this model with kvcache.hf.make_cache"
        )
