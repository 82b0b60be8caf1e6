"""Loading Hugging Face-format checkpoints (safetensors, single file or sharded) and tokenizers."""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from .config import ModelConfig
from .errors import CheckpointError
from .model import Transformer

# Shipped with the package once the reference model exists; ``load()`` with no source uses it.
BUNDLED_MODEL = Path(__file__).parent / "reference_model"

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
    path = Path(source)
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a directory; pass a Hugging Face-format checkpoint directory")
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
        try:
            with safe_open(str(f), framework="pt") as handle:
                for name in handle.keys():
                    tensors[name] = handle.get_tensor(name)
        except Exception as e:  # safetensors raises several types for truncated or corrupt files
            raise CheckpointError(f"cannot read {f}: it is corrupt or truncated ({e})") from None
    return tensors


def load(
    source: str | Path | None = None,
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
) -> Transformer:
    """Load a model from a Hugging Face-format checkpoint directory.

    The directory needs ``config.json`` and ``model.safetensors`` (or a sharded
    ``model.safetensors.index.json``). ``dtype`` defaults to the checkpoint's, ``device`` to CPU.
    The model is returned in eval mode.
    """
    path = _resolve(source)
    cfg = ModelConfig.from_json(path / "config.json")
    tensors = _read_tensors(_weight_files(path))
    # Checkpoint names are the module names with a leading "model." (lm_head has none).
    state = {name.removeprefix("model."): t for name, t in tensors.items()}

    with torch.device("meta"):
        model = Transformer(cfg)
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
    unexpected = sorted(
        n for n in tensors
        if n.removeprefix("model.") not in expected and not n.endswith(_IGNORED_SUFFIXES)
        and not (cfg.tie_word_embeddings and n == "lm_head.weight")
    )
    if unexpected:
        warnings.warn(f"ignoring {len(unexpected)} unexpected tensors in {path}: {unexpected[:5]}", stacklevel=2)
    if dtype is None:
        dtype = state["embed_tokens.weight"].dtype
    device = torch.device(device) if device is not None else torch.device("cpu")
    model.load_state_dict(
        {n: state[n].to(device=device, dtype=dtype) for n in expected}, strict=False, assign=True
    )
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.reset_rope()
    return model.eval()


@dataclass
class Tokenizer:
    """A ``tokenizers`` tokenizer with the special tokens and chat template of its checkpoint."""

    backend: object
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    chat_template: str | None = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size()


def load_tokenizer(source: str | Path | None = None) -> Tokenizer:
    """Load ``tokenizer.json`` (and ``tokenizer_config.json`` if present) from a checkpoint directory."""
    from tokenizers import Tokenizer as Backend

    path = _resolve(source)
    file = path / "tokenizer.json"
    if not file.exists():
        raise CheckpointError(f"{path} has no tokenizer.json")
    try:
        backend = Backend.from_file(str(file))
    except Exception as e:
        raise CheckpointError(f"cannot read {file}: {e}") from None
    extra: dict = {}
    config_file = path / "tokenizer_config.json"
    if config_file.exists():
        try:
            extra = json.loads(config_file.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{config_file} is not valid JSON: {e}") from None

    def token_id(key: str) -> int | None:
        token = extra.get(key)
        if isinstance(token, dict):
            token = token.get("content")
        return backend.token_to_id(token) if isinstance(token, str) else None

    return Tokenizer(
        backend=backend,
        bos_token_id=token_id("bos_token"),
        eos_token_id=token_id("eos_token"),
        chat_template=extra.get("chat_template"),
    )
