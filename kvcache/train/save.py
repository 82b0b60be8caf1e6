"""Writing a model as a Hugging Face checkpoint that ``kvcache.load`` and transformers both read:
``model.safetensors`` with the ``model.`` name prefix (``lm_head`` has none; a tied head is not
stored), ``config.json`` and the tokenizer files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..checkpoints import gguf
from ..checkpoints.convert import hf_config, write_tokenizer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json")
DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def read_config(source: str | Path) -> dict:
    """The ``config.json`` of checkpoint directory ``source`` as a dict (a GGUF file's, as
    ``kvcache convert`` writes it)."""
    if gguf.is_gguf(source):
        return hf_config(gguf.read(source, weights=False).config)
    return json.loads((Path(source) / "config.json").read_text())


def save_checkpoint(model: torch.nn.Module, out: str | Path, config: dict, *, source: str | Path | None = None,
                    dtype: torch.dtype | None = None) -> Path:
    """Write ``model`` (a ``kvcache.Transformer`` without adapters; merge LoRA first) to ``out``.

    config: the Hugging Face config to write (typically ``read_config(source)``); its dtype entry
    is set to the saved one. source: a checkpoint directory whose tokenizer files are copied, or a
    GGUF file whose tokenizer is written. dtype: the dtype of the stored weights (default: the model's).
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state = {}
    tied = model.config.tie_word_embeddings
    for name, tensor in model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        if any(part.startswith(("lora_", "base_layer")) for part in name.split(".")):
            raise ValueError(f"{name} belongs to an adapter: merge the LoRA weights before saving a full checkpoint")
        key = name if name.startswith("lm_head") else f"model.{name}"
        state[key] = tensor.detach().to("cpu", dtype or tensor.dtype).contiguous()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    saved = dtype or model.embed_tokens.weight.dtype
    config = dict(config)
    # transformers 5 writes "dtype", earlier versions "torch_dtype": keep the source's spelling.
    key = "dtype" if "dtype" in config else "torch_dtype"
    config[key] = DTYPE_NAMES.get(saved, str(saved).removeprefix("torch."))
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if source is not None and gguf.is_gguf(source):
        write_tokenizer(gguf.read(source, weights=False), out)
    elif source is not None:
        for name in TOKENIZER_FILES:
            if (Path(source) / name).exists():
                shutil.copy(Path(source) / name, out / name)
    return out
