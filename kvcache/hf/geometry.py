"""What kvcache needs to know about a transformers model, read once, before anything is built.

A kvcache cache is sized by the model's layer count, K/V heads, head size, dtype and device, holds
each layer's own sliding window (``config.layer_types``: Gemma 3, Gemma 2, gpt-oss, sliding-window
Qwen) and scores rule (Gemma 2's soft cap, gpt-oss's learned sink logits: ``model.scores``), and
gives policies that renumber positions or undo the rotation of queries (sink with
``positions="renumbered"``, expected_attention) each layer's rotary frequencies. This module reads
all of that from a ``PreTrainedModel`` and refuses, with ``UnsupportedModelError`` naming the
feature, a model whose attention kvcache's kernels cannot compute: layers of other kinds (linear
attention, chunked attention, shared K/V).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from ..model.config import LayerGeometry, RopeConfig
from ..model.rope import apply_rope, rope_angles
from ..model.scores import Scores

# Layer kinds (``config.layer_types``) whose attention kvcache computes: full causal attention,
# and a sliding window over it.
SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")
# Rotary variants whose frequencies change with the sequence length after the model is built.
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


class UnsupportedModelError(ValueError):
    """The model uses an attention feature kvcache.hf does not implement (the message names it)."""


@dataclass(frozen=True)
class Geometry:
    """A transformers model's attention geometry, as a kvcache cache needs it.

    num_layers:   decoder layers, each with one attention module and one layer cache.
    num_kv_heads, head_dim: the shape of each layer's keys and values, (B, num_kv_heads, T, head_dim).
    windows:      each layer's sliding window, None for global attention.
    inv_freqs:    each layer's (head_dim // 2,) float32 rotary frequencies in the half-split layout
                  kvcache rotates with (``kvcache.model.rope``), or None with ``rope_note`` saying why.
    scores:       each layer's scores rule (soft cap, the module's own sink-logit parameter), or
                  None for plain softmax attention.
    dtype, device: those of the input embeddings, where the cache's buffers are allocated.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    windows: tuple[int | None, ...]
    inv_freqs: tuple[torch.Tensor, ...] | None
    rope_note: str
    dtype: torch.dtype
    device: torch.device
    scores: tuple[Scores | None, ...] = ()


def read(model: torch.nn.Module) -> Geometry:
    """The geometry of ``model`` (a transformers ``PreTrainedModel``); raises
    ``UnsupportedModelError`` for attention kvcache cannot compute."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "get_text_config"):
        raise UnsupportedModelError(f"{type(model).__name__} is not a transformers model (it has no PreTrainedConfig)")
    config = config.get_text_config(decoder=True)
    name = type(model).__name__
    layers = config.num_hidden_layers
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    weight = model.get_input_embeddings().weight
    types = _layer_types(config, name)
    inv_freqs, note = _rotaries(model, head_dim, types)
    windows = tuple(None if t == "full_attention" else config.sliding_window for t in types)
    return Geometry(num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim, windows=windows,
                    inv_freqs=inv_freqs, rope_note=note, dtype=weight.dtype, device=weight.device,
                    scores=_scores(model, config, layers))


def _scores(model: torch.nn.Module, config, layers: int) -> tuple[Scores | None, ...]:
    """Each layer's scores rule: ``config.attn_logit_softcapping`` (Gemma 2), and the learned
    sink logits its attention module holds as ``sinks`` (gpt-oss), the parameter itself."""
    softcap = getattr(config, "attn_logit_softcapping", None)
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    modules = [getattr(layer, "self_attn", None) for layer in getattr(decoder, "layers", [])]
    sinks = [getattr(m, "sinks", None) for m in modules] if len(modules) == layers else [None] * layers
    if any(s is not None and not isinstance(s, torch.nn.Parameter) for s in sinks):
        raise UnsupportedModelError(f"{type(model).__name__}'s attention modules hold sinks that are not learned "
                                    "logits (a parameter per query head)")
    return tuple(None if softcap is None and s is None else Scores(softcap=softcap, sink_logits=s) for s in sinks)

def as_kvcache_model(g: Geometry, model: torch.nn.Module | None = None) -> SimpleNamespace:
    """The attributes of a ``kvcache.Transformer`` that ``kvcache.make_cache`` reads to size a
    cache (``config`` fields and each layer's geometry, the embedding weight's dtype and device,
    each layer's ``rotary`` and ``scores``), so that budgets, allocation, head budgets and reserve are computed
    and checked as for kvcache's own model, by the same code; with ``model``, its layers' output
    projections (``self_attn.o_proj``, for policies that weigh values by them) where every decoder
    layer has one."""
    layers = [LayerGeometry(window, RopeConfig()) for window in g.windows]  # (rotaries: as frequencies)
    config = SimpleNamespace(num_layers=g.num_layers, num_kv_heads=g.num_kv_heads, head_dim=g.head_dim,
                             layer=layers.__getitem__)
    weight = torch.empty(0, dtype=g.dtype, device=g.device)
    found = SimpleNamespace(config=config, embed_tokens=SimpleNamespace(weight=weight),
                            rotary=(lambda i: None) if g.inv_freqs is None else g.inv_freqs.__getitem__,
                            scores=(lambda i: None) if not g.scores else g.scores.__getitem__)
    decoder = model.get_decoder() if model is not None and hasattr(model, "get_decoder") else None
    decoder_layers = getattr(decoder, "layers", None)
    if decoder_layers is not None and len(decoder_layers) == g.num_layers and all(
            isinstance(getattr(getattr(layer, "self_attn", None), "o_proj", None), torch.nn.Linear)
            for layer in decoder_layers):
        found.layers = decoder_layers
    return found


def _layer_types(config, name: str) -> tuple[str, ...]:
    """Each layer's kind: ``config.layer_types`` (transformers 5), or every layer sliding when
    ``config.sliding_window`` is set without it (Mistral), else every layer global."""
    layers = config.num_hidden_layers
    types = getattr(config, "layer_types", None)
    if types is None:
        sliding = getattr(config, "sliding_window", None) is not None
        return ("sliding_attention" if sliding else "full_attention",) * layers
    unknown = sorted(set(types) - set(SUPPORTED_LAYER_TYPES))
    if unknown:
        raise UnsupportedModelError(
            f"{name} has {', '.join(unknown)} layers (config.layer_types); kvcache.hf supports "
            f"{' and '.join(SUPPORTED_LAYER_TYPES)} layers"
        )
    return tuple(types)


def _rotaries(model: torch.nn.Module, head_dim: int,
              types: tuple[str, ...]) -> tuple[tuple[torch.Tensor, ...] | None, str]:
    """Each layer's rotary frequencies if kvcache can rotate with them, else (None, why not).

    Usable frequencies come from exactly one rotary module: one ``inv_freq`` buffer for every
    layer, or (Gemma 3) one ``{layer type}_inv_freq`` per kind of layer, called with the kind."""
    kinds = sorted(set(types))
    per_kind = [m for m in model.modules()
                if all(isinstance(getattr(m, f"{k}_inv_freq", None), torch.Tensor) for k in kinds)]
    if len(per_kind) == 1:
        rotary = per_kind[0]
        found = {}
        for kind in kinds:
            rope_type = getattr(rotary, "rope_type", "default")
            rope_type = rope_type.get(kind, "default") if isinstance(rope_type, dict) else rope_type
            inv_freq, note = _checked(rotary, getattr(rotary, f"{kind}_inv_freq"), head_dim, rope_type,
                                      float(getattr(rotary, f"{kind}_attention_scaling", 1.0)), kind)
            if inv_freq is None:
                return None, note
            found[kind] = inv_freq
        return tuple(found[t] for t in types), ""
    inv_freq, note = _rotary(model, head_dim)
    return (None, note) if inv_freq is None else ((inv_freq,) * len(types), "")


def _rotary(model: torch.nn.Module, head_dim: int) -> tuple[torch.Tensor | None, str]:
    """The model's rotary frequencies if kvcache can rotate with them, else (None, why not).

    Usable frequencies come from exactly one rotary module (a module with an ``inv_freq``
    buffer), cover the whole head (no partial rotary), do not change with the sequence length,
    and reproduce the module's own cos/sin in kvcache's half-split layout (checked on a few
    positions, up to the module's ``attention_scaling``).
    """
    rotaries = [m for m in model.modules() if isinstance(getattr(m, "inv_freq", None), torch.Tensor)]
    if len(rotaries) != 1:
        return None, f"it has {len(rotaries)} rotary embedding modules, not one"
    rotary = rotaries[0]
    return _checked(rotary, rotary.inv_freq, head_dim, getattr(rotary, "rope_type", "default"),
                    float(getattr(rotary, "attention_scaling", 1.0)))


def _rotates_half_split(rotary: torch.nn.Module, cos, sin, want_cos, want_sin) -> bool:
    """Whether the modeling module of ``rotary`` rotates with its (1, P, D/2) ``cos``, ``sin``
    (through its ``apply_rotary_pos_emb``) as kvcache rotates with (1, P, D) ``want_cos``, ``want_sin``."""
    apply = getattr(sys.modules.get(type(rotary).__module__), "apply_rotary_pos_emb", None)
    if apply is None:
        return False
    x = torch.randn(1, 1, cos.shape[1], want_cos.shape[-1], generator=torch.Generator().manual_seed(0)).to(cos.device)
    try:
        theirs, _ = apply(x, x, cos, sin)
    except (TypeError, ValueError, RuntimeError):
        return False
    return bool(torch.allclose(theirs.float(), apply_rope(x, want_cos[:, None], want_sin[:, None]), atol=1e-5))


def _checked(rotary: torch.nn.Module, inv_freq: torch.Tensor, head_dim: int, rope_type: str, scale: float,
             *kind: str) -> tuple[torch.Tensor | None, str]:
    """``inv_freq`` (a copy, float32) if it covers the whole head, does not change with the
    sequence length, and reproduces the module's own cos/sin (``rotary(x, positions, *kind)``)
    in kvcache's half-split layout, up to ``scale``; else (None, why not)."""
    if inv_freq.numel() != head_dim // 2:
        return None, f"its rotary embedding covers {2 * inv_freq.numel()} of {head_dim} head dimensions"
    if rope_type in LENGTH_DEPENDENT_ROPE:
        return None, f"its rotary frequencies ({rope_type!r}) change with the sequence length"
    positions = torch.arange(8, device=inv_freq.device)[None]
    try:
        with torch.no_grad():
            cos, sin = rotary(inv_freq.new_zeros(1), positions, *kind)
    except (TypeError, ValueError, RuntimeError) as e:
        return None, f"its rotary embedding could not be probed ({e})"
    want_cos, want_sin = rope_angles(inv_freq.float(), positions, torch.float32)
    if cos.shape[-1] == head_dim // 2:
        # One angle per pair (gpt-oss): the layout is the module's rotation function's, probed.
        if not _rotates_half_split(rotary, cos.float(), sin.float(), scale * want_cos, scale * want_sin):
            return None, "its rotary embedding does not use the half-split (rotate_half) layout kvcache rotates with"
        return inv_freq.detach().float().clone(), ""
    if cos.shape != want_cos.shape or not (torch.allclose(cos.float(), scale * want_cos, atol=1e-5)
                                           and torch.allclose(sin.float(), scale * want_sin, atol=1e-5)):
        return None, "its rotary embedding does not use the half-split (rotate_half) layout kvcache rotates with"
    # A copy: the cache must not change if the module later recomputes its buffer in place.
    return inv_freq.detach().float().clone(), ""
