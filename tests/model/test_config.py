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


def test_qwen_sliding_layers_from_max_window_layers():
    """A transformers 4.x config.json (no layer_types): layers from max_window_layers on slide."""
    hf = {**BASE, "num_hidden_layers": 3, "model_type": "qwen2", "sliding_window": 8, "use_sliding_window": True,
          "max_window_layers": 1}
    cfg = ModelConfig.from_hf(hf)
    assert [layer.window for layer in cfg.layers] == [None, 8, 8]
    assert [layer.window for layer in ModelConfig.from_hf({**hf, "use_sliding_window": False}).layers] == [None] * 3


def test_layer_types_pick_each_layers_window_and_rotary():
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0}}
    types = ["sliding_attention", "full_attention"]
    cfg = ModelConfig.from_hf({**BASE, "model_type": "gemma3_text", "sliding_window": 4, "layer_types": types,
                               "rope_parameters": rope, "query_pre_attn_scalar": 36})
    assert cfg.layer(0).window == 4 and cfg.layer(0).rope == RopeConfig(theta=1e4)
    assert cfg.layer(1).window is None and cfg.layer(1).rope == RopeConfig(theta=1e6, rope_type="linear", factor=8.0)
    assert cfg.attention_scale == 36 ** -0.5 and cfg.norm == "gemma" and cfg.block == "sandwich"
    # transformers 4.x's Gemma 3 names the local base apart.
    old = ModelConfig.from_hf({**BASE, "model_type": "gemma3_text", "sliding_window": 4, "layer_types": types,
                               "rope_theta": 1e6, "rope_local_base_freq": 1e4})
    assert old.layer(0).rope == RopeConfig(theta=1e4) and old.layer(1).rope == RopeConfig(theta=1e6)


@pytest.mark.parametrize("changes, problem", [
    ({"layer_types": ["full_attention"]}, "layer_types lists 1 layers"),
    ({"layer_types": ["full_attention", "chunked_attention"]}, "layer_types"),
    ({"layer_types": ["sliding_attention", "full_attention"], "sliding_window": None}, "sliding_window is null"),
    ({"hidden_act": "relu"}, "hidden_act"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor=0.5"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "original_max_position_embeddings": 8}},
     "short_factor"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "original_max_position_embeddings": 8,
                          "short_factor": [1.0, 1.0], "long_factor": [2.0]}}, "long_factor .*as many factors"),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}}, "rope_type .*dynamic"),
])
def test_invalid_layer_kinds(changes, problem):
    with pytest.raises(CheckpointError, match=problem):
        ModelConfig.from_hf({**BASE, "model_type": "mistral", **changes})


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


# --- field types ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "changes, key, says",
    [
        ({"hidden_size": "64"}, "hidden_size", "must be an int, got '64' (str)"),
        ({"num_hidden_layers": True}, "num_hidden_layers (ModelConfig.num_layers)", "must be an int, got True (bool)"),
        ({"num_attention_heads": 4.0}, "num_attention_heads", "must be an int, got 4.0 (float)"),
        ({"num_attention_heads": 0}, "num_attention_heads", "must be positive, got 0"),
        ({"num_key_value_heads": "2"}, "num_key_value_heads", "must be an int"),
        ({"vocab_size": None}, "vocab_size", "must be an int, got None"),
        ({"head_dim": 16.0}, "head_dim", "must be an int"),
        ({"rms_norm_eps": "1e-6"}, "rms_norm_eps", "must be a number"),
        ({"max_position_embeddings": "4096"}, "max_position_embeddings", "must be an int"),
        ({"attention_bias": "false"}, "attention_bias", "must be true or false, got 'false'"),
        ({"tie_word_embeddings": 1}, "tie_word_embeddings", "must be true or false"),
        ({"eos_token_id": "2"}, "eos_token_id", "must be an int, a list of ints or null"),
        ({"eos_token_id": [2, "3"]}, "eos_token_id", "must be an int, a list of ints or null"),
        ({"bos_token_id": 1.5}, "bos_token_id", "must be an int or null"),
        ({"rope_theta": "1e4"}, "rope_theta", "must be a number, got '1e4'"),
        ({"rope_scaling": {"rope_type": "linear", "factor": "4"}}, "factor", "must be a number"),
        ({"model_type": "mistral", "sliding_window": "8"}, "sliding_window", "must be an int or null"),
    ],
)
def test_wrong_types_name_the_config_json_field(changes, key, says):
    with pytest.raises(CheckpointError) as err:
        ModelConfig.from_hf({**BASE, "model_type": "llama", **changes})
    message = str(err.value)
    assert "config.json" in message and key in message and says in message


def test_ints_where_floats_are_expected():
    cfg = ModelConfig.from_hf({**BASE, "model_type": "qwen2", "rope_theta": 1000000})
    assert cfg.rope.theta == 1e6 and isinstance(cfg.rope.theta, float)


@pytest.mark.parametrize("eos", [None, 2, [2, 7]])
def test_eos_token_id_forms(eos):
    assert ModelConfig.from_hf({**BASE, "model_type": "llama", "eos_token_id": eos}).eos_token_id == eos


def test_null_flags_are_false():
    cfg = ModelConfig.from_hf({**BASE, "model_type": "llama", "attention_bias": None, "tie_word_embeddings": None})
    assert not cfg.qkv_bias and not cfg.o_bias and not cfg.tie_word_embeddings


def test_model_config_type_errors_name_the_field():
    args = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                num_kv_heads=2, head_dim=16)
    ModelConfig(**args)
    with pytest.raises(TypeError, match=r"ModelConfig\.hidden_size must be an int, got '64' \(str\)"):
        ModelConfig(**{**args, "hidden_size": "64"})
    with pytest.raises(TypeError, match=r"ModelConfig\.num_layers must be an int, got True"):
        ModelConfig(**{**args, "num_layers": True})
    with pytest.raises(ValueError, match=r"ModelConfig\.head_dim must be positive and even"):
        ModelConfig(**{**args, "head_dim": 15})
    with pytest.raises(TypeError, match=r"RopeConfig\.theta must be a number"):
        RopeConfig(theta="10000")
