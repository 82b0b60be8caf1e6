"""GGUF checkpoints (llama.cpp's single-file format) of the Llama family: config, weights, tokenizer.

A GGUF file holds a model's configuration and tokenizer as metadata and its weights as tensors,
most of them quantized in blocks (Q8_0, Q4_1, Q4_K, ...). ``read`` turns one into what a
Hugging Face checkpoint directory holds: a ``config.json`` dictionary, float32 tensors under
Hugging Face names, and a ``tokenizers`` tokenizer with its ``tokenizer_config.json`` fields, so
that ``checkpoint.load`` and ``load_tokenizer`` treat both formats alike.

What changes on the way:
- names: ``blk.{i}.attn_q.weight`` is ``model.layers.{i}.self_attn.q_proj.weight``, and so on;
- the rotary layout: llama.cpp's converter reorders the rows of a Llama query and key projection
  so that the two halves a rotation pairs sit next to each other (interleaved pairs); kvcache, like
  transformers, rotates first half against second half, so those rows are put back. Qwen files are
  written without the reordering;
- blocks of codes are dequantized by the ``gguf`` package (``pip install gguf``).

A file is checked before anything is built from it: its magic, every tensor inside the file's
bytes (a truncated file is refused, never read past its end), each tensor's type among
``TENSOR_TYPES``, and an architecture of ``ARCHITECTURES``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError

MAGIC = b"GGUF"

_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
# Gemma's sandwich blocks: a norm after attention and after the MLP; llama.cpp's "ffn_norm" is
# then the norm before the MLP.
_SANDWICH_NAMES = {**_LAYER_NAMES, "ffn_norm": "pre_feedforward_layernorm",
                   "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
# Phi-3 keeps the checkpoint's fused projections: query/key/value in one, gate and up in one
# ("ffn_up"), split on loading as a Hugging Face checkpoint's are (checkpoint.py).
_FUSED_NAMES = {**_LAYER_NAMES, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
# gpt-oss: the learned sink logits, the router, and each expert projection stacked over the
# experts, gate and up apart (joined on reading: _join_experts).
_EXPERT_NAMES = {**_LAYER_NAMES, "post_attention_norm": "post_attention_layernorm", "attn_sinks": "self_attn.sinks",
                 "ffn_gate_inp": "mlp.router", "ffn_gate_exps": "mlp.experts.gate", "ffn_up_exps": "mlp.experts.up",
                 "ffn_down_exps": "mlp.experts.down"}
# longrope's factors, which a Phi-3 file keeps as tensors: (head_dim // 2,) each.
_ROPE_FACTORS = {"rope_factors_short.weight": "short_factor", "rope_factors_long.weight": "long_factor"}


@dataclass(frozen=True)
class Architecture:
    """How llama.cpp wrote one architecture: the config.json ``model_type`` it is; whether its
    converter reordered the query and key rows (Llama's); the offset it added to every norm
    weight (Gemma's (1 + w) norms are stored as 1 + w); its per-layer tensor names."""

    model_type: str
    reordered: bool
    norm_offset: float = 0.0
    layer_names: Mapping[str, str] = field(default_factory=lambda: _LAYER_NAMES)


# general.architecture -> how its files are written.
ARCHITECTURES = {
    "llama": Architecture("llama", reordered=True), "mistral": Architecture("mistral", reordered=True),
    "qwen2": Architecture("qwen2", reordered=False), "qwen3": Architecture("qwen3", reordered=False),
    "phi3": Architecture("phi3", reordered=False, layer_names=_FUSED_NAMES),
    "gpt-oss": Architecture("gpt_oss", reordered=False, layer_names=_EXPERT_NAMES),
    "gemma2": Architecture("gemma2", reordered=False, norm_offset=1.0, layer_names=_SANDWICH_NAMES),
    "gemma3": Architecture("gemma3_text", reordered=False, norm_offset=1.0, layer_names=_SANDWICH_NAMES),
}
# Tensor types read (the gguf package dequantizes each block type to float32).
TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "MXFP4")
# llama.cpp's Gemma 3: every sixth layer global, the others sliding; the sliding layers rotate with
# base 10k (neither is in the file's metadata).
GEMMA3_GLOBAL_EVERY = 6
GEMMA3_LOCAL_THETA = 10000.0
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# tokenizer.ggml.token_type values.
_CONTROL, _USER_DEFINED = 3, 4
# How text is split into words before BPE, by tokenizer.ggml.pre, where it is not GPT-2's split:
# the expressions of the models' own tokenizer.json files (Qwen2 keeps digits apart, Llama 3
# groups up to three).
_WORDS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|DIGITS| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
SPLITS = {
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), _WORDS.replace("DIGITS", r"\p{N}")),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "smaug-bpe"), _WORDS.replace("DIGITS", r"\p{N}{1,3}")),
    # gpt-oss's o200k: words with their case runs and contractions, up to three digits.
    "gpt-4o": "|".join((
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}", r" ?[^\s\p{L}\p{N}]+[\r\n/]*", r"\s*[\r\n]+", r"\s+(?!\S)", r"\s+")),
}


@dataclass
class GGUFCheckpoint:
    """What a Hugging Face checkpoint directory would hold, read from one GGUF file.

    config: the ``config.json`` dictionary; tensors: float32 tensors under Hugging Face names
    (empty when read with ``weights=False``); tokenizer: a ``tokenizers.Tokenizer``;
    tokenizer_config: ``tokenizer_config.json``'s fields (special tokens, chat template).
    """

    config: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    tokenizer: Any
    tokenizer_config: dict[str, Any]


def is_gguf(path: str | Path) -> bool:
    """Whether ``path`` is a regular file that starts with GGUF's magic bytes."""
    path = Path(path)
    if not path.is_file():
        return False
    with path.open("rb") as f:
        return f.read(4) == MAGIC


def read(path: str | Path, *, weights: bool = True) -> GGUFCheckpoint:
    """Read the GGUF file ``path`` (see the module docstring); ``weights=False`` reads the
    metadata and checks the tensors without dequantizing them."""
    path = Path(path)
    reader = _open(path)
    fields = _Fields(reader, path)
    arch = fields.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise CheckpointError(f"{path} holds a {arch!r} model; GGUF files of these architectures load: "
                              f"{', '.join(sorted(ARCHITECTURES))}")
    architecture = ARCHITECTURES[arch]
    names = {t.name for t in reader.tensors}
    config = _config(fields, arch, architecture.model_type, names)
    if _ROPE_FACTORS.keys() <= names:
        _longrope(config, fields, arch, {t.name: t for t in reader.tensors if t.name in _ROPE_FACTORS}, path)
    tensors = {}
    for t in reader.tensors:
        if t.name in _ROPE_FACTORS and "long_factor" in config["rope_parameters"]:
            continue  # read into the config (_longrope)
        hf = _hf_name(t.name, architecture.layer_names)
        if hf is None:
            raise CheckpointError(f"{path} holds tensor {t.name!r}, which kvcache does not know how to use "
                                  "(llama.cpp's rope_freqs and other extras are not supported)")
        if t.tensor_type.name not in TENSOR_TYPES:
            raise CheckpointError(f"tensor {t.name!r} of {path} has type {t.tensor_type.name}; the types read are "
                                  f"{', '.join(TENSOR_TYPES)}")
        if weights:
            tensors[hf] = _tensor(t, path)
            if architecture.norm_offset and hf.endswith("norm.weight"):
                tensors[hf] -= architecture.norm_offset
    if architecture.model_type == "gpt_oss" and weights:
        tensors = _join_experts(tensors)
    if architecture.reordered and weights:
        for name, tensor in tensors.items():
            if ".q_proj." in name:
                tensors[name] = _unreorder(tensor, config["num_attention_heads"])
            elif ".k_proj." in name:
                tensors[name] = _unreorder(tensor, config["num_key_value_heads"])
    tokenizer, tokenizer_config = _tokenizer(fields, path)
    return GGUFCheckpoint(config, tensors, tokenizer, tokenizer_config)


# ----- the file ---------------------------------------------------------------------------------


def _open(path: Path):
    if not path.is_file():  # a pipe or a device would block or never end
        raise CheckpointError(f"{path} is not a regular file")
    if not is_gguf(path):
        raise CheckpointError(f"{path} is not a GGUF file (it does not start with the bytes 'GGUF')")
    try:
        from gguf import GGUFReader
    except ImportError:
        raise CheckpointError("reading GGUF files needs the gguf package: pip install gguf") from None
    try:
        reader = GGUFReader(str(path), "r")
    except Exception as e:  # the reader raises several types for truncated or corrupt files
        raise CheckpointError(f"cannot read {path}: it is corrupt or truncated ({type(e).__name__}: {e})") from None
    size = path.stat().st_size
    for t in reader.tensors:
        # The reader maps the file: a tensor that does not fit in it comes back short.
        if t.data_offset + t.n_bytes > size or t.data.nbytes != t.n_bytes:
            raise CheckpointError(f"{path} is truncated: tensor {t.name!r} needs bytes up to "
                                  f"{t.data_offset + t.n_bytes}, the file has {size}")
    return reader


class _Fields:
    """Metadata of one file by key, read on demand: ``get`` a value, ``need`` one that must be there."""

    def __init__(self, reader, path: Path) -> None:
        self.fields, self.path = reader.fields, path

    def get(self, key: str, default: Any = None) -> Any:
        field = self.fields.get(key)
        if field is None:
            return default
        try:
            return field.contents()
        except Exception as e:
            raise CheckpointError(f"cannot read metadata {key!r} of {self.path} ({e})") from None

    def need(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise CheckpointError(f"{self.path} has no metadata {key!r}, which a model of its architecture needs")
        return value


def _config(fields: _Fields, arch: str, model_type: str, names: set[str]) -> dict[str, Any]:
    """config.json's fields from the metadata ``{arch}.*`` (and tokens, for the vocabulary size)."""
    heads = fields.need(f"{arch}.attention.head_count")
    hidden = fields.need(f"{arch}.embedding_length")
    vocab = fields.get(f"{arch}.vocab_size")
    if vocab is None:
        vocab = len(fields.need("tokenizer.ggml.tokens"))
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": _decimal(fields.get(f"{arch}.rope.freq_base", 10000.0))}
    scaling = fields.get(f"{arch}.rope.scaling.type")
    if scaling in ("linear", "yarn"):
        rope = {**rope, "rope_type": scaling, "factor": float(fields.need(f"{arch}.rope.scaling.factor"))}
    elif scaling not in (None, "none"):
        raise CheckpointError(f"{fields.path} uses {scaling!r} rope scaling; GGUF files with none, linear or yarn load")
    if scaling == "yarn":
        # (llama.cpp rounds the ramp's ends to whole dimensions: truncate, the default.)
        rope["original_max_position_embeddings"] = int(fields.need(f"{arch}.rope.scaling.original_context_length"))
        for key in ("beta_fast", "beta_slow"):
            value = fields.get(f"{arch}.rope.scaling.yarn_{key}")
            if value is not None:
                rope[key] = _decimal(value)
    config = {
        "model_type": model_type,
        "vocab_size": int(vocab),
        "hidden_size": int(hidden),
        "intermediate_size": int(fields.need(f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(fields.need(f"{arch}.block_count")),
        "num_attention_heads": int(heads),
        "num_key_value_heads": int(fields.get(f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(fields.get(f"{arch}.attention.key_length", hidden // heads)),
        "rms_norm_eps": _decimal(fields.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(fields.get(f"{arch}.context_length", 2048)),
        "rope_parameters": rope,
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "bos_token_id": fields.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": fields.get("tokenizer.ggml.eos_token_id"),
    }
    window = fields.get(f"{arch}.attention.sliding_window")
    if window:
        config["sliding_window"] = int(window)
    if model_type == "gemma3_text":
        _gemma3(config, fields, arch)
    if model_type == "gemma2":
        _gemma2(config, fields, arch)
    if model_type == "gpt_oss":
        _gpt_oss(config, fields, arch)
    return config


def _gpt_oss(config: dict[str, Any], fields: _Fields, arch: str) -> None:
    """gpt-oss as llama.cpp writes it: its experts in the metadata, its window, and what its code
    fixes: sliding and global layers alternating (layer 0 slides)."""
    if "sliding_window" not in config:
        raise CheckpointError(f"{fields.path} is a gpt-oss file without {arch}.attention.sliding_window")
    config["num_local_experts"] = int(fields.need(f"{arch}.expert_count"))
    config["num_experts_per_tok"] = int(fields.need(f"{arch}.expert_used_count"))
    config["intermediate_size"] = int(fields.need(f"{arch}.expert_feed_forward_length"))
    config["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention"
                             for i in range(config["num_hidden_layers"])]


def _join_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """gpt-oss's tensors as its checkpoints hold them: per layer, gate and up (E, I, H) as one
    gate_up_proj (E, H, 2I) with gate and up in alternate columns, down (E, H, I) as
    down_proj (E, I, H), their biases alike, and the sink logits without the ".weight" llama.cpp
    adds."""
    out = {}
    for name, t in tensors.items():
        if ".mlp.experts." not in name:
            out[name.replace("self_attn.sinks.weight", "self_attn.sinks")] = t
            continue
        base, part, kind = name.rsplit(".", 2)
        if part == "down":
            out[f"{base}.down_proj" + ("" if kind == "weight" else "_bias")] = t.transpose(-1, -2) if kind == "weight" else t
        elif part == "gate":
            up = tensors.get(f"{base}.up.{kind}")
            if up is None:
                raise CheckpointError(f"the GGUF file has {name!r}'s gate experts but not their up projections "
                                      f"(ffn_up_exps.{kind})")
            gate = t.transpose(-1, -2) if kind == "weight" else t
            up = up.transpose(-1, -2) if kind == "weight" else up
            out[f"{base}.gate_up_proj" + ("" if kind == "weight" else "_bias")] = torch.stack((gate, up), -1).flatten(-2)
    return {name: t.contiguous() for name, t in out.items()}


def _longrope(config: dict[str, Any], fields: _Fields, arch: str, tensors: dict, path: Path) -> None:
    """Phi-3's longrope, as llama.cpp writes it: the short and long factors as tensors, the
    original context and (optionally) the factor on cos and sin as metadata."""
    original = fields.need(f"{arch}.rope.scaling.original_context_length")
    rope = {**config["rope_parameters"], "rope_type": "longrope", "original_max_position_embeddings": int(original)}
    for name, key in _ROPE_FACTORS.items():
        rope[key] = _tensor(tensors[name], path).tolist()
    factor = fields.get(f"{arch}.rope.scaling.attn_factor")
    if factor is not None:
        rope["attention_factor"] = _decimal(factor)
    config["rope_parameters"] = rope


def _gemma2(config: dict[str, Any], fields: _Fields, arch: str) -> None:
    """What a Gemma 2 file leaves to llama.cpp's code: sliding and global layers alternate (layer 0
    slides), the attention scale (1/sqrt(head size), 1/sqrt(hidden / heads) for the 46-layer 27B),
    the activation. Its soft caps and window are metadata."""
    if "sliding_window" not in config:
        raise CheckpointError(f"{fields.path} is a Gemma 2 file without {arch}.attention.sliding_window")
    layers = config["num_hidden_layers"]
    config["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    wide = layers == 46
    config["query_pre_attn_scalar"] = config["hidden_size"] // config["num_attention_heads"] if wide else config["head_dim"]
    config["hidden_activation"] = "gelu_pytorch_tanh"
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        cap = fields.get(f"{arch}.{key}")
        config[key] = None if cap is None else _decimal(cap)


def _gemma3(config: dict[str, Any], fields: _Fields, arch: str) -> None:
    """What a Gemma 3 file leaves to llama.cpp's code: the layer pattern, the sliding layers'
    rotary (the file's rotary and its scaling are the global layers'), the attention scale
    (llama.cpp scales by 1/sqrt(head size), by 1/sqrt(hidden / heads) for the 62-layer 27B), the
    activation; and the sliding window, which every Gemma 3 has."""
    layers = config["num_hidden_layers"]
    config["layer_types"] = ["full_attention" if (i + 1) % GEMMA3_GLOBAL_EVERY == 0 else "sliding_attention"
                             for i in range(layers)]
    local = {"rope_type": "default", "rope_theta": GEMMA3_LOCAL_THETA}
    config["rope_parameters"] = {"full_attention": config["rope_parameters"], "sliding_attention": local}
    wide = layers == 62
    config["query_pre_attn_scalar"] = config["hidden_size"] // config["num_attention_heads"] if wide else config["head_dim"]
    config["hidden_activation"] = "gelu_pytorch_tanh"
    if "sliding_window" not in config:
        raise CheckpointError(f"{fields.path} is a Gemma 3 file without {arch}.attention.sliding_window")


def _decimal(value: Any) -> float:
    """A float32 metadata value as the decimal it was written from (1e-05, not 9.99999974e-06):
    the shortest decimal that reads back as the same float32."""
    import numpy as np

    return float(str(np.float32(value)))


def _hf_name(name: str, layer_names: Mapping[str, str]) -> str | None:
    """The Hugging Face name of GGUF tensor ``name`` (per-layer names from ``layer_names``), or
    None for one kvcache has no use for."""
    top, _, kind = name.rpartition(".")
    if top in _TOP_NAMES and kind in ("weight", "bias"):
        return f"{_TOP_NAMES[top]}.{kind}"
    m = _LAYER_TENSOR.fullmatch(name)
    if m is None or m.group(2) not in layer_names:
        return None
    return f"model.layers.{m.group(1)}.{layer_names[m.group(2)]}.{m.group(3)}"


def _tensor(t, path: Path) -> torch.Tensor:
    """One tensor as float32, in the Hugging Face shape (GGUF lists dimensions innermost first)."""
    from gguf import quants

    try:
        values = quants.dequantize(t.data, t.tensor_type)
    except Exception as e:
        raise CheckpointError(f"cannot dequantize tensor {t.name!r} of {path} ({type(e).__name__}: {e})") from None
    shape = tuple(int(n) for n in reversed(t.shape))
    # F32 tensors come back as views of the read-only mapped file: those are copied.
    return torch.from_numpy(values.astype("float32", copy=not values.flags.writeable).reshape(shape))


def _unreorder(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of a query or key projection (or bias), (heads * D, ...), from llama.cpp's order, where
    each head's rows pair up as (0, 1), (2, 3), ..., back to first half and second half."""
    D = w.shape[0] // heads
    rest = w.shape[1:]
    return w.reshape(heads, D // 2, 2, *rest).transpose(1, 2).reshape(w.shape).contiguous()


# ----- the tokenizer ------------------------------------------------------------------------------


def _tokenizer(fields: _Fields, path: Path):
    """A ``tokenizers.Tokenizer`` from tokenizer.ggml.* (byte-level BPE, or Gemma's SentencePiece
    BPE), and tokenizer_config's fields."""
    from tokenizers import AddedToken, processors

    kind = fields.get("tokenizer.ggml.model")
    arch = fields.get("general.architecture")
    tokens = list(fields.need("tokenizer.ggml.tokens"))
    types = list(fields.get("tokenizer.ggml.token_type") or [])
    if kind == "gpt2":
        backend, kept = _byte_level(fields, tokens, path)
    elif kind == "llama" and arch in SENTENCEPIECE_BY_ORDER:
        backend, kept = _sentencepiece(fields, tokens), (lambda token: True)
    else:
        raise CheckpointError(f"{path} has a {kind!r} tokenizer; GGUF files with byte-level BPE ('gpt2') "
                              f"tokenizers load, and SentencePiece ('llama') ones of {', '.join(SENTENCEPIECE_BY_ORDER)} "
                              "(convert the model's tokenizer.json alongside otherwise)")
    # Control tokens (<|im_start|>, <start_of_turn>) match whole and are special; user-defined ones
    # match whole. (A byte-level "control" token outside the byte alphabet is a mislabel, left alone.)
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, kind_ in zip(tokens, types) if kind_ == _CONTROL and kept(t)])
    # (Only those the vocabulary spells as the file does: Gemma's runs of spaces are respelled.)
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, kind_ in zip(tokens, types) if kind_ == _USER_DEFINED and backend.token_to_id(t) is not None])
    config: dict[str, Any] = {}
    for key, name in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                       ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        index = fields.get(f"tokenizer.ggml.{name}")
        if index is not None and 0 <= int(index) < len(tokens):
            config[key] = tokens[int(index)]
    if fields.get("tokenizer.ggml.add_bos_token") and "bos_token" in config:
        bos = config["bos_token"]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, backend.token_to_id(bos))])
    template = fields.get("tokenizer.chat_template")
    if template is not None:
        config["chat_template"] = template
    return backend, config


def _byte_level(fields: _Fields, tokens: list[str], path: Path):
    """Byte-level BPE (GPT-2's, Llama 3's, Qwen's): the backend, and which tokens are spelled in
    the byte alphabet."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    merges = [tuple(m.split(" ", 1)) for m in fields.need("tokenizer.ggml.merges")]
    alphabet = _byte_alphabet()
    letters = set(alphabet.values())
    # Tokens are stored in the byte-level alphabet; one that is not is spelled in it from its UTF-8.
    spelled = [t if set(t) <= letters else "".join(alphabet[b] for b in t.encode("utf-8")) for t in tokens]
    vocab = {t: i for i, t in enumerate(spelled)}
    # (tokenizers aborts the process, not with an exception, on a merge outside the vocabulary.)
    bad = next((m for m in merges if len(m) != 2 or m[0] not in vocab or m[1] not in vocab or m[0] + m[1] not in vocab),
               None)
    if bad is not None:
        raise CheckpointError(f"{path} has the merge {' '.join(bad)!r}, whose tokens are not all in its vocabulary")
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    split = SPLITS.get(fields.get("tokenizer.ggml.pre"))
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # GPT-2's split
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    return backend, (lambda token: set(token) <= letters)


# Architectures whose SentencePiece vocabulary is listed in merge order, best first, and whose
# files carry no merges (Gemma's): the merges are recovered from that order.
SENTENCEPIECE_BY_ORDER = ("gemma2", "gemma3", "phi3")
_SPACE = "\u2581"  # SentencePiece's spelling of a space


def _sentencepiece(fields: _Fields, tokens: list[str]):
    """SentencePiece BPE as a ``tokenizers`` BPE: spaces spelled as U+2581, no pre-split (a
    text is one word), byte fallback for characters outside the vocabulary (tokens <0x00> to
    <0xFF>), the merges recovered from the vocabulary's order (``merges_by_order``)."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    # llama.cpp writes a token of spaces alone with real spaces, where the vocabulary spells them.
    spelled = [_SPACE * len(t) if t and set(t) == {" "} else t for t in tokens]
    vocab = {t: i for i, t in enumerate(spelled)}
    unk = fields.get("tokenizer.ggml.unknown_token_id")
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges_by_order(spelled, vocab), fuse_unk=True,
                                   byte_fallback=True, unk_token=None if unk is None else spelled[int(unk)]))
    space = [normalizers.Prepend(_SPACE)] if fields.get("tokenizer.ggml.add_space_prefix") else []
    backend.normalizer = normalizers.Sequence([*space, normalizers.Replace(" ", _SPACE)])
    backend.decoder = decoders.Sequence([decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    return backend


def merges_by_order(tokens: list[str], vocab: Mapping[str, int]) -> list[tuple[str, str]]:
    """The BPE merges a vocabulary listed best first implies: every way of cutting a token into
    two tokens of the vocabulary is a merge, ranked by that token's place in the list, and among
    the cuts of one token the one with the longer left part first."""
    merges = []
    for token in tokens:
        merges.extend((token[:i], token[i:]) for i in range(len(token) - 1, 0, -1)
                      if token[:i] in vocab and token[i:] in vocab)
    return merges


def _byte_alphabet() -> dict[int, str]:
    """The byte-level BPE alphabet: each byte as one printable character (printable Latin-1 bytes
    as themselves, the others as the characters from U+0100 on, in byte order)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    alphabet = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in alphabet:
            alphabet[b] = chr(256 + extra)
            extra += 1
    return alphabet
