"""Policy names -> layer cache classes, typed options, per-layer budgets, and ``make_cache``.

A cache is named ``policy[:storage]``: ``h2o`` keeps the tokens H2O picks at full precision,
``h2o:int4`` keeps the tokens it picks as 4-bit codes. Any policy pairs with any storage.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from .base import CacheSpec, KVCache, LayerCache
from .evicting import NoOptions
from .headwise import HeadwiseCache
from .policies.dense import DenseCache
from .policies.h2o import H2OCache
from .policies.sink import SinkCache
from .policies.snapkv import SnapKVCache
from .policies.tova import TOVACache
from .policies.window import WindowCache
from .storage import STORAGES

_POLICIES: dict[str, type[LayerCache]] = {}

ALLOCATIONS = ("uniform", "pyramid")
# PyramidKV's top layer keeps cache_length / PYRAMID_BETA tokens; the bottom layer what is left.
PYRAMID_BETA = 20


def register(cls: type[LayerCache]) -> type[LayerCache]:
    """Register a layer cache class under its ``name`` (usable as a class decorator)."""
    if cls.name in _POLICIES:
        raise ValueError(f"a policy named {cls.name!r} is already registered")
    if ":" in cls.name:
        raise ValueError(f"a policy name cannot contain ':' (it separates the storage), got {cls.name!r}")
    _POLICIES[cls.name] = cls
    return cls


for _cls in (DenseCache, WindowCache, SinkCache, H2OCache, TOVACache, SnapKVCache):
    register(_cls)


def policies() -> dict[str, str]:
    """Registered policy names with a one-line description each."""
    return {name: cls.description for name, cls in sorted(_POLICIES.items())}


def storages() -> dict[str, str]:
    """Storage names (the part after ``:`` in ``h2o:int4``) with a one-line description each."""
    return dict(STORAGES)


def policy_options(policy: str) -> dict[str, object]:
    """Options of ``policy`` (a name like ``h2o`` or ``h2o:int4``) with their defaults."""
    options_cls = getattr(_lookup(parse_name(policy)[0]), "Options", NoOptions)
    return {f.name: f.default for f in dataclasses.fields(options_cls)}


def parse_name(name: str) -> tuple[str, str]:
    """``"h2o:int4"`` -> ("h2o", "int4"); ``"h2o"`` -> ("h2o", "full"). Raises ValueError on an
    unknown storage (an unknown policy is reported by ``_lookup``)."""
    policy, sep, storage = name.partition(":")
    if not sep:
        return policy, "full"
    if storage not in STORAGES:
        raise ValueError(
            f"unknown storage {storage!r} in {name!r}; available: {', '.join(STORAGES)} "
            f"(name a cache policy[:storage], e.g. 'h2o:int4')"
        )
    return policy, storage


def _lookup(policy: str) -> type[LayerCache]:
    if policy not in _POLICIES:
        raise ValueError(f"unknown policy {policy!r}; available: {', '.join(sorted(_POLICIES))}")
    return _POLICIES[policy]


def _options(cls: type[LayerCache], options: dict[str, object]):
    options_cls = getattr(cls, "Options", NoOptions)
    valid = [f.name for f in dataclasses.fields(options_cls)]
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ValueError(
            f"policy {cls.name!r} has no option {', '.join(map(repr, unknown))}; "
            f"valid options: {', '.join(valid) or 'none'}"
        )
    for f in dataclasses.fields(options_cls):
        if f.name in options:
            _check_type(cls.name, f.name, options[f.name], type(f.default))
    return options_cls(**options)


def _check_type(policy: str, name: str, value: object, expected: type) -> None:
    # bool is an int to Python, but `sinks=True` is a mistake, and `recent=3.5` should not round.
    ok = isinstance(value, expected) and (expected is bool or not isinstance(value, bool))
    if not ok:
        raise ValueError(
            f"option {name!r} of policy {policy!r} must be {expected.__name__}, got {value!r}"
        )


def layer_budgets(cache_length: int, num_layers: int, allocation: str | Sequence[int]) -> list[int]:
    """Tokens per layer: the same everywhere, a PyramidKV pyramid with mean ``cache_length``
    (more in lower layers, where attention is broad), or an explicit list."""
    if not isinstance(allocation, str):
        budgets = [int(b) for b in allocation]
        if len(budgets) != num_layers or min(budgets) <= 0:
            raise ValueError(f"layer budgets must be {num_layers} positive integers, got {budgets}")
        return budgets
    if allocation == "uniform":
        return [cache_length] * num_layers
    if allocation == "pyramid":
        if num_layers == 1:
            return [cache_length]
        top = max(1, cache_length // PYRAMID_BETA)
        bottom = 2 * cache_length - top
        return [round(bottom - (bottom - top) * i / (num_layers - 1)) for i in range(num_layers)]
    raise ValueError(f"unknown layer allocation {allocation!r}; use one of {', '.join(ALLOCATIONS)} or a list")


def make_cache(
    model: torch.nn.Module,
    policy: str = "dense",
    *,
    cache_length: int | float,
    batch_size: int = 1,
    prompt_length: int | None = None,
    allocation: str | Sequence[int] = "uniform",
    head_budgets: Sequence[Sequence[int]] | None = None,
    reserve: int = 0,
    **options: object,
) -> KVCache:
    """A cache for ``model`` holding up to ``cache_length`` tokens per row for ``batch_size`` rows.

    ``cache_length`` is a token count, or a fraction in (0, 1) of ``prompt_length``.
    ``allocation`` spreads the budget over layers ("uniform", "pyramid", or one count per layer).
    ``head_budgets[layer][head]`` instead gives every K/V head its own capacity (see
    ``adaptive_head_budgets``); each head is then allocated at its own size.
    ``options`` are the policy's own (see ``policy_options``). ``policy`` may name a storage too,
    ``"h2o:int4"`` (see ``storages``; default full precision). ``reserve`` (scoring policies:
    h2o, tova, snapkv) makes eviction batched: a layer that overflows keeps ``cache_length -
    reserve`` tokens, and the next ``reserve`` tokens are appended without evicting. With
    ``cache_length = kept + reserve`` a prompt is compressed to ``kept`` tokens once and then
    grows by up to ``reserve`` tokens, as kvpress does. Buffers are allocated here, once, in
    the model's dtype and on its device.
    """
    policy_name, storage = parse_name(policy)
    cls = _lookup(policy_name)
    opts = _options(cls, options)
    if isinstance(reserve, bool) or not isinstance(reserve, int) or reserve < 0:
        raise ValueError(f"reserve must be a non-negative int, got {reserve!r}")
    if isinstance(cache_length, float):
        if not 0 < cache_length < 1 or prompt_length is None:
            raise ValueError(
                "a fractional cache_length must lie in (0, 1) and needs prompt_length "
                f"(got cache_length={cache_length}, prompt_length={prompt_length})"
            )
        cache_length = max(1, round(cache_length * prompt_length))
    cfg = model.config
    weight = model.embed_tokens.weight
    budgets = layer_budgets(cache_length, cfg.num_layers, allocation)
    if head_budgets is not None:
        head_budgets = [[int(b) for b in layer] for layer in head_budgets]
        if len(head_budgets) != cfg.num_layers:
            raise ValueError(f"head_budgets needs one list per layer ({cfg.num_layers}), got {len(head_budgets)}")
        budgets = [max(1, round(sum(layer) / cfg.num_kv_heads)) for layer in head_budgets]
    if reserve:
        # Checked before any layer is made, so that no policy's own check reports it first.
        sizes = budgets if head_budgets is None else [b for layer in head_budgets for b in layer]
        smallest = min(sizes, default=0)
        if reserve >= smallest:
            raise ValueError(
                f"reserve must lie in [0, cache_length) for every layer and head; got reserve={reserve} "
                f"with a smallest budget of {smallest}"
            )
    layers: list[LayerCache] = []
    for i, budget in enumerate(budgets):
        spec = CacheSpec(
            batch_size=batch_size,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            cache_length=budget,
            dtype=weight.dtype,
            device=weight.device,
            window=cfg.sliding_window,
            inv_freq=model.inv_freq,
            storage=storage,
            reserve=reserve,
        )
        if head_budgets is None:
            layers.append(cls(spec, opts))
        else:
            layers.append(HeadwiseCache(spec, cls, opts, head_budgets[i]))
    nominal = dataclasses.replace(layers[0].spec, cache_length=cache_length)
    return KVCache(layers, nominal, policy)
