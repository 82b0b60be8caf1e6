"""ModelConfig from config.json dictionaries: one dataclass, a few flags per family."""

from __future__ import annotations

import pytest

from kvcache import CheckpointError, ModelConfig, RopeConfig

BASE = {
    "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2,
}


def test_llama_defaults():
    cfg = ModelConfig.from_hf({**BASE, "model_type": "llama"})
    assert cfg.head_dim == 16 and cfg.group_size == 2
    assert not cfg.qkv_bias and not cfg.o_bias and not cfg.qk_norm and not cfg.mlp_bias
    assert cfg.rope == RopeConfig()
    assert cfg.sliding_window is None


def test_llama_attention_bias_covers_o_proj():
    cfg = ModelConfig.from_hf({**BASE, "model_type": "llama", "attention_bias": True, "mlp_bias": True})
    assert cfg.qkv_bias and cfg.o_bias and cfg.mlp_bias


def test_qwen2_has_qkv_bias_only():
    cfg = ModelConfig.from_hf({**BASE, "model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": False})
    assert cfg.qkv_bias and not cfg.o_bias
    assert cfg.sliding_window is None  # declared but unused


def test_qwen3_qk_norm_and_head_dim():
    cfg = ModelConfig.from_hf({**BASE, "model_type": "qwen3", "head_dim": 24})
    assert cfg.qk_norm and cfg.head_dim == 24 and not cfg.qkv_bias


def test_mistral_window():
    assert ModelConfig.from_hf({**BASE, "model_type": "mistral", "sliding_window": 8}).sliding_window == 8
    assert ModelConfig.from_hf({**BASE, "model_type": "mistral", "sliding_window": None}).sliding_window is None


def test_missing_kv_heads_means_multi_head():
    hf = {**BASE, "model_type": "llama"}
    del hf["num_key_value_heads"]
    assert ModelConfig.from_hf(hf).num_kv_heads == 4


@pytest.mark.parametrize(
    "hf",
    [
        {"model_type": None},
        {"model_type": "llama", "head_dim": 15},
        {"model_type": "mistral", "sliding_window": 0},
        {"model_type": "llama", "rope_parameters": {"rope_type": "linear", "rope_theta": 1e4}},  # no factor
        {"model_type": "llama", "rope_parameters": {"rope_type": "default", "rope_theta": -1.0}},
    ],
)
def test_invalid_configs_raise_checkpoint_error(hf):
    with pytest.raises(CheckpointError):
        ModelConfig.from_hf({**BASE, **hf})


def test_rope_config_validation():
    with pytest.raises(ValueError, match="rope_type"):
        RopeConfig(rope_type="dynamic")
    with pytest.raises(ValueError):
        RopeConfig(factor=0.0)
