"""Model configuration: one validated dataclass, filled from a checkpoint's ``config.json``.

Each supported family maps onto the same dataclass through a few fields that pick its parts
(``qk_norm`` for Qwen3; Gemma 3's norm, block layout, activation and embedding scale); the model
code itself never branches on the family name. Each layer's attention geometry (global, or
sliding with its window, and its rotary) is ``ModelConfig.layer(i)``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from ..errors import CheckpointError

# model_type -> the fields that distinguish the family (its parts). Everything else is read from
# config.json.
FAMILIES: dict[str, dict[str, object]] = {
    "llama": {},
    "mistral": {},
    "qwen2": {},
    "qwen3": {"qk_norm": True},
    "gemma3_text": {"qk_norm": True, "norm": "gemma", "block": "sandwich", "scale_embeddings": True},
    # Gemma 3's parts less QK-norm; soft-capped attention and final logits (from config.json).
    "gemma2": {"norm": "gemma", "block": "sandwich", "scale_embeddings": True},
    # A learned sink logit per query head, and a mixture of experts for the MLP.
    "gpt_oss": {"sink_logits": True, "mlp": "experts"},
    # Llama's parts; its checkpoints fuse the query/key/value and gate/up projections (checkpoint.py).
    "phi3": {},
}

# model_type of an image-and-text checkpoint -> that of its language model, which kvcache runs.
MULTIMODAL = {"gemma3": "gemma3_text"}

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
# A layer's attention kind, as transformers' ``config.layer_types`` names it.
LAYER_TYPES = ("full_attention", "sliding_attention")
# RMSNorm forms: "rms" scales by w after casting back (Llama); "gemma" by (1 + w) in float32.
NORMS = ("rms", "gemma")
# Block layouts: "pre_norm" (a norm before attention and before the MLP, Llama); "sandwich" (also
# a norm after each, before its residual add: Gemma 2 and 3).
BLOCKS = ("pre_norm", "sandwich")
# The gated MLP's activation, by transformers' names.
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
# MLP kinds: "gated" (down(act(gate(x)) * up(x))); "experts" (gpt-oss's routed mixture of clamped
# SwiGLU experts, model/experts.py).
MLPS = ("gated", "experts")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters (``rope_type`` is one of ``ROPE_TYPES``)."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    # llama3 only
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    # llama3, yarn and longrope
    original_max_position_embeddings: int = 8192
    # yarn only: the band of rotations between extrapolation (beta_fast) and interpolation
    # (beta_slow), whether its edges are rounded to whole dimensions, and the factor on cos and
    # sin (None: 0.1 ln(factor) + 1).
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    # yarn and longrope (None: derived from factor)
    attention_factor: float | None = None
    # longrope only: each frequency's divisor while a sequence is within the original context
    # (short) and once it has passed it (long), head_dim // 2 of each.
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        _validate(self, _ROPE_RULES)
        if self.rope_type == "longrope" and (not self.short_factor or len(self.short_factor) != len(self.long_factor)):
            raise FieldValueError("RopeConfig", "long_factor",
                                  f"must list as many factors as short_factor ({len(self.short_factor)}), one per "
                                  f"frequency, got {len(self.long_factor)}")

    @property
    def length_dependent(self) -> bool:
        """Whether the frequencies change with the length of the sequence (longrope: short
        factors within the original context, long ones past it)."""
        return self.rope_type == "longrope"

    @property
    def magnitude(self) -> float:
        """The factor on cos and sin, so on each of a query and a key: YaRN's attention factor,
        1 for the other rotaries. kvcache rotates with unit cos and sin and puts the square on
        the attention scale, so that a rotation of a stored key stays a rotation."""
        if self.rope_type not in ("yarn", "longrope"):
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        if self.factor <= 1:
            return 1.0
        if self.rope_type == "longrope":
            return math.sqrt(1 + math.log(self.factor) / math.log(self.original_max_position_embeddings))
        return 0.1 * math.log(self.factor) + 1.0


@dataclass(frozen=True)
class LayerGeometry:
    """One layer's attention, as its cache needs it: ``window`` None for global attention, else
    the sliding window (a query at position p sees keys at p - window + 1 .. p); its rotary."""

    window: int | None
    rope: RopeConfig

    @property
    def sliding(self) -> bool:
        return self.window is not None


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a decoder-only transformer.

    Every field is checked on construction: a value of the wrong type raises ``FieldTypeError``
    (a TypeError) and one out of range ``FieldValueError`` (a ValueError), naming the field.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    # Sliding-window attention: the window of every layer (Mistral) or, with ``layer_types``, of
    # the sliding layers (Gemma 3, Qwen2/3 with use_sliding_window); None means full attention.
    sliding_window: int | None = None
    # Each layer's kind, one of LAYER_TYPES per layer; empty: every layer alike (sliding when
    # ``sliding_window`` is set).
    layer_types: tuple[str, ...] = ()
    # The rotary of the sliding layers where it differs from ``rope`` (Gemma 3's local base).
    rope_local: RopeConfig | None = None
    norm: str = "rms"
    block: str = "pre_norm"
    activation: str = "silu"
    # Embeddings multiplied by sqrt(hidden_size) (Gemma).
    scale_embeddings: bool = False
    # Attention scores are scaled by query_pre_attn_scalar ** -0.5 (Gemma); None: head_dim ** -0.5.
    query_pre_attn_scalar: float | None = None
    # Soft-capping (Gemma 2): attention scores s -> c tanh(s / c) with c = attn_softcap, and the
    # output logits likewise with final_softcap; None: no cap.
    attn_softcap: float | None = None
    final_softcap: float | None = None
    # A learned logit per query head joins every softmax as a column with no value (gpt-oss).
    sink_logits: bool = False
    mlp: str = "gated"
    # "experts" only: experts per layer, experts per token, and the SwiGLU's slope and clamp.
    num_experts: int = 0
    experts_per_token: int = 0
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    model_type: str = "llama"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self) -> None:
        _validate(self, _MODEL_RULES)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types lists {len(self.layer_types)} layers but num_hidden_layers is "
                             f"{self.num_layers}")
        if "sliding_attention" in self.layer_types and self.sliding_window is None:
            raise ValueError("layer_types has sliding_attention layers but sliding_window is null")
        if self.mlp == "experts" and not 0 < self.experts_per_token <= self.num_experts:
            raise ValueError(f"a mixture of experts routes each token to 1 to num_local_experts experts; got "
                             f"num_experts_per_tok={self.experts_per_token} with num_local_experts={self.num_experts}")

    def stop_ids(self) -> list[int]:
        """The end-of-text ids at which generation stops by default (``eos_token_id``), as a list:
        the one rule ``generate``, kvzip's generation, ``kvcache eval`` and the command line use."""
        eos = self.eos_token_id
        return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)

    @property
    def group_size(self) -> int:
        """Query heads per K/V head."""
        return self.num_heads // self.num_kv_heads

    def layer(self, i: int) -> LayerGeometry:
        """Layer ``i``'s attention geometry: its window (None for global attention) and rotary."""
        kind = self.layer_types[i] if self.layer_types else None
        if kind == "full_attention" or self.sliding_window is None:
            return LayerGeometry(None, self.rope)
        return LayerGeometry(self.sliding_window, self.rope_local or self.rope)

    @property
    def layers(self) -> tuple[LayerGeometry, ...]:
        """Every layer's geometry, in order."""
        return tuple(self.layer(i) for i in range(self.num_layers))

    @property
    def attention_scale(self) -> float:
        """The factor on query-key dot products: query_pre_attn_scalar ** -0.5, or head_dim ** -0.5."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face ``config.json`` dictionary (transformers 4.x or 5.x layout)."""
        model_type = hf.get("model_type")
        if model_type in MULTIMODAL and isinstance(hf.get("text_config"), dict):
            # The language model of an image-and-text checkpoint (checkpoint.py drops the image
            # tower); what the outer config sets of the text model's ids and head wins.
            outer = {k: hf[k] for k in ("tie_word_embeddings", "bos_token_id", "eos_token_id") if hf.get(k) is not None}
            return cls.from_hf({**hf["text_config"], **outer, "model_type": MULTIMODAL[model_type]})
        if model_type not in FAMILIES:
            raise CheckpointError(
                f"unsupported model_type {model_type!r}; supported families: {', '.join(sorted(FAMILIES))}"
            )
        try:
            hidden = hf["hidden_size"]
            heads = hf["num_attention_heads"]
            attention_bias = _flag(hf, "attention_bias")
            rope, rope_local = _ropes_from_hf(hf)
            return cls(
                vocab_size=hf["vocab_size"],
                hidden_size=hidden,
                intermediate_size=hf["intermediate_size"],
                num_layers=hf["num_hidden_layers"],
                num_heads=heads,
                num_kv_heads=hf.get("num_key_value_heads") or heads,
                head_dim=hf.get("head_dim") or _derived_head_dim(hidden, heads),
                rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
                rope=rope,
                rope_local=rope_local,
                qkv_bias=True if model_type == "qwen2" else attention_bias,
                o_bias=False if model_type == "qwen2" else attention_bias,
                mlp_bias=_flag(hf, "mlp_bias"),
                tie_word_embeddings=_flag(hf, "tie_word_embeddings"),
                max_position_embeddings=hf.get("max_position_embeddings", 2048),
                sliding_window=_sliding_window_from_hf(hf),
                layer_types=_layer_types_from_hf(hf),
                activation=hf.get("hidden_activation") or hf.get("hidden_act") or "silu",
                query_pre_attn_scalar=hf.get("query_pre_attn_scalar"),
                attn_softcap=hf.get("attn_logit_softcapping"),
                final_softcap=hf.get("final_logit_softcapping"),
                num_experts=hf.get("num_local_experts") or 0,
                experts_per_token=hf.get("num_experts_per_tok") or 0,
                swiglu_alpha=hf.get("swiglu_alpha", 1.702),
                swiglu_limit=hf.get("swiglu_limit", 7.0),
                **FAMILIES[model_type],
                model_type=model_type,
                bos_token_id=hf.get("bos_token_id"),
                eos_token_id=hf.get("eos_token_id"),
            )
        except KeyError as e:
            raise CheckpointError(f"config.json is missing the required field {e.args[0]!r}") from None
        except FieldError as e:
            key = JSON_KEYS.get(e.field)
            where = e.field if key is None else f"{key} ({e.owner}.{e.field})"
            raise CheckpointError(f"config.json is invalid: {where} {e.problem}") from None
        except ValueError as e:
            raise CheckpointError(f"config.json is invalid: {e}") from None

    @classmethod
    def from_json(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise CheckpointError(f"{path} not found: a checkpoint directory needs config.json") from None
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{path} is not valid JSON: {e}") from None
        return cls.from_hf(data)


def _flag(hf: dict[str, Any], key: str) -> Any:
    """A boolean field of config.json, False when absent or null (other values are validated by
    ModelConfig, so that "false", a string, is rejected rather than read as true)."""
    value = hf.get(key)
    return False if value is None else value


def _derived_head_dim(hidden: Any, heads: Any) -> Any:
    """hidden_size / num_attention_heads, for configs without head_dim. When either is not a
    positive int there is none to derive; ModelConfig then names the field at fault."""
    if _is_int(hidden) and _is_int(heads) and heads > 0:
        return hidden // heads
    return None


def _ropes_from_hf(hf: dict[str, Any]) -> tuple[RopeConfig, RopeConfig | None]:
    """The rotary of the global layers, and of the sliding layers where it differs (or None)."""
    params = hf.get("rope_parameters") or {}
    if isinstance(params, dict) and set(params) & set(LAYER_TYPES):
        # transformers 5 writes one set per layer kind where they differ (Gemma 3).
        full = _rope_from_hf(hf, params.get("full_attention") or {})
        local = params.get("sliding_attention")
        return full, None if local is None else _rope_from_hf(hf, local)
    rope = _rope_from_hf(hf, params)
    local_theta = hf.get("rope_local_base_freq")  # transformers 4.x's Gemma 3: default rotary, this base
    return rope, None if local_theta is None else RopeConfig(theta=local_theta)


def _rope_from_hf(hf: dict[str, Any], params: dict[str, Any]) -> RopeConfig:
    # transformers 5 writes "rope_parameters" (theta included); 4.x wrote "rope_theta" + "rope_scaling".
    scaling = hf.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor")) or 1.0
    if partial != 1.0:
        raise CheckpointError(f"config.json rotates part of each head (partial_rotary_factor={partial}); kvcache's "
                              "model rotates whole heads")
    kwargs: dict[str, Any] = {"theta": theta, "rope_type": rope_type}
    if rope_type in ("linear", "llama3", "yarn"):
        kwargs["factor"] = params["factor"]
    if rope_type == "llama3":
        for name in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            kwargs[name] = params[name]
    if rope_type == "yarn":
        if params.get("mscale") or params.get("mscale_all_dim"):
            raise CheckpointError("config.json's yarn rotary sets mscale / mscale_all_dim, which kvcache does not "
                                  "implement")
        kwargs["original_max_position_embeddings"] = params["original_max_position_embeddings"]
        for name in ("beta_fast", "beta_slow", "attention_factor"):
            if params.get(name) is not None:
                kwargs[name] = params[name]
        kwargs["truncate"] = params.get("truncate", True)
    if rope_type == "longrope":
        original = params.get("original_max_position_embeddings", hf.get("original_max_position_embeddings"))
        if not _is_int(original) or original <= 0:
            raise CheckpointError(f"config.json's longrope rotary needs original_max_position_embeddings, a positive "
                                  f"int, got {original!r}")
        factor = params.get("factor") or hf.get("max_position_embeddings", 2048) / original
        kwargs.update(factor=factor, original_max_position_embeddings=original,
                      short_factor=_floats(params["short_factor"]), long_factor=_floats(params["long_factor"]))
        if params.get("attention_factor") is not None:
            kwargs["attention_factor"] = params["attention_factor"]
    return RopeConfig(**kwargs)


def _floats(values: Any) -> Any:
    """A list of numbers as a tuple of floats (anything else as it is: RopeConfig names it)."""
    if isinstance(values, list) and all(_is_number(v) for v in values):
        return tuple(float(v) for v in values)
    return values


def _sliding_window_from_hf(hf: dict[str, Any]) -> Any:
    """The model's own window as config.json gives it (ModelConfig checks it), or None."""
    window = hf.get("sliding_window")
    if window is not None and hf.get("model_type") in ("qwen2", "qwen3") and not hf.get("use_sliding_window"):
        return None  # Qwen declares a window it applies only with use_sliding_window
    return window


def _layer_types_from_hf(hf: dict[str, Any]) -> Any:
    """Each layer's kind (a tuple, ModelConfig checks it), or () when every layer is alike."""
    types = hf.get("layer_types")
    if isinstance(types, list):
        if _sliding_window_from_hf(hf) is None and hf.get("model_type") in ("qwen2", "qwen3"):
            return ()  # a Qwen window declared but not used: every layer global
        return tuple(types)
    if types is not None:
        return types  # not a list: ModelConfig names the field
    if hf.get("model_type") in ("qwen2", "qwen3") and _sliding_window_from_hf(hf) is not None:
        # transformers 4.x wrote no layer_types: layers from max_window_layers on are sliding.
        first = hf.get("max_window_layers", hf["num_hidden_layers"])
        if not _is_int(first):
            raise CheckpointError(f"config.json is invalid: max_window_layers must be an int, got {first!r}")
        kinds = ("full_attention", "sliding_attention")
        return tuple(kinds[i >= first] for i in range(hf["num_hidden_layers"]))
    return ()


# ----- validation ---------------------------------------------------------------------------------


class FieldError(Exception):
    """A field of ModelConfig or RopeConfig holds a value of the wrong type (``FieldTypeError``)
    or out of range (``FieldValueError``). ``owner`` and ``field`` name it and ``problem`` says
    what is wrong, so that ``from_hf`` can name the config.json key too."""

    def __init__(self, owner: str, field: str, problem: str) -> None:
        super().__init__(f"{owner}.{field} {problem}")
        self.owner = owner
        self.field = field
        self.problem = problem


class FieldTypeError(FieldError, TypeError):
    pass


class FieldValueError(FieldError, ValueError):
    pass


# ModelConfig and RopeConfig fields that config.json names differently.
JSON_KEYS = {
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "qkv_bias": "attention_bias",
    "o_bias": "attention_bias",
    "theta": "rope_theta",
    "activation": "hidden_act",
    "attn_softcap": "attn_logit_softcapping",
    "final_softcap": "final_logit_softcapping",
    "num_experts": "num_local_experts",
    "experts_per_token": "num_experts_per_tok",
}


def _is_int(value: object) -> bool:
    # bool is a subclass of int, but true is no layer count.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return _is_int(value) or isinstance(value, float)


# A field's annotation, as a string (this module postpones annotations) -> (what the value must be,
# test). A field added with an annotation missing here fails on the first construction.
_TYPES: dict[str, tuple[str, Callable[[object], bool]]] = {
    "int": ("an int", _is_int),
    "int | None": ("an int or null", lambda v: v is None or _is_int(v)),
    "float": ("a number", _is_number),
    "bool": ("true or false", lambda v: isinstance(v, bool)),
    "str": ("a string", lambda v: isinstance(v, str)),
    "int | list[int] | None": (
        "an int, a list of ints or null",
        lambda v: v is None or _is_int(v) or (isinstance(v, list) and all(_is_int(x) for x in v)),
    ),
    "RopeConfig": ("a RopeConfig", lambda v: isinstance(v, RopeConfig)),
    "RopeConfig | None": ("a RopeConfig or None", lambda v: v is None or isinstance(v, RopeConfig)),
    "float | None": ("a number or null", lambda v: v is None or _is_number(v)),
    "tuple[str, ...]": ("a list of strings", lambda v: isinstance(v, tuple) and all(isinstance(x, str) for x in v)),
    "tuple[float, ...]": ("a list of numbers", lambda v: isinstance(v, tuple) and all(_is_number(x) for x in v)),
}

# Field -> (what its value must be, test), checked once its type is right.
Rule = tuple[str, Callable[[Any], bool]]
_POSITIVE: Rule = ("positive", lambda v: v > 0)
_POSITIVE_OR_NULL: Rule = ("positive or null", lambda v: v is None or v > 0)
_MODEL_RULES: dict[str, Rule] = {
    **{name: _POSITIVE for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                                    "num_heads", "num_kv_heads", "max_position_embeddings")},
    "head_dim": ("positive and even (rotary embeddings rotate pairs)", lambda v: v > 0 and v % 2 == 0),
    "sliding_window": ("positive or null (no window)", lambda v: v is None or v > 0),
    "layer_types": (f"a list of {' and '.join(LAYER_TYPES)}", lambda v: all(t in LAYER_TYPES for t in v)),
    "norm": (f"one of {', '.join(NORMS)}", lambda v: v in NORMS),
    "block": (f"one of {', '.join(BLOCKS)}", lambda v: v in BLOCKS),
    "activation": (f"one of {', '.join(ACTIVATIONS)}", lambda v: v in ACTIVATIONS),
    "query_pre_attn_scalar": _POSITIVE_OR_NULL,
    "attn_softcap": _POSITIVE_OR_NULL,
    "final_softcap": _POSITIVE_OR_NULL,
    "mlp": (f"one of {', '.join(MLPS)}", lambda v: v in MLPS),
    "num_experts": ("zero or positive", lambda v: v >= 0),
    "experts_per_token": ("zero or positive", lambda v: v >= 0),
    "swiglu_limit": _POSITIVE,
}
_ROPE_RULES: dict[str, Rule] = {
    "rope_type": (f"one of {', '.join(ROPE_TYPES)}", lambda v: v in ROPE_TYPES),
    "theta": _POSITIVE,
    "factor": _POSITIVE,
    "attention_factor": _POSITIVE_OR_NULL,
}


def _validate(config: ModelConfig | RopeConfig, rules: dict[str, Rule]) -> None:
    """Check each field of ``config``, in order, against its annotation and then its rule (so a
    bad field is reported before any field derived from it). A float field given an int keeps
    it as a float."""
    owner = type(config).__name__
    for f in fields(config):
        value = getattr(config, f.name)
        expected, is_type = _TYPES[f.type]
        if not is_type(value):
            raise FieldTypeError(owner, f.name, f"must be {expected}, got {value!r} ({type(value).__name__})")
        if f.type in ("float", "float | None") and value is not None:
            object.__setattr__(config, f.name, float(value))
        if f.name in rules:
            must, holds = rules[f.name]
            if not holds(value):
                raise FieldValueError(owner, f.name, f"must be {must}, got {value!r}")
