"""The prefix store: the cache state of token prefixes, reused across the rows of a batch and
across calls (``generate(..., prefix_store=store)``), saved to and loaded from a directory.

Entries live in a radix tree over token ids: each node holds the tokens from its parent's end to
its own, and a path from the root spells a prefix. What a node holds depends on the cache:

* a dense cache (``slots``): the storage slots of its tokens, per layer. A dense cache's slot p
  holds position p whatever came after it, so any prefix of a stored path is reusable, down to
  one token, and prefixes that share tokens share their nodes. (A storage that is not laid out
  per slot, KIVI's, is kept as snapshots like the evicting caches.)
* any other cache (``snapshots``): a snapshot of one row's whole state after exactly the path's
  tokens. What an evicting cache holds depends on everything it saw, so only the exact stored
  boundaries are reusable. A policy that depends on how a prompt is chunked (h2o, tova, snapkv,
  knorm, expected_attention) is stored at multiples of ``prefill_chunk`` only, where a run
  without the store has the same state; a chunking-invariant one (window, sink) at any boundary.

With ``aligned=True`` every entry sits on the prefill grid and was computed by grid chunks, so a
run that reuses one executes the same calls as a run without the store (docs/prefix.md).

A store belongs to one model (checked by a fingerprint of its config and weights) and to one
cache configuration, fixed by its first use (``binding``); a call with another raises ValueError.
Its size is bounded by ``max_bytes`` of stored tensors, evicting the least recently used
entries: a dense node only once nothing extends it, a snapshot at any time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import math
import os
import re
import stat
import time
import warnings
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from ..cache.base import KVCache
from ..cache.snapshot import Snapshot
from ..cache.snapshot import check as check_snapshot
from ..errors import KVCacheError, KVCacheWarning
from ..runtime import devices

DEFAULT_MAX_BYTES = 1 << 30
FORMAT = "kvcache-prefix-store"
VERSION = 1
INDEX = "index.json"
ENTRY_PREFIX = "entry-"
# Held while a store directory is written (exclusively) or read (shared), see ``_locked``.
LOCK = ".lock"
LOCK_TIMEOUT = 60.0
# Sizes a store of someone else's making may not exceed before anything is allocated for it.
MAX_INDEX_BYTES = 256 << 20
MAX_HEADER_BYTES = 1 << 20
SHA256 = re.compile(r"[0-9a-f]{64}")
# Elements sampled from each weight tensor for the model fingerprint: enough to tell checkpoints
# apart, cheap even for billions of parameters.
FINGERPRINT_SAMPLES = 4096


class PrefixStoreError(KVCacheError):
    """A saved prefix store cannot be used: missing, corrupt, truncated, or made for another model."""


def model_fingerprint(model: torch.nn.Module) -> dict[str, str]:
    """sha256 of the model's config, and of its weights' names, shapes and a strided sample of
    their values (in float64, so a checkpoint loaded at another dtype keeps its fingerprint; the
    cache dtype is part of a store's binding)."""
    config = json.dumps(dataclasses.asdict(model.config), sort_keys=True, default=str)
    weights = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        flat = t.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // FINGERPRINT_SAMPLES)][:FINGERPRINT_SAMPLES]
        weights.update(f"{name}{tuple(t.shape)};".encode())
        weights.update(sample.to(device="cpu", dtype=torch.float64).numpy().tobytes())
    return {"config_sha256": hashlib.sha256(config.encode()).hexdigest(), "weights_sha256": weights.hexdigest()}


@dataclass(frozen=True)
class Binding:
    """The cache configuration a store's entries were made for.

    policy:  the cache's name as given (``h2o``, ``h2o:full``; the layers' configs decide).
    layers:  each layer's ``config()`` (without ``cache_length`` for a dense cache, whose slots do
             not depend on it).
    mode:    ``"slots"`` (dense) or ``"snapshots"``.
    grid:    entries sit at multiples of this many tokens (None: at any boundary).
    aligned: entries were computed by ``aligned=True`` runs (each prompt alone, on the grid).
    """

    policy: str = dataclasses.field(compare=False)
    layers: tuple
    mode: str
    grid: int | None
    aligned: bool

    @classmethod
    def of(cls, cache: KVCache, chunk: int | None, aligned: bool) -> Binding:
        """The binding of ``cache`` prefilled in chunks of ``chunk``; ValueError if it cannot be stored."""
        slots = all(not layer.evicts and layer.shares_prefixes() for layer in cache.layers)
        layers = tuple(
            json.dumps({k: v for k, v in layer.config().items() if not (slots and k == "cache_length")}, sort_keys=True)
            for layer in cache.layers
        )
        if aligned:
            if chunk is None:
                raise ValueError("aligned=True prefills on a grid of prefill_chunk tokens: give a prefill_chunk")
            grid = chunk
        elif slots or cache.chunking_invariant:
            grid = None
        else:
            if chunk is None:
                raise ValueError(
                    f"the {cache.policy} cache depends on how a prompt is chunked, so the prefix store keeps it "
                    "at multiples of prefill_chunk only: give a prefill_chunk"
                )
            grid = chunk
        return cls(cache.policy, layers, "slots" if slots else "snapshots", grid, aligned)

    def describe(self) -> str:
        layer = json.loads(self.layers[0])
        name = layer["policy"] + ("" if layer["storage"] == "full" else f":{layer['storage']}")
        options = ", ".join(f"{k}={v}" for k, v in layer.get("options", {}).items())
        size = f", cache_length={layer['cache_length']}" if "cache_length" in layer else ""
        grid = f", on a {self.grid}-token grid" if self.grid else ""
        return (f"{name} caches ({layer['dtype']}{size}{', ' + options if options else ''}{grid}"
                f"{', aligned' if self.aligned else ''})")

    def to_json(self) -> dict:
        return {"policy": self.policy, "layers": [json.loads(c) for c in self.layers], "mode": self.mode,
                "grid": self.grid, "aligned": self.aligned}

    @classmethod
    def from_json(cls, data: object) -> Binding:
        if not isinstance(data, dict) or set(data) != {"policy", "layers", "mode", "grid", "aligned"}:
            raise ValueError(f"binding must be an object with policy, layers, mode, grid, aligned; got {data!r}")
        grid, layers = data["grid"], data["layers"]
        if (not isinstance(data["policy"], str) or data["mode"] not in ("slots", "snapshots")
                or not isinstance(layers, list) or not all(isinstance(c, dict) for c in layers)
                or not (grid is None or (isinstance(grid, int) and grid > 0)) or not isinstance(data["aligned"], bool)):
            raise ValueError(f"malformed binding {data!r}")
        return cls(data["policy"], tuple(json.dumps(c, sort_keys=True) for c in layers), data["mode"], grid,
                   data["aligned"])

    def layer_configs(self) -> list[dict]:
        return [json.loads(c) for c in self.layers]


class _Node:
    """A radix-tree node: ``tokens`` from its parent's end to its own end (``depth`` tokens from
    the root), and a payload: ``slots`` (dense; ``layer{i}.{name}`` -> (1, Hkv, len(tokens), ...))
    or ``snapshot`` (one row's state after the path's tokens), or none (an inner node)."""

    def __init__(self, tokens: tuple[int, ...], parent: _Node | None, node_id: int) -> None:
        self.tokens = tokens
        self.parent = parent
        self.depth = (parent.depth if parent is not None else 0) + len(tokens)
        self.children: dict[int, _Node] = {}
        self.slots: dict[str, torch.Tensor] | None = None
        self.snapshot: Snapshot | None = None
        self.used = 0
        self.id = node_id
        self.digest: str | None = None  # sha256 of the payload's saved file, once saved or loaded

    @property
    def nbytes(self) -> int:
        if self.slots is not None:
            return sum(t.numel() * t.element_size() for t in self.slots.values())
        return 0 if self.snapshot is None else self.snapshot.nbytes()

    @property
    def has_payload(self) -> bool:
        return self.slots is not None or self.snapshot is not None

    def payload_tensors(self) -> dict[str, torch.Tensor]:
        return dict(self.slots) if self.slots is not None else self.snapshot.tensors()


class PrefixStore:
    """Cache states of token prefixes for one model, bounded by ``max_bytes`` (LRU).

    ``store = kvcache.PrefixStore(model, max_bytes=2**30)`` then ``kvcache.generate(model, prompts,
    ..., prefix_store=store)``: each row takes the longest stored prefix of its prompt (never its
    last token, whose logits start the generation), prefills the rest and stores what it
    computed. ``store.save(dir)`` and ``PrefixStore.load(dir, model)`` keep it across processes.
    ``device``: where entries are kept (default: the model's).
    """

    def __init__(self, model: torch.nn.Module, max_bytes: int = DEFAULT_MAX_BYTES, *,
                 device: str | torch.device | None = None) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
            raise ValueError(f"max_bytes must be a positive int (bytes of stored tensors), got {max_bytes!r}")
        self.max_bytes = max_bytes
        self.device = devices.canonical(device) if device is not None else model.embed_tokens.weight.device
        self.model_id = model_fingerprint(model)
        self._model = weakref.ref(model)
        self._vocab = model.config.vocab_size
        self.binding: Binding | None = None
        self._root = _Node((), None, 0)
        self._ids = itertools.count(1)
        self._clock = 0
        self._nbytes = 0
        self._checked = True  # whether entries are known to fit the binding's caches (False after load)
        self._warned: set[str] = set()

    # ----- inspection ------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Bytes of the stored tensors (what ``max_bytes`` bounds)."""
        return self._nbytes

    def __len__(self) -> int:
        """Entries held (dense nodes and snapshots)."""
        return sum(1 for node in self._nodes() if node.has_payload)

    def __repr__(self) -> str:
        bound = self.binding.describe() if self.binding else "unbound"
        return f"PrefixStore({bound}, entries={len(self)}, nbytes={self.nbytes}, max_bytes={self.max_bytes})"

    def reusable(self, tokens: Sequence[int]) -> int:
        """How many leading tokens of the prompt ``tokens`` a call would take from the store now
        (at most all but the last; 0 before the store's first use)."""
        return self._find(list(tokens), len(tokens) - 1)[0] if self.binding is not None else 0

    def boundary(self, n: int) -> int:
        """The longest prefix of ``n`` prompt tokens that a prefill leaves in the store: all of
        them, or the last grid boundary for a store whose entries sit on the grid."""
        grid = self.binding.grid
        return n if grid is None else n // grid * grid

    def clear(self) -> None:
        """Drop every entry (the binding stays)."""
        self._root = _Node((), None, 0)
        self._nbytes = 0

    # ----- use by prefill and generate -------------------------------------------------------
    def bind(self, model: torch.nn.Module, cache: KVCache, *, chunk: int | None, aligned: bool) -> None:
        """Check that ``model`` and ``cache`` (prefilled in chunks of ``chunk``) can use this store,
        and fix its binding on first use. Raises ValueError naming what differs; changes nothing then."""
        if self._model() is not model:
            if model_fingerprint(model) != self.model_id:
                raise ValueError("this prefix store was made for another model (its config or weights differ); "
                                 "make a store for this model")
            self._model = weakref.ref(model)
        binding = Binding.of(cache, chunk, aligned)
        if self.binding is not None and binding != self.binding:
            raise ValueError(
                f"this prefix store holds {self.binding.describe()}, but this call uses {binding.describe()}"
                f"{_difference(self.binding, binding)}: a store serves one cache configuration"
            )
        if not self._checked:
            self._check_entries(cache, binding)
        self.binding = binding
        self._checked = True

    def restore(self, cache: KVCache, row: int, tokens: Sequence[int]) -> int:
        """Put the longest stored prefix of ``tokens`` (short of its last token) into row ``row``
        of ``cache``, which is empty; returns its length. Call ``bind`` first."""
        n, path = self._find(tokens, len(tokens) - 1)
        if n == 0:
            return 0
        self._touch(path)
        if self.binding.mode == "snapshots":
            cache.restore(path[-1].snapshot, rows=[row])
            return n
        parts: list[dict[str, torch.Tensor]] = [{} for _ in cache.layers]
        pieces, left = [], n
        for node in path:
            take = min(left, len(node.tokens))
            pieces.append({k: t[:, :, :take] for k, t in node.slots.items()})
            left -= take
        for key in pieces[0]:
            layer, _, name = key.partition(".")
            parts[int(layer.removeprefix("layer"))][name] = torch.cat([p[key] for p in pieces], dim=2)
        cache.allocate(n)  # a dense cache's slots for the prefix, checked against the memory available
        for layer, part in zip(cache.layers, parts):
            layer.write_slots(row, part)
        cache.lengths[row] = n
        return n

    def add(self, cache: KVCache, row: int, tokens: Sequence[int], *, on_grid: bool) -> None:
        """Row ``row`` of ``cache`` holds the state after exactly ``tokens``: keep what the binding
        allows. ``on_grid``: the tokens were fed by prefill chunks on the grid (multiples of the
        chunk from position 0), not by decode steps."""
        b, n = self.binding, len(tokens)
        if b.mode == "slots":
            stop = n if not b.aligned else (n // b.grid * b.grid if on_grid else 0)
            if stop:
                self._add_slots(cache, row, tuple(tokens[:stop]))
        elif b.grid is None or (on_grid and n % b.grid == 0):
            self._add_snapshot(cache, row, tuple(tokens))

    # ----- the tree ---------------------------------------------------------------------------
    def _nodes(self):
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _walk(self, tokens: Sequence[int], limit: int) -> list[tuple[_Node, int]]:
        """Nodes along ``tokens[:limit]``, each with how many of its tokens match (all of them
        but possibly in the last node)."""
        path, node, i = [], self._root, 0
        while i < limit:
            child = node.children.get(tokens[i])
            if child is None:
                break
            n = min(len(child.tokens), limit - i)
            k = n if child.tokens[:n] == tuple(tokens[i : i + n]) else _common(child.tokens, tokens, i, n)
            path.append((child, k))
            i += k
            if k < len(child.tokens):
                break
            node = child
        return path

    def _find(self, tokens: Sequence[int], limit: int) -> tuple[int, list[_Node]]:
        """The longest reusable prefix of ``tokens`` no longer than ``limit``: its length and the
        nodes it uses (dense: every node of the path; snapshots: the path to the one reused)."""
        path = self._walk(tokens, max(limit, 0))
        if self.binding.mode == "slots":
            n = sum(k for _, k in path)
            if self.binding.grid is not None:
                n = n // self.binding.grid * self.binding.grid
            used, depth = [], 0
            for node, _ in path:
                if depth >= n:
                    break
                used.append(node)
                depth += len(node.tokens)
            return n, used
        full = [node for node, k in path if k == len(node.tokens)]
        while full and full[-1].snapshot is None:
            full.pop()
        return (full[-1].depth, full) if full else (0, [])

    def _touch(self, nodes: list[_Node]) -> None:
        self._clock += 1
        for node in nodes:
            node.used = self._clock

    def _descend(self, tokens: tuple[int, ...]) -> tuple[_Node, int]:
        """Follow ``tokens`` as far as stored, splitting a node where they part: returns the
        deepest node on the path (whose end is at the returned depth) and that depth."""
        path = self._walk(tokens, len(tokens))
        node, depth = self._root, 0
        for child, k in path:
            if k < len(child.tokens):
                child = self._split(child, k)
            node, depth = child, depth + k
        self._touch([n for n, _ in path])
        return node, depth

    def _split(self, node: _Node, k: int) -> _Node:
        """Cut ``node`` after its first k tokens; returns the new upper part."""
        upper = _Node(node.tokens[:k], node.parent, next(self._ids))
        upper.used = node.used
        node.parent.children[node.tokens[0]] = upper
        if node.slots is not None:
            # Copies, so that neither part keeps the other's memory alive.
            upper.slots = {key: t[:, :, :k].clone() for key, t in node.slots.items()}
            node.slots = {key: t[:, :, k:].clone() for key, t in node.slots.items()}
        node.tokens, node.parent = node.tokens[k:], upper
        node.id, node.digest = next(self._ids), None
        upper.children[node.tokens[0]] = node
        return upper

    def _attach(self, parent: _Node, tokens: tuple[int, ...]) -> _Node:
        node = _Node(tokens, parent, next(self._ids))
        parent.children[tokens[0]] = node
        return node

    def _add_slots(self, cache: KVCache, row: int, tokens: tuple[int, ...]) -> None:
        node, depth = self._descend(tokens)
        if depth == len(tokens):
            return
        per_token = self._slot_bytes(cache)
        pinned, up = 0, node
        while up is not None:
            pinned += up.nbytes
            up = up.parent
        fit = min(len(tokens) - depth, (self.max_bytes - pinned) // per_token)
        if fit < len(tokens) - depth:
            self._warn("slots", f"prefix store: max_bytes={self.max_bytes} holds {max(fit, 0)} of the "
                                f"{len(tokens) - depth} new tokens ({per_token} bytes each) of a prompt; "
                                "the rest is not stored. Raise max_bytes to keep whole prompts.")
        if fit <= 0:
            return
        leaf = self._attach(node, tokens[depth : depth + fit])
        slots = {}
        for i, layer in enumerate(cache.layers):
            for name, t in layer.read_slots(row, depth, depth + fit).items():
                slots[f"layer{i}.{name}"] = t.to(self.device)
        leaf.slots = slots
        self._grew(leaf)

    def _add_snapshot(self, cache: KVCache, row: int, tokens: tuple[int, ...]) -> None:
        path = self._walk(tokens, len(tokens))
        if path and sum(k for _, k in path) == len(tokens) and path[-1][1] == len(path[-1][0].tokens) \
                and path[-1][0].snapshot is not None:
            self._touch([path[-1][0]])  # already stored (the same state)
            return
        snapshot = _to_device(cache.snapshot(rows=[row]), self.device)
        if snapshot.nbytes() > self.max_bytes:
            self._warn("snapshot", f"prefix store: a cache snapshot takes {snapshot.nbytes()} bytes, more than "
                                   f"max_bytes={self.max_bytes}; nothing is stored. Raise max_bytes.")
            return
        node, depth = self._descend(tokens)
        if depth < len(tokens):
            node = self._attach(node, tokens[depth:])
        node.snapshot = snapshot
        self._grew(node)

    def _slot_bytes(self, cache: KVCache) -> int:
        """Bytes one token takes in a dense entry."""
        total = 0
        for layer in cache.layers:
            for t in layer.read_slots(0, 0, 0).values():
                total += t.shape[1] * math.prod(t.shape[3:]) * t.element_size()
        return total

    def _grew(self, node: _Node) -> None:
        """Account for ``node``'s new payload and evict least recently used entries beyond max_bytes."""
        self._touch([node])
        self._nbytes += node.nbytes
        while self._nbytes > self.max_bytes:
            victims = [n for n in self._nodes() if n is not node and _evictable(n)]
            if not victims:
                break
            self._drop(min(victims, key=lambda n: n.used))

    def _drop(self, node: _Node) -> None:
        self._nbytes -= node.nbytes
        node.slots, node.snapshot, node.digest = None, None, None
        while node is not self._root and not node.has_payload and not node.children:
            del node.parent.children[node.tokens[0]]
            node = node.parent

    def _warn(self, kind: str, message: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            warnings.warn(message, KVCacheWarning, stacklevel=4)

    def _check_entries(self, cache: KVCache, binding: Binding) -> None:
        """Every loaded entry against ``cache``'s layout, before any is used (ValueError)."""
        probe = {}
        if binding.mode == "slots":
            for i, layer in enumerate(cache.layers):
                probe.update({f"layer{i}.{name}": t for name, t in layer.read_slots(0, 0, 0).items()})
        for node in self._nodes():
            if node.slots is not None:
                if set(node.slots) != set(probe):
                    raise ValueError(f"the prefix store's entries hold {sorted(node.slots)[:4]}..., not this "
                                     f"cache's slots {sorted(probe)[:4]}...")
                for key, t in node.slots.items():
                    want = (1, probe[key].shape[1], len(node.tokens), *probe[key].shape[3:])
                    if t.dtype != probe[key].dtype or tuple(t.shape) != want:
                        raise ValueError(f"the prefix store's {key} is {t.dtype} {tuple(t.shape)}; this cache "
                                         f"needs {probe[key].dtype} {want}")
            elif node.snapshot is not None:
                check_snapshot(cache, node.snapshot, torch.tensor([0]))

    # ----- saving and loading -----------------------------------------------------------------
    def save(self, path: str | Path, *, timeout: float = LOCK_TIMEOUT) -> None:
        """Write the store to directory ``path``: ``index.json`` (the model's fingerprint, the
        binding, the tree) and one safetensors file per entry, named by its content's sha256, so a
        save rewrites only new entries.

        Crash-safe: every file is written under a temporary name, flushed to disk and renamed into
        place; the index is replaced last, so a process killed at any point leaves the old store
        or the new one, never a mix. Entry files the new index no longer names are removed only
        after it is in place. One writer at a time: the directory is locked (``.lock``) while it
        is written, and a second writer waits up to ``timeout`` seconds, then raises
        PrefixStoreError."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        with _locked(path, exclusive=True, timeout=timeout):
            self._save(path)

    def _save(self, path: Path) -> None:
        # Temporary files of a writer that died mid-save (the lock is ours: no one else writes).
        for pattern in (f".{ENTRY_PREFIX}*.tmp", f".{INDEX}.*.tmp"):
            for stale in path.glob(pattern):
                stale.unlink(missing_ok=True)
        old = _existing_files(path)
        entries = []
        for node in self._ordered():
            entry = {"id": node.id, "parent": node.parent.id if node.parent is not self._root else None,
                     "tokens": list(node.tokens), "used": node.used}
            if node.has_payload:
                if node.digest is None or _file_name(node.digest) not in old:
                    data = save_safetensors({k: t.detach().to("cpu").contiguous()
                                             for k, t in node.payload_tensors().items()})
                    node.digest = hashlib.sha256(data).hexdigest()
                    _write_atomic(path / _file_name(node.digest), data)
                entry.update(file=_file_name(node.digest), sha256=node.digest, bytes=node.nbytes)
            entries.append(entry)
        index = {"format": FORMAT, "version": VERSION, "model": self.model_id,
                 "binding": None if self.binding is None else self.binding.to_json(),
                 "clock": self._clock, "entries": entries}
        _write_atomic(path / INDEX, (json.dumps(index) + "\n").encode())
        kept = {e["file"] for e in entries if "file" in e}
        for name in old - kept:
            (path / name).unlink(missing_ok=True)
        _sync_dir(path)

    def _ordered(self):
        """Nodes with every parent before its children."""
        queue = list(self._root.children.values())
        for node in queue:
            yield node
            queue.extend(node.children.values())

    @classmethod
    def load(cls, path: str | Path, model: torch.nn.Module, max_bytes: int = DEFAULT_MAX_BYTES, *,
             device: str | torch.device | None = None, timeout: float = LOCK_TIMEOUT) -> PrefixStore:
        """A store saved by ``save`` into ``path``, for ``model``. Raises PrefixStoreError if the
        directory holds no store, if the store was made for another model, or if any file is
        missing, corrupt or truncated (every file is checked against its sha256 first): either the
        whole store loads or nothing does. Entries beyond ``max_bytes`` are dropped, least
        recently used first, with a warning.

        The store may come from someone else: only regular files directly inside ``path`` named
        as ``save`` names them are read (no symlinks, nothing outside), each no larger than its
        index entry says, and every safetensors header is checked before its data is read. A
        writer's lock is waited for (up to ``timeout`` seconds), so a store being saved is read
        whole, before or after."""
        store = cls(model, max_bytes, device=device)
        path = Path(path)
        if not (path / INDEX).is_file():
            raise PrefixStoreError(f"{path} holds no prefix store (no {INDEX})")
        with _locked(path, exclusive=False, timeout=timeout):
            store._load(path)
        dropped = len([n for n in store._nodes() if n.has_payload])
        while store._nbytes > store.max_bytes:
            store._drop(min((n for n in store._nodes() if _evictable(n)), key=lambda n: n.used))
        dropped -= len(store)
        if dropped:
            warnings.warn(f"prefix store {path}: {dropped} least recently used entries do not fit "
                          f"max_bytes={max_bytes} and were left out", KVCacheWarning, stacklevel=2)
        return store

    def _load(self, path: Path) -> None:
        store, index_file = self, path / INDEX
        try:
            index = _json(_read_inside(path, INDEX, MAX_INDEX_BYTES, "a store index may have").decode())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, ValueError) as e:
            raise PrefixStoreError(f"{index_file} is not a readable prefix-store index ({e}); delete {path} "
                                   "to start a new store") from None
        if not isinstance(index, dict) or index.get("format") != FORMAT:
            raise PrefixStoreError(f"{index_file} is not a kvcache prefix-store index")
        if index.get("version") != VERSION:
            raise PrefixStoreError(f"{index_file} has format version {index.get('version')!r}; this kvcache "
                                   f"reads version {VERSION}")
        if index.get("model") != store.model_id:
            raise PrefixStoreError(
                f"the prefix store in {path} was saved for another model (its config or weights differ from "
                "this one's); use another directory for this model, or delete this one"
            )
        try:
            store._read(path, index)
        except (ValueError, KeyError, TypeError) as e:
            raise PrefixStoreError(f"the prefix store in {path} is corrupt: {e}") from None

    def _read(self, path: Path, index: dict) -> None:
        """Fill this (empty) store from a parsed index, checking every entry and file."""
        binding = index["binding"]
        self.binding = None if binding is None else Binding.from_json(binding)
        entries = index["entries"]
        if not isinstance(entries, list) or (entries and self.binding is None):
            raise ValueError("entries must be a list, and a store with entries needs a binding")
        if self.binding is not None and len(self.binding.layers) != self._num_layers():
            raise ValueError(f"its binding has {len(self.binding.layers)} layers; the model has {self._num_layers()}")
        nodes = {None: self._root}
        for e in entries:
            node = self._read_entry(path, e, nodes)
            nodes[e["id"]] = node
        clock = index["clock"]
        if not isinstance(clock, int):
            raise ValueError(f"clock must be an int, got {clock!r}")
        self._clock = clock
        self._ids = itertools.count(max((k for k in nodes if k is not None), default=0) + 1)
        self._checked = False

    def _read_entry(self, path: Path, e: object, nodes: dict) -> _Node:
        if not isinstance(e, dict):
            raise ValueError(f"an entry must be an object, got {e!r}")
        node_id, parent_id, tokens, used = e["id"], e["parent"], e["tokens"], e["used"]
        if not isinstance(node_id, int) or node_id in nodes or parent_id not in nodes:
            raise ValueError(f"entry id {node_id!r} is repeated, or its parent {parent_id!r} comes later or not at all")
        if (not isinstance(tokens, list) or not tokens
                or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self._vocab for t in tokens)):
            raise ValueError(f"entry {node_id}: tokens must be a non-empty list of ids in [0, {self._vocab})")
        parent = nodes[parent_id]
        if tokens[0] in parent.children:
            raise ValueError(f"entry {node_id} starts with the same token as a sibling")
        node = _Node(tuple(tokens), parent, node_id)
        node.used = used if isinstance(used, int) else 0
        if "file" in e:
            tensors, node.digest = self._read_file(path, e)
            if self.binding.mode == "slots":
                if any(t.dim() < 3 or t.shape[0] != 1 or t.shape[2] != len(tokens) for t in tensors.values()):
                    raise ValueError(f"{e['file']}: slot tensors must be (1, Hkv, {len(tokens)}, ...)")
                node.slots = {k: t.to(self.device) for k, t in tensors.items()}
            else:
                snapshot = Snapshot.from_tensors(self.binding.policy, self.binding.layer_configs(), tensors)
                if snapshot.lengths.tolist() != [node.depth]:
                    raise ValueError(f"{e['file']}: a snapshot after {node.depth} tokens records lengths "
                                     f"{snapshot.lengths.tolist()}")
                node.snapshot = _to_device(snapshot, self.device)
            if node.nbytes != e["bytes"]:
                raise ValueError(f"{e['file']} holds {node.nbytes} bytes of entries; its index entry says {e['bytes']}")
        parent.children[tokens[0]] = node
        self._nbytes += node.nbytes
        return node

    @staticmethod
    def _read_file(path: Path, e: dict) -> tuple[dict[str, torch.Tensor], str]:
        name, digest, nbytes = e["file"], e["sha256"], e["bytes"]
        if not isinstance(name, str) or name != _file_name(digest):
            raise ValueError(f"entry {e['id']}: file {name!r} does not match its sha256")
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"entry {e['id']}: bytes must be a non-negative int, got {nbytes!r}")
        try:
            # A snapshot's file also holds its lengths (one long), which nbytes does not count.
            data = _read_inside(path, name, 8 + MAX_HEADER_BYTES + nbytes + 8, "its index entry allows")
        except OSError as err:
            raise ValueError(f"cannot read {name}: {err.strerror or err}") from None
        if hashlib.sha256(data).hexdigest() != digest:
            raise ValueError(f"{name} is truncated or damaged (its sha256 differs from the index's)")
        _check_safetensors(name, data, nbytes)
        try:
            return load_safetensors(data), digest
        except (SafetensorError, ValueError, RuntimeError) as err:
            raise ValueError(f"{name} is not a readable safetensors file ({err})") from None

    def _num_layers(self) -> int:
        model = self._model()
        return model.config.num_layers


def _common(stored: tuple[int, ...], tokens: Sequence[int], start: int, n: int) -> int:
    """How many of ``stored[:n]`` equal ``tokens[start:start + n]``."""
    k = 0
    while k < n and stored[k] == tokens[start + k]:
        k += 1
    return k


def _evictable(node: _Node) -> bool:
    # A dense node is the start of every path below it; a snapshot stands alone.
    return node.snapshot is not None or (node.slots is not None and not node.children)


def _difference(old: Binding, new: Binding) -> str:
    if json.loads(old.layers[0])["policy"] != json.loads(new.layers[0])["policy"]:
        return ""
    if (old.grid, old.aligned) != (new.grid, new.aligned):
        return f" (grid {old.grid} vs {new.grid}, aligned {old.aligned} vs {new.aligned})"
    for i, (a, b) in enumerate(zip(old.layer_configs(), new.layer_configs())):
        keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
        if keys:
            return f" (layer {i}: " + "; ".join(f"{k} {a.get(k)!r} vs {b.get(k)!r}" for k in keys) + ")"
    return ""


def _to_device(snapshot: Snapshot, device: torch.device) -> Snapshot:
    if all(t.device == device for s in snapshot.states for t in s.values()):
        return snapshot
    return Snapshot(snapshot.policy, snapshot.layers, snapshot.lengths,
                    tuple({k: t.to(device) for k, t in s.items()} for s in snapshot.states))


def _file_name(digest: object) -> str:
    # Lowercase hex only: the name is built from it, so it can name nothing but a file here.
    if not isinstance(digest, str) or not SHA256.fullmatch(digest):
        raise ValueError(f"malformed sha256 {digest!r}")
    return f"{ENTRY_PREFIX}{digest[:32]}.safetensors"


def _existing_files(path: Path) -> set[str]:
    return {p.name for p in path.glob(f"{ENTRY_PREFIX}*.safetensors")}


def _write_atomic(target: Path, data: bytes) -> None:
    """Write ``data`` to ``target`` so that ``target`` is never seen half written, even after a
    crash or a power loss: a temporary file, flushed to disk, renamed over it, the rename flushed."""
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, target)
    _sync_dir(target.parent)


def _sync_dir(path: Path) -> None:
    """Flush a directory's entries (renames, removals) to disk, where the platform can."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def _locked(path: Path, *, exclusive: bool, timeout: float):
    """Hold ``path/.lock``: exclusively to write the store, shared to read it. Waits up to
    ``timeout`` seconds for another process's lock, then raises PrefixStoreError. The lock
    is the kernel's (``flock``): a process that dies releases it. Without ``fcntl`` (Windows),
    or where the lock file cannot be opened (a read-only store), nothing is locked."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    try:
        fd = os.open(path / LOCK, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
    except OSError:
        if exclusive:
            raise
        yield
        return
    try:
        mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, mode | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise PrefixStoreError(
                        f"another process is {'using' if exclusive else 'writing'} the prefix store in {path} "
                        f"(it holds {path / LOCK}); waited {timeout:g} s. Wait for it to finish, or save to "
                        "another directory") from None
                time.sleep(0.02)
        yield
    finally:
        os.close(fd)  # releases the lock


def _read_inside(path: Path, name: str, limit: int, why: str) -> bytes:
    """The bytes of the regular file ``name`` directly inside ``path``, refusing a symlink, a
    device or a pipe, and a file larger than ``limit`` bytes, before reading any of it."""
    if name != os.path.basename(name) or name in ("", ".", ".."):
        raise ValueError(f"{name!r} is not a file name inside the store")
    if (path / name).is_symlink():
        raise ValueError(f"{name} is a symbolic link; a store's files must be regular files inside it")
    # No symlink followed even if one appears now; a pipe opened without blocking on a writer.
    fd = os.open(path / name, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{name} is not a regular file")
        if info.st_size > limit:
            raise ValueError(f"{name} has {info.st_size} bytes, more than the {limit} {why}")
        return f.read(info.st_size)  # a buffer of the file's size, never of the limit


def _json(text: str | bytes) -> object:
    """``json.loads`` of a file's text, refusing nesting of any depth with ValueError (the decoder
    recurses once per level: a few thousand levels raise RecursionError, which a caller that
    maps ValueError to a clear error would let through)."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("it is nested deeper than JSON decoding allows") from None


def _check_safetensors(name: str, data: bytes, nbytes: int) -> None:
    """Check a safetensors file's header against its size and the entry's ``nbytes`` before
    safetensors reads it: a header length within the file, known dtypes, and every tensor's
    shape times its element size equal to its byte range, the ranges tiling the data."""
    if len(data) < 8:
        raise ValueError(f"{name} is truncated (no safetensors header)")
    size = int.from_bytes(data[:8], "little")
    if size > min(MAX_HEADER_BYTES, len(data) - 8):
        raise ValueError(f"{name}: its safetensors header claims {size} bytes, but the file has {len(data)}")
    try:
        header = _json(data[8 : 8 + size])
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{name}: its safetensors header is not JSON ({err})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{name}: its safetensors header is not an object")
    spans, total = [], 0
    for key, info in header.items():
        if key == "__metadata__":
            continue
        if not isinstance(info, dict) or info.get("dtype") not in _DTYPE_BYTES:
            raise ValueError(f"{name}: tensor {key!r} has an unknown dtype "
                             f"{info.get('dtype') if isinstance(info, dict) else info!r}")
        shape, offsets = info.get("shape"), info.get("data_offsets")
        if (not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                   for d in shape)
                or not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)):
            raise ValueError(f"{name}: tensor {key!r} has a malformed shape or data_offsets")
        want = math.prod(shape) * _DTYPE_BYTES[info["dtype"]]
        if offsets[1] - offsets[0] != want:
            raise ValueError(f"{name}: tensor {key!r} of shape {shape} needs {want} bytes, its offsets give "
                             f"{offsets[1] - offsets[0]}")
        spans.append(tuple(offsets))
        total += want
    spans.sort()
    if [a for a, _ in spans] != [0] + [b for _, b in spans[:-1]] or total != len(data) - 8 - size:
        raise ValueError(f"{name}: its tensors' byte ranges do not tile the file's {len(data) - 8 - size} data bytes")
    if not nbytes <= total <= nbytes + 8:
        raise ValueError(f"{name} holds {total} bytes of tensors; its index entry says {nbytes}")


# Bytes per element of the safetensors dtypes a store may hold.
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
