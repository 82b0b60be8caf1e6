"""Loading checkpoints and tokenizers: Hugging Face-format directories (safetensors, single file or
sharded) and GGUF files (kvcache/checkpoints/gguf.py), which read into the same config and tensors."""

from __future__ import annotations

import functools
import json
import re
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import torch
from safetensors import safe_open

from ..errors import CheckpointError, KVCacheWarning
from ..model.config import ModelConfig
from ..model.transformer import Transformer
from ..quant import int4_linear
from ..runtime import devices
from ..runtime.threads import for_model as threads_for_model
from . import gguf

# Shipped with the package once the reference model exists; ``load()`` with no source uses it.
BUNDLED_MODEL = Path(__file__).resolve().parent.parent / "reference_model"

# How ``load`` holds the projections' weights: in the model's dtype, or as 4-bit codes.
WEIGHTS = ("full", "int4")

# Tensors some checkpoints carry that the model recomputes instead.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _resolve(source: str | Path | None) -> Path:
    if source is None:
        if not (BUNDLED_MODEL / "config.json").exists():
            raise CheckpointError(
                "no model given and the bundled reference model is not installed; "
                "pass the path of a Hugging Face-format checkpoint directory"
            )
        return BUNDLED_MODEL
    path = Path(source).expanduser()  # "~/..." as the docs write it, even where no shell expanded it
    if path.is_file() and gguf.is_gguf(path):
        return path
    if not path.is_dir():
        what = "does not exist" if not path.exists() else "is neither a directory nor a GGUF file"
        raise CheckpointError(f"{path} {what}; pass a Hugging Face-format checkpoint directory or a .gguf file")
    if (path / "adapter_config.json").exists() and not (path / "config.json").exists():
        raise CheckpointError(
            f"{path} holds LoRA adapters (adapter_config.json), not a model: run kvcache finetune with "
            "--merge-lora to write a full checkpoint that loads here, or apply the adapters to the base "
            "model with peft"
        )
    return path


def _weight_files(path: Path) -> list[Path]:
    single = path / "model.safetensors"
    index = path / "model.safetensors.index.json"
    if single.exists():
        return [single]
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index ({e})") from None
        if not isinstance(weight_map, dict) or not all(isinstance(n, str) for n in weight_map.values()):
            raise CheckpointError(f"{index}: weight_map must map tensor names to shard file names")
        for name in set(weight_map.values()):
            # A shard is a file of this directory: an index from elsewhere must not make the
            # loader read other files ("../x", "/etc/x", "sub/../../x").
            if name in ("", ".", "..") or name != Path(name).name or "\\" in name:
                raise CheckpointError(f"{index} names shard {name!r}, which is not a file name inside {path}; "
                                      "shards must sit next to the index")
        files = sorted({path / name for name in weight_map.values()})
        for f in files:
            if not f.exists():
                raise CheckpointError(f"{index} lists shard {f.name}, which is missing from {path}")
        return files
    raise CheckpointError(
        f"{path} has no model.safetensors or model.safetensors.index.json "
        "(only safetensors checkpoints are supported)"
    )


def _read_tensors(files: list[Path]) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        if not f.is_file():  # a pipe or a device would block or never end
            raise CheckpointError(f"{f} is not a regular file")
        try:
            with safe_open(str(f), framework="pt") as handle:
                for name in handle.keys():
                    tensors[name] = handle.get_tensor(name)
        except Exception as e:  # safetensors raises several types for truncated or corrupt files
            raise CheckpointError(f"cannot read {f}: it is corrupt or truncated ({e})") from None
    return tensors


def _check_config_against_weights(cfg: ModelConfig, tensors: Mapping[str, torch.Tensor], path: Path) -> None:
    """Before a model of ``cfg``'s shape is built (on the meta device, which costs nothing per
    parameter but a Python module per layer): a config.json claiming more layers than the
    weights hold is refused, instead of building millions of empty layers, and one whose
    sizes the embedding does not have, before torch computes sizes from them."""
    held = {int(m.group(1)) for name in tensors if (m := _LAYER.match(name))}
    if cfg.num_layers > len(held):
        raise CheckpointError(f"{path / 'config.json'} says num_hidden_layers={cfg.num_layers}, but the "
                              f"checkpoint holds tensors of {len(held)} layers")
    # Sizes no tensor has (2**40) overflow torch's size arithmetic even on the meta device.
    embed = tensors.get("model.embed_tokens.weight", tensors.get("embed_tokens.weight"))
    if embed is not None and tuple(embed.shape) != (cfg.vocab_size, cfg.hidden_size):
        raise CheckpointError(f"tensor 'model.embed_tokens.weight' in {path} has shape {tuple(embed.shape)}, "
                              f"but config.json implies {(cfg.vocab_size, cfg.hidden_size)}")


_LAYER = re.compile(r"(?:model\.)?layers\.(\d+)\.")


def load(
    source: str | Path | None = None,
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
    weights: str = "full",
    threads: bool = True,
) -> Transformer:
    """Load a model from a Hugging Face-format checkpoint directory or a GGUF file.

    ``source`` is the directory or file; without one (``kvcache.load()``) the bundled reference
    model is loaded (``kvcache/reference_model``, a 5.1M-parameter Llama stored in float16). A
    directory needs ``config.json`` and ``model.safetensors`` (or a sharded
    ``model.safetensors.index.json``); a GGUF file (Llama, Mistral, Qwen2, Qwen3) is dequantized
    (kvcache/checkpoints/gguf.py, which needs the ``gguf`` package). ``device`` defaults to CPU. ``dtype`` (None) defaults to
    float32 on CPU, whose half-precision kernels are slow (the bundled model is stored in
    float16), and to the checkpoint's own dtype elsewhere; ``kvcache generate`` does the same.
    ``weights="int4"`` keeps each attention and MLP projection as 4-bit codes in groups of 32
    input channels (kvcache/quant/int4_linear.py: a one-token step reads about 8x fewer bytes of
    them; an approximation, with bfloat16 inputs to a step's products; CPU only); a GGUF file's
    Q4_1 blocks come back as the file's own codes. The embedding, head and norms stay in
    ``dtype``. The model is returned in eval mode.

    ``threads``: set torch's intra-op thread count for the model as the command line does
    (kvcache/runtime/threads.py: one thread for a small model on the CPU, where more only wait on each
    other), unless the thread count was chosen (``torch.set_num_threads`` or ``OMP_NUM_THREADS``)
    before; False leaves it alone.
    """
    if weights not in WEIGHTS:
        raise ValueError(f"weights={weights!r}: choose one of {', '.join(map(repr, WEIGHTS))}")
    if weights == "int4" and device is not None and devices.canonical(device).type != "cpu":
        raise ValueError(f"weights='int4' runs on the CPU only (torch's int4 kernel); got device {device!s}")
    path = _resolve(source)
    if path.is_file():
        checkpoint = gguf.read(path)
        cfg, tensors = ModelConfig.from_hf(checkpoint.config), checkpoint.tensors
    else:
        cfg = ModelConfig.from_json(path / "config.json")
        tensors = _language_model(_read_tensors(_weight_files(path)))
    _check_config_against_weights(cfg, tensors, path)
    # Checkpoint names are the module names with a leading "model." (lm_head has none).
    state = _split_fused(cfg, {name.removeprefix("model."): t for name, t in tensors.items()}, path)

    try:
        with torch.device("meta"):
            model = Transformer(cfg)
    except (RuntimeError, OverflowError) as e:  # sizes torch cannot even compute
        raise CheckpointError(f"{path / 'config.json'} describes a model that cannot be built ({e})") from None
    expected = _check_state(model, cfg, state, path)
    device = devices.canonical(device) if device is not None else torch.device("cpu")
    if dtype is None:
        dtype = torch.float32 if device.type == "cpu" else state["embed_tokens.weight"].dtype
    model.load_state_dict(
        {n: state[n].to(device=device, dtype=dtype) for n in expected}, strict=False, assign=True
    )
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    if device.type == "cpu":
        model.lay_out_head(hidden_major=True)
    model.reset_rope()
    if weights == "int4":
        int4_linear.quantize_model(model)
    if threads:
        threads_for_model(model)
    return model.eval()


def _check_state(model: Transformer, cfg: ModelConfig, state: dict[str, torch.Tensor], path: Path) -> dict:
    """The model's own tensors (less a tied head), each checked present in ``state`` with its
    shape (CheckpointError naming it); the checkpoint's tensors the model has no use for are
    warned about. ``state``'s tied head is dropped."""
    expected = model.state_dict()
    if cfg.tie_word_embeddings:
        expected.pop("lm_head.weight")
        state.pop("lm_head.weight", None)
    for name, ref in expected.items():
        if name not in state:
            hf_name = name if name.startswith("lm_head") else f"model.{name}"
            raise CheckpointError(f"checkpoint {path} is missing tensor {hf_name!r}")
        if state[name].shape != ref.shape:
            raise CheckpointError(
                f"tensor {name!r} in {path} has shape {tuple(state[name].shape)}, "
                f"but config.json implies {tuple(ref.shape)}"
            )
    unexpected = sorted(n for n in state if n not in expected and not n.endswith(_IGNORED_SUFFIXES))
    if unexpected:
        warnings.warn(f"ignoring {len(unexpected)} unexpected tensors in {path}: {unexpected[:5]}", KVCacheWarning,
                      stacklevel=3)
    return expected


# A multimodal checkpoint (Gemma 3's ConditionalGeneration) keeps its language model under one of
# these prefixes (the hub's files, and transformers' own names), beside the parts that read
# images, which kvcache does not run: prefix -> the text-only checkpoint's.
_LANGUAGE_MODEL = {"language_model.model.": "model.", "language_model.lm_head.": "lm_head.",
                   "model.language_model.": "model."}
_OTHER_MODALITIES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def _language_model(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` as a text-only checkpoint names them: a multimodal checkpoint's language model
    and head, without its image tower and projector."""
    if not any(name.startswith(tuple(_LANGUAGE_MODEL)) for name in tensors):
        return tensors
    renamed = {}
    for name, t in tensors.items():
        if name.startswith(_OTHER_MODALITIES):
            continue
        prefix = next((p for p in _LANGUAGE_MODEL if name.startswith(p)), "")
        renamed[_LANGUAGE_MODEL.get(prefix, "") + name.removeprefix(prefix)] = t
    return renamed


# Fused projections (Phi-3) -> kvcache's separate ones, in the order their rows are stacked.
_FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
          "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


def _split_fused(cfg: ModelConfig, state: dict[str, torch.Tensor], path: Path) -> dict[str, torch.Tensor]:
    """``state`` with each fused projection (``qkv_proj``: the query rows, then the key rows,
    then the value rows; ``gate_up_proj``: the gate rows, then the up rows) split into the
    projections kvcache's model has."""
    D = cfg.head_dim
    rows = {"self_attn.qkv_proj": [cfg.num_heads * D, cfg.num_kv_heads * D, cfg.num_kv_heads * D],
            "mlp.gate_up_proj": [cfg.intermediate_size] * 2}
    out = {}
    for name, t in state.items():
        module, _, kind = name.rpartition(".")
        fused = next((f for f in _FUSED if module.endswith(f)), None)
        if fused is None:
            out[name] = t
            continue
        if t.shape[0] != sum(rows[fused]):
            raise CheckpointError(f"tensor {name!r} in {path} has {t.shape[0]} rows, but config.json implies "
                                  f"{' + '.join(map(str, rows[fused]))}")
        base = module.removesuffix(fused)
        for part, piece in zip(_FUSED[fused], t.split(rows[fused])):
            out[f"{base}{part}.{kind}"] = piece
    return out


@dataclass
class Tokenizer:
    """A ``tokenizers`` tokenizer with the special tokens and chat template of its checkpoint.

    ``special_tokens`` maps names such as ``bos_token`` and ``eos_token`` to their text, for
    chat templates that write them.
    """

    backend: object
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    chat_template: str | None = None
    special_tokens: dict[str, str] = field(default_factory=dict)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size()

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, object]],
        *,
        add_generation_prompt: bool = False,
        tokenize: bool = True,
    ) -> list[int] | str:
        """Render a conversation with the checkpoint's chat template, as transformers does.

        ``messages`` is a list of ``{"role": "system" | "user" | "assistant", "content": text}``.
        ``add_generation_prompt`` appends what opens the assistant's turn (pass True to generate
        a reply). Returns token ids (``tokenize=True``; the template writes the special tokens
        itself, so none are added) or the rendered text. Raises ``ValueError`` if the checkpoint
        has no chat template or the template rejects the messages.
        """
        if self.chat_template is None:
            raise ValueError(
                "this checkpoint has no chat template (no chat_template in tokenizer_config.json and no "
                "chat_template.jinja), so it was probably not trained for chat; pass plain text to encode()"
            )
        _check_messages(messages)
        text = _render_chat(self.chat_template, messages, add_generation_prompt, self.special_tokens)
        return self.encode(text, add_special_tokens=False) if tokenize else text


def _check_messages(messages: object) -> None:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError(f'messages must be a list of {{"role": ..., "content": ...}} dicts, got {type(messages).__name__}')
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or "content" not in m:
            raise ValueError(f'message {i} must be a dict with a "role" string and a "content", got {m!r}')


@functools.lru_cache(maxsize=8)
def _compile_chat_template(template: str):
    """The template compiled in the environment transformers renders chat templates in: a
    sandbox, trim_blocks and lstrip_blocks, loop controls, ``tojson`` that keeps non-ASCII text,
    and the globals ``raise_exception`` and ``strftime_now``."""
    from jinja2.exceptions import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except TemplateError as e:
        raise ValueError(f"the checkpoint's chat template is not valid Jinja: {e}") from None


def _render_chat(template: str, messages, add_generation_prompt: bool, special_tokens: dict[str, str]) -> str:
    from jinja2.exceptions import TemplateError

    compiled = _compile_chat_template(template)
    try:
        return compiled.render(messages=list(messages), add_generation_prompt=add_generation_prompt, **special_tokens)
    except TemplateError as e:
        raise ValueError(f"the checkpoint's chat template rejected the messages: {e}") from None


def _read_chat_template(path: Path, config: dict) -> str | None:
    """``chat_template.jinja`` if the checkpoint has one (newer transformers save it there), else
    ``chat_template`` of tokenizer_config.json: a string, or a list of named templates of which
    the one named "default" is taken."""
    file = path / "chat_template.jinja"
    if file.exists():
        return file.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default", next(iter(named.values()), None) if len(named) == 1 else None)
    return template if isinstance(template, str) else None


_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


def load_tokenizer(source: str | Path | None = None) -> Tokenizer:
    """Load ``tokenizer.json`` (and ``tokenizer_config.json`` and ``chat_template.jinja`` if
    present) from a checkpoint directory, or the tokenizer a GGUF file describes; without a
    source, the bundled reference model's."""
    from tokenizers import Tokenizer as Backend

    path = _resolve(source)
    if path.is_file():
        checkpoint = gguf.read(path, weights=False)
        config = checkpoint.tokenizer_config
        return _tokenizer(checkpoint.tokenizer, config, config.get("chat_template"))
    file = path / "tokenizer.json"
    if not file.exists():
        raise CheckpointError(f"{path} has no tokenizer.json")
    try:
        backend = Backend.from_file(str(file))
    except Exception as e:
        raise CheckpointError(f"cannot read {file}: {e}") from None
    extra = _read_json(path / "tokenizer_config.json")
    return _tokenizer(backend, extra, _read_chat_template(path, extra))


def _tokenizer(backend, extra: Mapping[str, object], chat_template: str | None) -> Tokenizer:
    """A ``Tokenizer`` of ``backend`` with the special tokens ``extra`` (tokenizer_config.json's
    fields) names."""

    def token_text(key: str) -> str | None:
        token = extra.get(key)
        if isinstance(token, dict):
            token = token.get("content")
        return token if isinstance(token, str) else None

    def token_id(key: str) -> int | None:
        text = token_text(key)
        return None if text is None else backend.token_to_id(text)

    return Tokenizer(
        backend=backend,
        bos_token_id=token_id("bos_token"),
        eos_token_id=token_id("eos_token"),
        chat_template=chat_template,
        special_tokens={k: t for k in _SPECIAL_TOKEN_KEYS if (t := token_text(k)) is not None},
    )


def _read_json(file: Path) -> dict:
    """A JSON object from ``file``; {} if the file does not exist."""
    if not file.exists():
        return {}
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{file} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{file} must hold a JSON object, got {type(data).__name__}")
    return data


def generation_config(source: str | Path | None = None) -> dict[str, object]:
    """Generation defaults from a checkpoint's ``generation_config.json`` ({} without one).

    Returns those of ``max_new_tokens``, ``repetition_penalty``, ``eos_token_id`` (an int or a
    list) and, only when the file sets ``"do_sample": true`` as transformers requires before it
    samples, ``temperature``, ``top_k`` and ``top_p``, that the file sets. Values that mean "off"
    in transformers (``top_k`` 0, ``top_p`` 1.0, ``repetition_penalty`` 1.0) are left out.
    ``kvcache generate`` uses these as its defaults; its flags win.
    """
    path = _resolve(source)
    file = path / "generation_config.json"
    raw = _read_json(file)

    def get(key: str, kinds: tuple[type, ...]):
        value = raw.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, kinds):
            raise CheckpointError(f"{file}: {key} must be {' or '.join(k.__name__ for k in kinds)}, got {value!r}")
        return value

    out: dict[str, object] = {}
    new = get("max_new_tokens", (int,))
    if new is not None:
        out["max_new_tokens"] = new
    penalty = get("repetition_penalty", (int, float))
    if penalty is not None and penalty != 1.0:
        out["repetition_penalty"] = float(penalty)
    eos = get("eos_token_id", (int, list))
    if eos is not None:
        if isinstance(eos, list) and not all(isinstance(t, int) and not isinstance(t, bool) for t in eos):
            raise CheckpointError(f"{file}: eos_token_id must be an int or a list of ints, got {eos!r}")
        out["eos_token_id"] = eos
    if raw.get("do_sample") is True:
        temperature = get("temperature", (int, float))
        top_k = get("top_k", (int,))
        top_p = get("top_p", (int, float))
        # Sampling without a temperature samples at 1.0; at 0 it is greedy, and filters do not apply.
        out["temperature"] = 1.0 if temperature is None else float(temperature)
        if top_k and out["temperature"] > 0:
            out["top_k"] = top_k
        if top_p is not None and top_p != 1.0 and out["temperature"] > 0:
            out["top_p"] = float(top_p)
    return out
