"""Cache policies, one file each, and their index: every module of this package is imported on
first use (``discover``) and the layer cache classes it defines are registered by their ``name``.
The registry (registry.py) builds caches from the index; a policy that wraps another (critical)
looks its base up here, so no policy imports the registry."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

from ..base import LayerCache

POLICIES: dict[str, type[LayerCache]] = {}
_DISCOVERED = False


def register(cls: type[LayerCache]) -> type[LayerCache]:
    """Register a layer cache class under its ``name`` (usable as a class decorator)."""
    discover()
    return _add(cls)


def _add(cls: type[LayerCache]) -> type[LayerCache]:
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        raise ValueError(f"{cls.__name__} needs a class attribute `name` (a non-empty string) to be registered")
    if ":" in name:
        raise ValueError(f"a policy name cannot contain ':' (it separates the storage), got {name!r}")
    if POLICIES.get(name, cls) is not cls:
        raise ValueError(f"a policy named {name!r} is already registered")
    POLICIES[name] = cls
    return cls


def discover() -> None:
    """Import every module of this package and register the policies defined there."""
    global _DISCOVERED
    if _DISCOVERED:
        return
    _DISCOVERED = True
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{__name__}.{info.name}")
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if (cls.__module__ == module.__name__ and issubclass(cls, LayerCache)
                    and not inspect.isabstract(cls) and "name" in vars(cls)):
                _add(cls)


def lookup(policy: str) -> type[LayerCache]:
    """The class of the policy named ``policy`` (no options, no storage); ValueError naming the
    available ones."""
    discover()
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; available: {', '.join(sorted(POLICIES))}")
    return POLICIES[policy]
