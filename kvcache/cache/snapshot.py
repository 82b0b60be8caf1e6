"""Snapshots: a copy of a cache's state that a cache of the same configuration can continue from.

A layer cache's state is a set of named tensors (``LayerCache.state``): its storage's buffers,
plus, for an evicting cache, its per-slot statistics and held counts, plus whatever a policy
keeps of its own (expected_attention's query sums). Every such tensor has the batch as its first
dimension, so a snapshot can hold any subset of rows and be restored into any rows of another
cache. Everything else about a layer is configuration (``LayerCache.config``), which must match.

A snapshot holds copies, never views: continuing the cache, or a cache restored from it, never
changes it. Restoring copies the snapshot into the cache's own buffers (which stay where they
are, so anything holding on to them, such as a captured decode step, keeps working; a dense
cache that has fewer slots allocated than the rows' tokens take allocates them first).
A dense layer's snapshot has the slots its cache had allocated, which need not be the slots of
the cache it restores into: the slots past a row's tokens hold nothing (dense.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import torch

from . import positions


@dataclass(frozen=True, eq=False)
class Snapshot:
    """The state of some rows of a ``KVCache`` (``cache.snapshot(rows)``), as copies.

    policy:   the cache's name, ``policy[:storage]`` (for information: the layers' configs decide).
    layers:   each layer's ``config()`` (policy, options, storage, geometry): what a cache must
              match to take the snapshot.
    lengths:  (b,) long, CPU: tokens each row had seen.
    states:   each layer's ``state()`` restricted to the rows: name -> (b, ...) tensor.
    """

    policy: str
    layers: tuple[Mapping[str, object], ...]
    lengths: torch.Tensor
    states: tuple[Mapping[str, torch.Tensor], ...]

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    def nbytes(self) -> int:
        """Bytes of the copied tensors."""
        return sum(t.numel() * t.element_size() for state in self.states for t in state.values())

    def tensors(self) -> dict[str, torch.Tensor]:
        """The snapshot as flat names (``lengths``, ``layer{i}.{name}``), for safetensors."""
        flat = {"lengths": self.lengths}
        for i, state in enumerate(self.states):
            flat.update({f"layer{i}.{name}": t for name, t in state.items()})
        return flat

    @classmethod
    def from_tensors(cls, policy: str, layers: Sequence[Mapping[str, object]],
                     tensors: Mapping[str, torch.Tensor]) -> Snapshot:
        """The inverse of ``tensors``; raises ValueError if a name belongs to no layer."""
        if "lengths" not in tensors:
            raise ValueError("a snapshot needs a 'lengths' tensor")
        states: list[dict[str, torch.Tensor]] = [{} for _ in layers]
        for key, t in tensors.items():
            if key == "lengths":
                continue
            head, _, name = key.partition(".")
            index = head.removeprefix("layer")
            if not head.startswith("layer") or not index.isdigit() or int(index) >= len(layers) or not name:
                raise ValueError(f"tensor {key!r} names no layer of a {len(layers)}-layer cache")
            states[int(index)][name] = t
        return cls(policy, tuple(MappingProxyType(dict(c)) for c in layers), tensors["lengths"],
                   tuple(MappingProxyType(s) for s in states))


def storage_buffers(storage: object) -> dict[str, torch.Tensor]:
    """A storage's buffers, as its ``buffers()`` names them (``full``: k, v, pos; a quantized one
    adds its scales). Every one is (B, ...), batch first, as the Storage protocol lays them out."""
    return storage.buffers()


def is_positions(name: str) -> bool:
    """Whether state ``name`` holds stored positions (a storage's ``pos``, of any head)."""
    return name.rpartition(".")[2] == "pos"


def _other_positions(name: str, g: torch.Tensor, t: torch.Tensor) -> bool:
    """Whether ``g`` holds positions of another integer type than the layer's ``t`` (a snapshot
    taken when slots held int64 positions), each of which fits ``t``'s type."""
    integer = not (g.is_floating_point() or g.is_complex() or g.dtype == torch.bool)
    return is_positions(name) and g.dtype != t.dtype and integer and positions.fits(g, t.dtype)


def check_tensors(live: Mapping[str, torch.Tensor], given: Mapping[str, torch.Tensor], rows: int, where: str) -> None:
    """Raise ValueError unless ``given`` has ``live``'s names, dtypes and shapes for ``rows`` rows.
    Positions may come in another integer type whose values fit the layer's (``load_state``
    converts them): snapshots and prefix stores of caches that stored int64 positions."""
    missing, extra = sorted(set(live) - set(given)), sorted(set(given) - set(live))
    if missing or extra:
        raise ValueError(
            f"{where}: the snapshot's tensors are not this layer's (missing {missing or 'none'}, "
            f"unexpected {extra or 'none'})"
        )
    for name, t in live.items():
        g = given[name]
        want = (rows, *t.shape[1:])
        if (not isinstance(g, torch.Tensor) or tuple(g.shape) != want
                or (g.dtype != t.dtype and not _other_positions(name, g, t))):
            got = f"{g.dtype} {tuple(g.shape)}" if isinstance(g, torch.Tensor) else type(g).__name__
            raise ValueError(f"{where}: {name} is {got} in the snapshot, but this layer needs {t.dtype} {want}")


def row_index(batch_size: int, rows: Sequence[int] | None) -> torch.Tensor:
    """(n,) long, CPU: the rows named by ``rows`` (all of them for None), checked."""
    if rows is None:
        return torch.arange(batch_size)
    if isinstance(rows, (int, str, bytes)) or not isinstance(rows, Sequence):
        raise ValueError(f"rows must be a list of row indices, got {rows!r}")
    bad = [r for r in rows if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < batch_size]
    if bad or not rows:
        raise ValueError(f"rows must be distinct indices in [0, {batch_size}), got {list(rows)!r}")
    if len(set(rows)) != len(rows):
        raise ValueError(f"rows must be distinct, got {list(rows)!r}")
    return torch.tensor(list(rows), dtype=torch.long)


@torch.inference_mode()
def take(cache, rows: Sequence[int] | None = None) -> Snapshot:
    """A snapshot of ``rows`` of ``cache`` (a ``KVCache``): copies of every layer's state."""
    index = row_index(cache.batch_size, rows)
    states = tuple(
        MappingProxyType({name: t.index_select(0, index.to(t.device)) for name, t in layer.state().items()})
        for layer in cache.layers
    )
    configs = tuple(MappingProxyType(layer.config()) for layer in cache.layers)
    return Snapshot(cache.policy, configs, cache.lengths.index_select(0, index), states)


def check(cache, snapshot: Snapshot, index: torch.Tensor) -> None:
    """Raise ValueError unless ``snapshot`` can be restored into rows ``index`` of ``cache``."""
    if not isinstance(snapshot, Snapshot):
        raise ValueError(f"expected a Snapshot (from cache.snapshot()), got {type(snapshot).__name__}")
    if len(snapshot.layers) != len(cache.layers):
        raise ValueError(f"the snapshot has {len(snapshot.layers)} layers; this cache has {len(cache.layers)}")
    for i, (layer, saved) in enumerate(zip(cache.layers, snapshot.layers)):
        mine = layer.config()
        differ = [f"{k} {saved.get(k)!r} (snapshot) vs {mine.get(k)!r} (cache)"
                  for k in sorted(set(mine) | set(saved)) if saved.get(k) != mine.get(k)]
        if differ:
            raise ValueError(f"the snapshot was taken from a cache of another configuration: layer {i} has "
                             f"{'; '.join(differ)}")
    if snapshot.batch_size != len(index):
        raise ValueError(f"the snapshot holds {snapshot.batch_size} rows, but {len(index)} rows are to be restored")
    if snapshot.lengths.dtype != torch.long or snapshot.lengths.shape != (len(index),):
        raise ValueError(f"the snapshot's lengths must be ({len(index)},) long, got {snapshot.lengths.dtype} "
                         f"{tuple(snapshot.lengths.shape)}")
    for layer, state in zip(cache.layers, snapshot.states):
        layer.check_state(state, len(index))


@torch.inference_mode()
def restore(cache, snapshot: Snapshot, rows: Sequence[int] | None = None) -> None:
    """Copy ``snapshot`` into ``rows`` of ``cache`` (all rows for None), after checking all of it."""
    index = row_index(cache.batch_size, rows)
    check(cache, snapshot, index)
    # The rows' tokens, in a cache that allocates as it fills: its memory checked before any copy.
    cache.allocate(int(snapshot.lengths.max()))
    for layer, state in zip(cache.layers, snapshot.states):
        layer.load_state(state, index)
    cache.lengths[index] = snapshot.lengths
