"""Model configuration: one validated dataclass, filled from a checkpoint's ``config.json``.

Each supported family maps onto the same dataclass through a few flags (``qkv_bias`` for Qwen2,
``qk_norm`` for Qwen3); the model code itself never branches on the family name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import CheckpointError

# model_type -> flags that distinguish the family. Everything else is read from config.json.
FAMILIES: dict[str, dict[str, bool]] = {
    "llama": {"qk_norm": False},
    "mistral": {"qk_norm": False},
    "qwen2": {"qk_norm": False},
    "qwen3": {"qk_norm": True},
}

ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters (``rope_type`` is one of ``ROPE_TYPES``)."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    # llama3 only
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(
                f"unsupported rope_type {self.rope_type!r}; supported: {', '.join(ROPE_TYPES)}"
            )
        if self.theta <= 0 or self.factor <= 0:
            raise ValueError(f"rope theta and factor must be positive, got {self.theta}, {self.factor}")


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a decoder-only transformer."""

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
    # Model-level sliding-window attention (Mistral, some Qwen2 layers); None means full attention.
    sliding_window: int | None = None
    model_type: str = "llama"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive or None, got {self.sliding_window}")

    @property
    def group_size(self) -> int:
        """Query heads per K/V head."""
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face ``config.json`` dictionary (transformers 4.x or 5.x layout)."""
        model_type = hf.get("model_type")
        if model_type not in FAMILIES:
            raise CheckpointError(
                f"unsupported model_type {model_type!r}; supported families: {', '.join(sorted(FAMILIES))}"
            )
        try:
            hidden = hf["hidden_size"]
            heads = hf["num_attention_heads"]
            head_dim = hf.get("head_dim") or hidden // heads
            if model_type == "qwen2":
                qkv_bias = True
            else:
                qkv_bias = bool(hf.get("attention_bias", False))
            return cls(
                vocab_size=hf["vocab_size"],
                hidden_size=hidden,
                intermediate_size=hf["intermediate_size"],
                num_layers=hf["num_hidden_layers"],
                num_heads=heads,
                num_kv_heads=hf.get("num_key_value_heads") or heads,
                head_dim=head_dim,
                rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
                rope=_rope_from_hf(hf),
                qkv_bias=qkv_bias,
                o_bias=bool(hf.get("attention_bias", False)) and model_type != "qwen2",
                mlp_bias=bool(hf.get("mlp_bias", False)),
                qk_norm=FAMILIES[model_type]["qk_norm"],
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                max_position_embeddings=hf.get("max_position_embeddings", 2048),
                sliding_window=_sliding_window_from_hf(hf),
                model_type=model_type,
                bos_token_id=hf.get("bos_token_id"),
                eos_token_id=hf.get("eos_token_id"),
            )
        except KeyError as e:
            raise CheckpointError(f"config.json is missing the required field {e.args[0]!r}") from None
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


def _rope_from_hf(hf: dict[str, Any]) -> RopeConfig:
    # transformers 5 writes "rope_parameters" (theta included); 4.x wrote "rope_theta" + "rope_scaling".
    params = dict(hf.get("rope_parameters") or {})
    scaling = hf.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    kwargs: dict[str, Any] = {"theta": float(theta), "rope_type": rope_type}
    if rope_type in ("linear", "llama3"):
        kwargs["factor"] = float(params["factor"])
    if rope_type == "llama3":
        kwargs["low_freq_factor"] = float(params["low_freq_factor"])
        kwargs["high_freq_factor"] = float(params["high_freq_factor"])
        kwargs["original_max_position_embeddings"] = int(params["original_max_position_embeddings"])
    return RopeConfig(**kwargs)


def _sliding_window_from_hf(hf: dict[str, Any]) -> int | None:
    window = hf.get("sliding_window")
    if window is None:
        return None
    if hf.get("model_type") in ("qwen2", "qwen3"):
        # Qwen applies its window only when use_sliding_window is set (and then only to some layers);
        # we support the common case of no window.
        if hf.get("use_sliding_window"):
            raise CheckpointError("Qwen sliding-window layers (use_sliding_window=true) are not supported")
        return None
    return int(window)
