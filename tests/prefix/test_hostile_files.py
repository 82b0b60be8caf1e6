"""Prompt stores and checkpoints crafted by someone else are refused with a clear error, before
anything large is allocated and without reading outside their directory.

Each case loads in a forked child whose address space is capped at its current size plus
``HEADROOM``: an attempt to allocate what a lying file claims (terabytes) would fail there with
an allocation error instead of the refusal the case expects. Where a file outside the directory
is named, that file is a valid one, so reading it would have loaded without error.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import resource
import shutil
from pathlib import Path

import pytest
import torch
from policy_util import build_tiny  # noqa: E402

import kvcache
from kvcache.generation.prefill import prefill
from kvcache.prefix import store as prefix_module
from kvcache.prefix.store import INDEX, PrefixStore

# A forked child cannot use CUDA once its parent has: the model and stores live on the CPU.
pytestmark = [pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork"),
              pytest.mark.cpu_only("loads each file in a forked child, which cannot use CUDA")]

VOCAB = 64
HEADROOM = 1 << 30
TB = 1 << 40


def _refusal(load) -> tuple[str, str]:
    """(exception type, message) of ``load()`` run in a child with capped memory; ("", "") if it loaded."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            with open("/proc/self/statm") as f:
                size = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
            resource.setrlimit(resource.RLIMIT_AS, (size + HEADROOM, resource.getrlimit(resource.RLIMIT_AS)[1]))
            try:
                load()
                out = ["", ""]
            except BaseException as e:  # noqa: BLE001 - reported to the parent, which judges it
                out = [type(e).__name__, str(e)]
            os.write(w, json.dumps(out).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        data = f.read()
    os.waitpid(pid, 0)
    return tuple(json.loads(data))


def _safetensors(header: dict, data: bytes, length: int | None = None) -> bytes:
    raw = json.dumps(header).encode()
    return (len(raw) if length is None else length).to_bytes(8, "little") + raw + data


def _split(blob: bytes) -> tuple[dict, bytes]:
    n = int.from_bytes(blob[:8], "little")
    return json.loads(blob[8 : 8 + n]), blob[8 + n :]


# ----- prompt stores ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny(tmp_path_factory.mktemp("hostile_model"), layers=2, vocab=VOCAB, device="cpu")


@pytest.fixture(scope="module")
def saved_store(model, tmp_path_factory) -> Path:
    store = PrefixStore(model)
    prompt = torch.randint(3, VOCAB, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    cache = kvcache.make_cache(model, "dense", cache_length=64)
    with torch.inference_mode():
        prefill(model, cache, [prompt], chunk=16, store=store)
    path = tmp_path_factory.mktemp("store")
    store.save(path)
    return path


def _replace_entry(path: Path, blob: bytes, nbytes: int | None = None) -> None:
    """Put ``blob`` in place of the first entry's file, named and hashed as save names files."""
    index = json.loads((path / INDEX).read_text())
    entry = next(e for e in index["entries"] if "file" in e)
    (path / entry["file"]).unlink()
    digest = hashlib.sha256(blob).hexdigest()
    entry.update(file=f"entry-{digest[:32]}.safetensors", sha256=digest)
    if nbytes is not None:
        entry["bytes"] = nbytes
    (path / entry["file"]).write_bytes(blob)
    (path / INDEX).write_text(json.dumps(index))


def _first_entry(path: Path) -> tuple[dict, dict]:
    index = json.loads((path / INDEX).read_text())
    return index, next(e for e in index["entries"] if "file" in e)


def _store_case(case: str, path: Path, outside: Path) -> None:
    """Make the store in ``path`` hostile in the way ``case`` names; ``outside`` is a directory
    beside it holding a valid copy of the store."""
    index, entry = _first_entry(path)
    blob = (path / entry["file"]).read_bytes()
    header, data = _split(blob)
    if case == "entry file named with ..":
        entry["file"] = f"../{outside.name}/{entry['file']}"
    elif case == "entry file named by an absolute path":
        entry["file"] = str(outside / entry["file"])
    elif case == "sha256 that spells a path":
        digest = ("/../" * 16)[:64]
        entry.update(sha256=digest, file=f"entry-{digest[:32]}.safetensors")
    elif case == "entry file a symlink out":
        (path / entry["file"]).unlink()
        (path / entry["file"]).symlink_to(outside / entry["file"])
    elif case == "index a symlink out":
        (path / INDEX).unlink()
        (path / INDEX).symlink_to(outside / INDEX)
        return
    elif case == "entry file a pipe":
        (path / entry["file"]).unlink()
        os.mkfifo(path / entry["file"])
    elif case == "entry file larger than its index says":
        return _replace_entry(path, blob + bytes(8 << 20))
    elif case == "index claims terabytes for an entry":
        entry["bytes"] = TB
    elif case == "header shape of terabytes":
        name = next(k for k in header if k != "__metadata__")
        header[name]["shape"] = [1 << 20, 1 << 20]
        header[name]["data_offsets"] = [0, 4 * TB]
        return _replace_entry(path, _safetensors({name: header[name]}, data), nbytes=4 * TB)
    elif case == "header dtype that does not exist":
        name = next(k for k in header if k != "__metadata__")
        header[name]["dtype"] = "F128"
        return _replace_entry(path, _safetensors(header, data))
    elif case == "header length of 2**62":
        return _replace_entry(path, _safetensors(header, data, length=1 << 62))
    elif case == "header offsets past the data":
        name = next(k for k in header if k != "__metadata__")
        a, b = header[name]["data_offsets"]
        header[name]["data_offsets"] = [a + len(data), b + len(data)]
        return _replace_entry(path, _safetensors(header, data))
    elif case == "truncated entry (sha256 updated)":
        return _replace_entry(path, blob[: len(blob) // 2])
    elif case == "index larger than the limit":
        (path / INDEX).write_text(json.dumps(index) + " " * 4096)
        return
    elif case == "index nested 10,000 deep":
        (path / INDEX).write_text("[" * 10_000 + "]" * 10_000)
        return
    elif case == "entry header nested 10,000 deep":
        header = ("[" * 10_000 + "]" * 10_000).encode()
        return _replace_entry(path, len(header).to_bytes(8, "little") + header)
    (path / INDEX).write_text(json.dumps(index))


STORE_CASES = {
    "entry file named with ..": "does not match its sha256",
    "entry file named by an absolute path": "does not match its sha256",
    "sha256 that spells a path": "malformed sha256",
    "entry file a symlink out": "is a symbolic link",
    "index a symlink out": "is a symbolic link",
    "entry file a pipe": "is not a regular file",
    "entry file larger than its index says": r"has \d+ bytes, more than the \d+ its index entry allows",
    "index claims terabytes for an entry": r"holds \d+ bytes of tensors; its index entry says 1099511627776",
    "header shape of terabytes": "byte ranges do not tile",
    "header dtype that does not exist": "unknown dtype 'F128'",
    "header length of 2**62": "header claims 4611686018427387904 bytes",
    "header offsets past the data": "byte ranges do not tile",
    "truncated entry (sha256 updated)": "header claims|do not tile",
    "index larger than the limit": r"has \d+ bytes, more than the 1024 a store index may have",
    "index nested 10,000 deep": "nested deeper than JSON decoding allows",
    "entry header nested 10,000 deep": "nested deeper than JSON decoding allows",
}


@pytest.mark.parametrize("case", list(STORE_CASES))
def test_hostile_store_is_refused(model, saved_store, tmp_path, monkeypatch, case):
    path, outside = tmp_path / "store", tmp_path / "outside"
    shutil.copytree(saved_store, path)
    shutil.copytree(saved_store, outside)
    assert len(PrefixStore.load(outside, model)) > 0  # what is outside would load
    _store_case(case, path, outside)
    if case == "index larger than the limit":
        monkeypatch.setattr(prefix_module, "MAX_INDEX_BYTES", 1024)
    kind, message = _refusal(lambda: PrefixStore.load(path, model))
    assert kind == "PrefixStoreError", (kind, message)
    assert str(path) in message
    assert re.search(STORE_CASES[case], message), message


# ----- checkpoints ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("hostile_ckpt")
    build_tiny(path, layers=2, vocab=VOCAB)
    return path


def _checkpoint_case(case: str, path: Path, outside: Path) -> None:
    weights = path / "model.safetensors"
    blob = weights.read_bytes()
    header, data = _split(blob)
    name = next(k for k in header if k != "__metadata__")
    if case in ("shard named with ..", "shard named by an absolute path", "shard in a subdirectory that climbs"):
        shard = {"shard named with ..": f"../{outside.name}/model.safetensors",
                 "shard named by an absolute path": str(outside / "model.safetensors"),
                 "shard in a subdirectory that climbs": f"sub/../../{outside.name}/model.safetensors"}[case]
        weights.unlink()
        (path / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": {k: shard for k in header if k != "__metadata__"}}))
    elif case == "weights a pipe":
        weights.unlink()
        os.mkfifo(weights)
    elif case == "header length of 2**62":
        weights.write_bytes(_safetensors(header, data, length=1 << 62))
    elif case == "header shape of terabytes":
        header[name]["shape"] = [1 << 20, 1 << 20]
        weights.write_bytes(_safetensors(header, data))
    elif case == "header offsets past the file":
        header[name]["data_offsets"] = [0, 4 * TB]
        weights.write_bytes(_safetensors(header, data))
    elif case == "header dtype that does not exist":
        header[name]["dtype"] = "F128"
        weights.write_bytes(_safetensors(header, data))
    elif case == "truncated weights":
        weights.write_bytes(blob[: len(blob) // 2])
    elif case == "config claims 10**8 layers":
        config = json.loads((path / "config.json").read_text())
        config["num_hidden_layers"] = 10**8
        (path / "config.json").write_text(json.dumps(config))
    elif case == "config claims a hidden size of 2**40":
        config = json.loads((path / "config.json").read_text())
        config.update(hidden_size=1 << 40, intermediate_size=1 << 40)
        (path / "config.json").write_text(json.dumps(config))


CHECKPOINT_CASES = {
    "shard named with ..": "not a file name inside",
    "shard named by an absolute path": "not a file name inside",
    "shard in a subdirectory that climbs": "not a file name inside",
    "weights a pipe": "is not a regular file",
    "header length of 2**62": "corrupt or truncated",
    "header shape of terabytes": "corrupt or truncated",
    "header offsets past the file": "corrupt or truncated",
    "header dtype that does not exist": "corrupt or truncated",
    "truncated weights": "corrupt or truncated",
    "config claims 10**8 layers": "num_hidden_layers=100000000, but the checkpoint holds tensors of 2 layers",
    "config claims a hidden size of 2**40": "has shape .* but config.json implies",
}


@pytest.mark.parametrize("case", list(CHECKPOINT_CASES))
def test_hostile_checkpoint_is_refused(checkpoint, tmp_path, case):
    path, outside = tmp_path / "ckpt", tmp_path / "outside"
    shutil.copytree(checkpoint, path)
    shutil.copytree(checkpoint, outside)
    kvcache.load(outside)  # what is outside would load
    _checkpoint_case(case, path, outside)
    kind, message = _refusal(lambda: kvcache.load(path))
    assert kind == "CheckpointError", (kind, message)
    assert re.search(CHECKPOINT_CASES[case], message), message
