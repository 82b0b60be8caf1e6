"""Policy names -> layer cache classes, their typed options, and ``make_cache``.

A cache is named ``policy[(options)][:storage]`` (names.py parses it once into a ``CacheName``):
``h2o`` keeps the tokens H2O picks at full precision, ``h2o:int4`` keeps them as 4-bit codes,
``h2o(recent=0,normalize=true)`` sets two of its options in the name. Every function here takes a
name as text or as a ``CacheName``. Any policy pairs with any storage.

The built-in policies are found, not listed: every module under ``policies/`` is imported on
first use and each layer cache class defined there with a ``name`` is registered. Adding a
policy is adding a file. Policies defined elsewhere register with ``register``.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping, Sequence

import torch

from ..errors import KVCacheWarning
from ..runtime.memory import check_fits
from .base import CacheSpec, KVCache, LayerCache
from .blocks import check_block
from .budgets import layer_budgets
from .headwise import HeadwiseCache
from .names import CacheName
from .options import OptionInfo, build, describe
from .policies import POLICIES as _POLICIES
from .policies import discover as _discover
from .policies import lookup as _lookup
from .storages import STORAGES, check_storage


def policy_class(policy: str | CacheName) -> type[LayerCache]:
    """The layer cache class of ``policy`` (a name like ``sink`` or ``sink:int8``), for engines
    that build layer caches of their own (kvcache.vllm); ValueError naming the available ones."""
    return _lookup(CacheName.parse(policy).policy)


def reconstructs(policy: str | CacheName) -> bool:
    """Whether ``policy`` scores a context by a reconstruction pass (kvcache.generation.reconstruction), which only
    the runs that make that pass can fill its cache by."""
    return getattr(policy_class(policy), "reconstructs", False)


def policies() -> dict[str, str]:
    """Registered policy names with a one-line description each."""
    _discover()
    return {name: cls.description for name, cls in sorted(_POLICIES.items())}


def storages() -> dict[str, str]:
    """Storage names (the part after ``:`` in ``h2o:int4``) with a one-line description each."""
    return dict(STORAGES)


def option_info(policy: str | CacheName) -> list[OptionInfo]:
    """Options of ``policy`` (a name like ``h2o`` or ``h2o:int4``): name, type, default, help
    and, for a string option, its valid values."""
    return describe(policy_class(policy).Options)


def policy_options(policy: str | CacheName) -> dict[str, object]:
    """Options of ``policy`` (a name like ``h2o`` or ``h2o:int4``) with their defaults."""
    return {info.name: info.default for info in option_info(policy)}


def budget_options(policy: str | CacheName, cache_length: int) -> dict[str, object]:
    """Options as ``policy``'s paper sets them for a budget of ``cache_length`` slots (h2o: half
    the budget recent; snapkv: a window of up to 32; sink: up to 4 sinks), less those the name
    sets itself (``snapkv(window=64)`` keeps its window). Evaluation and benchmarks use these so
    that every policy is compared at its intended settings."""
    name = CacheName.parse(policy)
    scaled = _lookup(name.policy).options_for_budget(cache_length)
    return {k: v for k, v in scaled.items() if k not in name.options}


def check_names(names: Sequence[str | CacheName], what: str = "policies") -> None:
    """Every ``policy[(options)][:storage]`` name of ``names`` known, its options the policy's and
    of the right types, or one ValueError naming each unknown policy, option and storage
    (``what``: how the caller's user gave the names, e.g. ``--policies``)."""
    _discover()
    policies, problems = [], []
    for name in names:
        try:
            parsed = CacheName.parse(name)
        except ValueError as e:
            problems.append(str(e))
            continue
        if parsed.policy not in _POLICIES:
            policies.append(str(name))
            continue
        try:
            build(parsed.policy, _POLICIES[parsed.policy].Options, dict(parsed.options))
        except ValueError as e:
            problems.append(f"{name}: {e}")
    if policies:
        problems.insert(0, f"unknown policy(ies) {', '.join(policies)}; available: {', '.join(sorted(_POLICIES))}")
    if problems:
        raise ValueError(f"{what}: {'; '.join(problems)}")


def falls_back(storage: str) -> bool:
    """Whether a cache named with ``storage`` holds full precision where that takes fewer bytes:
    the ``int<bits>`` names (the layout chosen for quality at that width) do; a layout named
    outright (``kivi4``, ``token4/32``) is built as named."""
    return storage.startswith("int")


def stored_as(cache: KVCache) -> str | None:
    """The storage ``cache`` holds, when it is not the one its name asks for: "full" where the
    named codes would have taken more bytes than full precision (``falls_back``); else None."""
    named = CacheName.parse(cache.policy).storage
    return cache.spec.storage if cache.spec.storage != named else None


def break_even(model: torch.nn.Module, policy: str | CacheName, *, batch_size: int = 1, largest: int = 1 << 20) -> int | None:
    """The smallest ``cache_length`` at which ``policy`` (``h2o:int4``) holds its codes, not full
    precision (``falls_back``), for ``model``; None if the storage never falls back (or not
    below ``largest``). Sizes come from caches built on the meta device: nothing is allocated."""
    name = CacheName.parse(policy)
    storage = name.storage
    if not falls_back(storage):
        return None
    cls = _lookup(name.policy)

    def nbytes(length: int, stored: str) -> int:
        total = 0
        for i, budget in enumerate(layer_budgets(length, model.config.num_layers, "uniform")):
            spec = CacheSpec.for_model(model, batch_size=batch_size, cache_length=budget, storage=stored, layer=i)
            spec = dataclasses.replace(spec, device=torch.device("meta"))
            total += layer_cache(cls, spec, dict(name.options)).nbytes_at(budget)  # every slot allocated
        return total

    def codes(length: int) -> bool:
        try:
            return nbytes(length, storage) <= nbytes(length, "full")
        except ValueError:
            return False  # a length the policy cannot take (sinks >= cache_length): the search goes above it

    if codes(1):
        return 1
    if not codes(largest):
        return None
    low, high = 1, largest  # codes(low) is False, codes(high) True
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if codes(mid) else (mid, high)
    return high


# A share of the prompt that leaves an evicting policy fewer slots than this is warned about: a
# cache of a handful of tokens drops nearly all of any prompt.
FEW_SLOTS = 16


def _warn_few_slots(cls, policy: str, requested: int | float, prompt_length: int | None, tokens: int) -> None:
    """Warn when a share of the prompt (a float ``cache_length``) leaves an evicting policy fewer
    than ``FEW_SLOTS`` slots; a token count is what was asked for."""
    if isinstance(requested, float) and cls.evicts and tokens < FEW_SLOTS:
        warnings.warn(
            f"cache_length={requested} of a {prompt_length}-token prompt leaves the {policy} policy {tokens} "
            f"slot{'s' if tokens != 1 else ''} per layer: it will evict nearly everything and the output may "
            "degrade; give a larger share or a token count", KVCacheWarning, stacklevel=3)


def resolve_budget(cache_length: int | float, prompt_length: int | None) -> int:
    """A token count from ``cache_length``: an int >= 1 as it is, a float in (0, 1] as that
    fraction of ``prompt_length`` (at least one token)."""
    if isinstance(cache_length, bool) or not isinstance(cache_length, (int, float)):
        raise ValueError(f"cache_length must be a token count or a fraction in (0, 1], got {cache_length!r}")
    if isinstance(cache_length, int):
        if cache_length <= 0:
            raise ValueError(f"cache_length must be a positive token count, got {cache_length}")
        return cache_length
    if not 0 < cache_length <= 1:
        raise ValueError(
            f"a fractional cache_length must lie in (0, 1] (a share of the prompt), got {cache_length}; "
            "pass an int for a token count"
        )
    if prompt_length is None:
        raise ValueError(f"a fractional cache_length ({cache_length}) needs prompt_length, the tokens it is a share of")
    return max(1, round(cache_length * prompt_length))


def make_cache(
    model: torch.nn.Module,
    policy: str | CacheName = "dense",
    *,
    cache_length: int | float,
    batch_size: int = 1,
    prompt_length: int | None = None,
    allocation: str | Sequence[int] = "uniform",
    head_budgets: Sequence[Sequence[int]] | None = None,
    reserve: int = 0,
    block: int = 1,
    options: Mapping[str, object] | None = None,
) -> KVCache:
    """A cache for ``model`` holding up to ``cache_length`` tokens per row for ``batch_size`` rows.

    ``cache_length`` is a token count (int), or a fraction in (0, 1] of ``prompt_length``
    (float; 1.0 is the whole prompt). ``allocation`` spreads the budget over layers ("uniform",
    "pyramid", or one count per layer). ``head_budgets[layer][head]`` instead gives every K/V
    head its own capacity (see ``adaptive_head_budgets``); each head is then allocated at its own
    size. ``options`` maps the policy's own options to values (see ``policy_options``), e.g.
    ``{"recent": 32}``; an option left out takes its default, or, if the default does not fit a
    layer's budget, the value the policy's paper uses at that budget (``budget_options``).
    ``policy`` (text or a ``CacheName``) may set options in its name too, ``"snapkv(window=64)"``
    (an option set both ways is an error), and may name a storage, ``"h2o:int4"`` (see
    ``storages``; default full precision); an ``int<bits>`` storage holds full precision instead
    on a cache too small for its codes to take fewer bytes (``break_even``; ``stored_as``
    tells). ``reserve`` (scoring policies: h2o, tova, snapkv, ...) makes eviction batched: a
    layer that overflows keeps ``cache_length - reserve`` tokens, and the next ``reserve``
    tokens are appended without evicting. With ``cache_length = kept + reserve`` a prompt is
    compressed to ``kept`` tokens once and then grows by up to ``reserve`` tokens, as kvpress
    does. Buffers are allocated here, in the model's dtype and on its device: all of them, but
    for a dense cache, which allocates a few hundred slots here and more as it fills
    (``KVCache.allocate``), up to ``cache_length``. ``block`` (any policy) makes an evicting
    policy keep whole aligned blocks of ``block`` positions, as a paged serving engine frees
    them (see blocks.py).
    """
    name = CacheName.parse(policy)
    policy_name, storage = name.policy, name.storage
    cls = _lookup(policy_name)
    options = dict(name.with_options(options).options)
    build(policy_name, cls.Options, options)  # names, types and choices, before anything else
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    requested = cache_length
    tokens = resolve_budget(cache_length, prompt_length)
    _warn_few_slots(cls, policy_name, requested, prompt_length, tokens)
    cfg = model.config
    check_storage(storage, cfg.head_dim)  # bits and group sizes, before any buffer is allocated
    budgets, head_budgets = _budgets(cls, tokens, cfg, allocation, head_budgets)
    sizes = budgets if head_budgets is None else [b for layer in head_budgets for b in layer]
    _check_reserve(cls, reserve, min(sizes, default=0))
    check_block(block, policy_name, cls.evicts, min(sizes, default=0) - reserve)

    def build_layers(device: torch.device | None, storage: str = storage) -> list[LayerCache]:
        layers = []
        for i, budget in enumerate(budgets):
            spec = CacheSpec.for_model(model, batch_size=batch_size, cache_length=budget, storage=storage,
                                      reserve=reserve, block=block, layer=i)
            if device is not None:
                spec = dataclasses.replace(spec, device=device)
            heads = None if head_budgets is None else head_budgets[i]
            if holds_window(spec, heads):
                layers.append(window_layer(spec))
                continue
            try:
                layers.append(layer_cache(cls, spec, options, heads))
            except ValueError as e:
                sizing = _Sizing(requested, prompt_length, tokens, allocation, head_budgets)
                raise ValueError(f"{e}{sizing.where(i, budget)}") from None
        return layers

    rows = f"{batch_size} row{'s' if batch_size != 1 else ''}"
    storage = _storage_that_fits(build_layers, storage, model.embed_tokens.weight.device,
                                 f"a {name} cache of {tokens} slots x {cfg.num_layers} layers x {rows}")
    layers = build_layers(None, storage)
    # (A sliding layer's ring keeps no reserve nor blocks: the cache's own spec says what was asked.)
    nominal = dataclasses.replace(layers[0].spec, cache_length=tokens, reserve=reserve, block=block)
    return KVCache(layers, nominal, str(name))


@dataclasses.dataclass(frozen=True)
class _Sizing:
    """What the user asked of a cache's size, and the ``tokens`` per layer it came to."""

    requested: int | float
    prompt_length: int | None
    tokens: int
    allocation: str | Sequence[int]
    head_budgets: list[list[int]] | None

    def where(self, i: int, size: int) -> str:
        """How layer ``i``'s (or its heads') ``size`` came from what was asked, for error messages."""
        parts = []
        if isinstance(self.requested, float):
            parts.append(f"cache_length={self.requested} of a {self.prompt_length}-token prompt is {self.tokens} "
                         f"token{'s' if self.tokens != 1 else ''}")
        if self.head_budgets is not None:
            parts.append(f"layer {i} has head budgets {self.head_budgets[i]}")
        elif self.allocation != "uniform":
            parts.append(f"allocation={self.allocation!r} gives layer {i} {size} of cache_length={self.tokens}")
        return f" ({'; '.join(parts)})" if parts else ""


def _budgets(cls: type[LayerCache], tokens: int, cfg, allocation: str | Sequence[int],
             head_budgets: Sequence[Sequence[int]] | None) -> tuple[list[int], list[list[int]] | None]:
    """(each layer's budget, each layer's head budgets as ints or None) for ``tokens`` per layer
    spread by ``allocation``, or from ``head_budgets`` (a layer's budget: its heads' mean)."""
    if not cls.evicts and (head_budgets is not None or allocation != "uniform"):
        raise ValueError(
            f"the {cls.name} policy keeps every token, so its cache_length is a capacity, not a budget "
            "to spread: allocation and head_budgets apply to evicting policies"
        )
    if head_budgets is None:
        return layer_budgets(tokens, cfg.num_layers, allocation), None
    head_budgets = [[int(b) for b in layer] for layer in head_budgets]
    if len(head_budgets) != cfg.num_layers:
        raise ValueError(f"head_budgets needs one list per layer ({cfg.num_layers}), got {len(head_budgets)}")
    return [max(1, round(sum(layer) / cfg.num_kv_heads)) for layer in head_budgets], head_budgets


def _storage_that_fits(build_layers, storage: str, device: torch.device, what: str) -> str:
    """The storage to allocate ``what`` in: ``storage``, or full precision where its codes would
    take more bytes (``falls_back``); ``MemoryBudgetError`` if the bytes allocated now do not
    fit ``device`` (a dense cache's first slots: it checks each growth as it fills).
    ``build_layers(device, storage)``: the cache's layers, here on the meta device, where every
    check runs and the bytes are summed with nothing allocated."""
    layers = build_layers(torch.device("meta"), storage)
    need = sum(layer.nbytes() for layer in layers)
    if falls_back(storage):
        # Codes with their scales (and KIVI's full-precision residual) take more bytes than full
        # precision on a small cache: then the cache holds full precision, exact and smaller.
        # Compared with every slot allocated: which is smaller depends on the cache_length only.
        full_layers = build_layers(torch.device("meta"), "full")
        if _full_nbytes(full_layers) < _full_nbytes(layers):
            storage, need = "full", sum(layer.nbytes() for layer in full_layers)
    check_fits(need, device, what, "lower cache_length (max_new_tokens, when it defaults to prompt + new tokens), "
               "batch_size, or use an evicting policy or a quantized storage")
    return storage


def _full_nbytes(layers: list[LayerCache]) -> int:
    """Bytes of ``layers`` with every slot allocated (a dense layer allocates as it fills)."""
    return sum(layer.nbytes_at(layer.spec.cache_length) for layer in layers)


def holds_window(spec: CacheSpec, heads: list[int] | None = None) -> bool:
    """Whether a layer of the model's own sliding window ``spec.sliding_window`` is given a ring of
    that window instead of the policy: when its budget (every head's, with head budgets) covers
    the window. Such a layer keeps exactly what the model attends, for any chunking, so a policy
    acts only where the cache grows (the global layers). A budget below the window leaves the
    layer to the policy, at that budget, with the window applied on top."""
    window = spec.sliding_window
    return window is not None and min(heads or [spec.cache_length]) >= window


def sliding_layers(cache: KVCache) -> list[int]:
    """The layers of ``cache`` that hold a ring of the model's own window (``holds_window``)."""
    return [i for i, layer in enumerate(cache.layers) if holds_window(layer.spec)]


def window_layer(spec: CacheSpec) -> LayerCache:
    """The ring of a sliding layer (``holds_window``): the window policy over ``sliding_window``
    slots, whole tokens (no block rule), no reserve (a ring has nothing to batch)."""
    ring = dataclasses.replace(spec, cache_length=spec.sliding_window, reserve=0, block=1)
    return layer_cache(_lookup("window"), ring, {})


def _check_reserve(cls: type[LayerCache], reserve: object, smallest: int) -> None:
    """The one place ``reserve`` is validated: type, policy, and against the smallest budget."""
    if isinstance(reserve, bool) or not isinstance(reserve, int) or reserve < 0:
        raise ValueError(f"reserve must be a non-negative int, got {reserve!r}")
    if not reserve:
        return
    if not cls.supports_reserve:
        raise ValueError(
            f"reserve does not apply to the {cls.name} policy, which "
            + ("never evicts" if not cls.evicts else "keeps the newest tokens in a ring that is always full")
            + " (reserve applies to scoring policies: "
            + f"{', '.join(n for n, c in sorted(_POLICIES.items()) if c.supports_reserve)})"
        )
    if reserve >= smallest:
        raise ValueError(
            f"reserve must lie in [0, cache_length) for every layer and head; got reserve={reserve} "
            f"with a smallest budget of {smallest}"
        )


def layer_cache(cls: type[LayerCache], spec: CacheSpec, given: dict[str, object],
                heads: list[int] | None = None) -> LayerCache:
    """One layer cache. Options the user left out take their defaults unless those do not fit
    this layer's budget; then they take the policy's values for that budget."""
    options_cls = cls.Options

    def make(options) -> LayerCache:
        return cls(spec, options) if heads is None else HeadwiseCache(spec, cls, options, heads)

    try:
        return make(build(cls.name, options_cls, given))
    except ValueError:
        budget = min(heads or [spec.cache_length])
        scaled = {k: v for k, v in cls.options_for_budget(budget).items() if k not in given}
        if not scaled:
            raise
    try:
        return make(build(cls.name, options_cls, {**scaled, **given}))
    except ValueError:
        # Report the error of the user's own settings, not of the fallback.
        return make(build(cls.name, options_cls, given))
