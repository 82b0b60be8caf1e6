"""Writing GGUF files of tiny random models for the tests, as llama.cpp's converter writes them:
llama.cpp's tensor names, the query and key rows of Llama files reordered into interleaved
rotary pairs, each weight in the block type asked for, the tokenizer as tokenizer.ggml.* metadata.

The ``gguf`` package quantizes F16, BF16, Q8_0, Q4_0 and Q4_1 but not the K-quants: a K-quant
tensor is written as random blocks whose fp16 scales are set to small finite values, which
decode to some weights like any other file's (both readers compared dequantize the same bytes).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

SUPER_BLOCK = 256
# Per K-quant: bytes per 256 values, and the byte offsets of its fp16 scales within a block.
K_QUANTS = {"Q4_K": (144, (0, 2)), "Q5_K": (176, (0, 2)), "Q6_K": (210, (208,))}

_LAYER = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def gguf_name(hf_name: str) -> str:
    base, _, kind = hf_name.rpartition(".")
    if base in _TOP:
        return f"{_TOP[base]}.{kind}"
    _, _, i, rest = base.split(".", 3)
    return f"blk.{i}.{_LAYER[rest]}.{kind}"


def reorder(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's reordering of a query or key projection's rows: each head's halves interleaved."""
    D = w.shape[0] // heads
    return w.reshape(heads, 2, D // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _k_quant_blocks(shape: tuple[int, ...], kind: str, rng: np.random.Generator) -> np.ndarray:
    size, scales = K_QUANTS[kind]
    rows, cols = shape
    blocks = rng.integers(0, 256, size=(rows, cols // SUPER_BLOCK, size), dtype=np.uint8)
    for offset in scales:
        d = rng.uniform(1e-3, 4e-3, size=(rows, cols // SUPER_BLOCK)).astype(np.float16)
        blocks[..., offset : offset + 2] = d.view(np.uint8).reshape(rows, cols // SUPER_BLOCK, 2)
    return blocks.reshape(rows, -1)


def _writer(path: Path, arch: str, cfg, rope_theta: float):
    """A GGUF writer of ``arch`` with the shape metadata of transformers config ``cfg``."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(float(rope_theta))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    return writer


def write_gguf(path: Path, model, tokenizer_dir: Path, *, arch: str = "llama", types=("F32",),
               chat_template: str | None = None, seed: int = 0) -> list[str]:
    """Write transformers ``model``'s config and weights, and ``tokenizer_dir``'s tokenizer.json,
    as the GGUF file ``path``. 2-D weights take ``types`` in turn (norms and biases stay F32).
    Returns the type each 2-D weight got, in order."""
    import gguf

    cfg = model.config
    writer = _writer(path, arch, cfg, cfg.rope_parameters["rope_theta"])
    writer.add_vocab_size(cfg.vocab_size)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if head_dim != cfg.hidden_size // cfg.num_attention_heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)

    spec = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    special = {t["content"] for t in spec["added_tokens"] if t.get("special")}
    tokens = sorted(vocab, key=vocab.get)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2" if arch == "qwen2" else "default")  # as llama.cpp names them
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]])
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    writer.add_bos_token_id(vocab[config["bos_token"]])
    writer.add_eos_token_id(vocab[config["eos_token"]])
    writer.add_add_bos_token(True)
    if chat_template is not None:
        writer.add_chat_template(chat_template)

    rng = np.random.default_rng(seed)
    given = []
    state = model.state_dict()
    for name, tensor in state.items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        w = tensor.detach().float().numpy()
        if arch in ("llama", "mistral") and (".q_proj." in name or ".k_proj." in name):
            w = reorder(w, cfg.num_attention_heads if ".q_proj." in name else cfg.num_key_value_heads)
        kind = "F32" if w.ndim == 1 else types[len(given) % len(types)]
        if w.ndim == 2:
            given.append(kind)
        if kind in K_QUANTS:
            writer.add_tensor(gguf_name(name), _k_quant_blocks(w.shape, kind, rng),
                              raw_dtype=gguf.GGMLQuantizationType[kind])
        elif kind in ("F32", "F16"):
            writer.add_tensor(gguf_name(name), w.astype(np.float32 if kind == "F32" else np.float16))
        else:
            qtype = gguf.GGMLQuantizationType[kind]
            writer.add_tensor(gguf_name(name), gguf.quants.quantize(w, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return given


def dequantized_state(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the GGUF file ``path`` dequantized, by GGUF name (the reference for K-quants)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    return {t.name: torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type))) for t in reader.tensors}


# Gemma 3 as llama.cpp writes it: sandwich norms under their own names, every norm weight stored
# as 1 + w, no query/key reordering, a SentencePiece vocabulary ("llama") listed best first and no merges.
_GEMMA3_LAYER = {**_LAYER, "post_attention_layernorm": "post_attention_norm",
                 "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}
NORMAL, CONTROL, USER_DEFINED, BYTE = 1, 3, 4, 6


def sentencepiece_vocab(pieces: list[str]) -> tuple[list[str], list[int]]:
    """A Gemma-like vocabulary: <pad> <eos> <bos> <unk>, two control tokens, the 256 byte tokens,
    then ``pieces`` best first (spaces written as U+2581, runs of spaces alone as spaces, as
    llama.cpp writes them). Returns (tokens, token types)."""
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    tokens = specials + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [CONTROL] * len(specials) + [BYTE] * 256
    types += [USER_DEFINED if set(p) == {" "} else NORMAL for p in pieces]
    return tokens, types


def _sentencepiece_metadata(writer, tokens: list[str], types: list[int], *, space_prefix: bool) -> None:
    """A SentencePiece vocabulary (``sentencepiece_vocab``'s) as llama.cpp writes it: listed best
    first, scores falling with the rank, <pad> <eos> <bos> <unk> at 0 to 3."""
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores([-float(i) for i in range(len(tokens))])
    writer.add_token_types(types)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(space_prefix)


def write_gemma3_gguf(path: Path, model, tokens: list[str], types: list[int]) -> None:
    """Write the transformers Gemma 3 or Gemma 2 ``model`` (float32 weights) with the vocabulary
    ``tokens`` as a GGUF file, as llama.cpp's converter writes one."""
    cfg = model.config
    if cfg.model_type == "gemma2":
        writer = _writer(path, "gemma2", cfg, cfg.rope_parameters["rope_theta"])
        writer.add_float32("gemma2.attn_logit_softcapping", cfg.attn_logit_softcapping)
        writer.add_float32("gemma2.final_logit_softcapping", cfg.final_logit_softcapping)
    else:
        writer = _writer(path, "gemma3", cfg, cfg.rope_parameters["full_attention"]["rope_theta"])
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_sliding_window(cfg.sliding_window)
    _sentencepiece_metadata(writer, tokens, types, space_prefix=False)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied
        w = tensor.detach().float().numpy()
        if name.endswith("norm.weight"):
            w = w + 1.0
        base, _, kind = name.rpartition(".")
        if base in _TOP:
            gname = f"{_TOP[base]}.{kind}"
        else:
            _, _, i, rest = base.split(".", 3)
            gname = f"blk.{i}.{_GEMMA3_LAYER[rest]}.{kind}"
        writer.add_tensor(gname, w.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


_PHI3_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.qkv_proj": "attn_qkv", "self_attn.o_proj": "attn_output",
               "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def write_phi3_gguf(path: Path, model, tokens: list[str], types: list[int]) -> None:
    """Write the transformers Phi-3 ``model`` (float32 weights, its fused query/key/value and
    gate/up projections kept whole, unreordered) with a SentencePiece vocabulary, as llama.cpp's
    converter writes one: a longrope model's factors as the rope_factors_short/long tensors, its
    original context and factor on cos and sin as metadata."""
    cfg = model.config
    rope = cfg.rope_parameters
    writer = _writer(path, "phi3", cfg, rope["rope_theta"])
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    _sentencepiece_metadata(writer, tokens, types, space_prefix=True)
    if rope.get("rope_type") == "longrope":
        original = cfg.original_max_position_embeddings
        scale = cfg.max_position_embeddings / original
        writer.add_uint32("phi3.rope.scaling.original_context_length", original)
        writer.add_float32("phi3.rope.scaling.attn_factor", (1 + np.log(scale) / np.log(original)) ** 0.5)
        writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
    for name, tensor in model.state_dict().items():
        base, _, kind = name.rpartition(".")
        if base in _TOP:
            gname = f"{_TOP[base]}.{kind}"
        else:
            _, _, i, rest = base.split(".", 3)
            gname = f"blk.{i}.{_PHI3_LAYER[rest]}.{kind}"
        writer.add_tensor(gname, tensor.detach().float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_gpt_oss_gguf(path: Path, model, tokenizer_dir: Path, *, expert_type: str = "F32") -> None:
    """Write the transformers gpt-oss ``model`` as llama.cpp's converter writes one: each expert
    projection stacked over the experts in the (out, in) layout with gate and up apart (the
    checkpoint interleaves them by column), the sink logits as ``attn_sinks.weight``, YaRN's
    scaling as metadata, the expert weights in ``expert_type`` (llama.cpp's files: MXFP4), and
    ``tokenizer_dir``'s byte-level BPE with the o200k split ("gpt-4o")."""
    import gguf

    cfg = model.config
    rope = cfg.rope_parameters
    writer = _writer(path, "gpt-oss", cfg, rope["rope_theta"])
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_sliding_window(cfg.sliding_window)
    writer.add_uint32("gpt-oss.expert_count", cfg.num_local_experts)
    writer.add_uint32("gpt-oss.expert_used_count", cfg.num_experts_per_tok)
    writer.add_uint32("gpt-oss.expert_feed_forward_length", cfg.intermediate_size)
    writer.add_string("gpt-oss.rope.scaling.type", "yarn")
    writer.add_float32("gpt-oss.rope.scaling.factor", rope["factor"])
    writer.add_uint32("gpt-oss.rope.scaling.original_context_length", rope["original_max_position_embeddings"])
    spec = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-4o")
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)
    writer.add_token_list(tokens)
    writer.add_token_types([1] * len(tokens))
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]])
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.router": "ffn_gate_inp"}
    for name, tensor in model.state_dict().items():
        w = tensor.detach().float().numpy()
        base, _, kind = name.rpartition(".")
        if base in _TOP:
            writer.add_tensor(f"{_TOP[base]}.{kind}", w)
            continue
        _, _, i, rest = name.split(".", 3)
        if rest == "self_attn.sinks":
            writer.add_tensor(f"blk.{i}.attn_sinks.weight", w)
        elif rest.startswith("mlp.experts."):
            proj = rest.removeprefix("mlp.experts.")
            bias = proj.endswith("_bias")
            if not bias:
                w = np.ascontiguousarray(w.swapaxes(-1, -2))  # (E, out, in)
            parts = {"down": w} if proj.startswith("down") else {"gate": w[..., ::2] if bias else w[:, ::2],
                                                                 "up": w[..., 1::2] if bias else w[:, 1::2]}
            for part, t in parts.items():
                gname = f"blk.{i}.ffn_{part}_exps.{'bias' if bias else 'weight'}"
                t = np.ascontiguousarray(t)
                if bias or expert_type == "F32":
                    writer.add_tensor(gname, t)
                else:
                    qtype = gguf.GGMLQuantizationType[expert_type]
                    writer.add_tensor(gname, gguf.quants.quantize(t, qtype), raw_dtype=qtype)
        else:
            base, _, kind = rest.rpartition(".")
            writer.add_tensor(f"blk.{i}.{names[base]}.{kind}", w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
