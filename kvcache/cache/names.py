"""Cache names, parsed once: ``policy[(options)][:storage]`` -> ``CacheName``.

``h2o`` keeps the tokens H2O picks at full precision, ``h2o:int4`` keeps them as 4-bit codes,
``h2o(recent=0,normalize=true)`` sets two of its options in the name, so that one string names a
variant wherever a policy is named (``kvcache eval --policies``, ``make_cache``, the vLLM
plugin's ``policy``). Every entry point parses a name here, once, into a frozen ``CacheName``
and passes that value on; nothing parses the string again. Whether the policy exists and takes
the options is the registry's to check (``registry.check_names``, ``make_cache``): this module
knows the syntax only.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from .storages import parse_storage

# policy, then optionally (key=value, ...), then optionally :storage
_NAME = re.compile(r"^([^():]+)(?:\(([^()]*)\))?(?::(.*))?$")


class Options(Mapping[str, object]):
    """A policy's options as a read-only mapping that compares and hashes by its items, so that a
    ``CacheName`` holding one is a frozen value (a dict key, a set member)."""

    __slots__ = ("_items",)

    def __init__(self, items: Mapping[str, object] | None = None) -> None:
        self._items = MappingProxyType(dict(items or {}))

    def __getitem__(self, key: str) -> object:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(tuple(sorted((k, repr(v)) for k, v in self._items.items())))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mapping) and dict(self._items) == dict(other)

    def __repr__(self) -> str:
        return repr(dict(self._items))


@dataclass(frozen=True)
class CacheName:
    """One cache name, parsed: ``policy`` (a registered policy's name, not checked here),
    ``options`` (what the name sets, a read-only mapping of ints, floats, bools and strings) and
    ``storage`` ("full" when the name gives none). ``str()`` writes it back one way: options
    sorted, no spaces, booleans as ``true``/``false``, the storage only where one was named."""

    policy: str
    options: Options = Options()
    storage: str = "full"
    storage_named: bool = False

    @classmethod
    def parse(cls, name: str | CacheName) -> CacheName:
        """``name`` as a CacheName (a CacheName is returned as it is). ValueError, saying what
        was wrong, for text that is not ``policy[(option=value,...)][:storage]``, an option given
        twice or not as ``option=value``, and an unknown storage."""
        if isinstance(name, CacheName):
            return name
        if not isinstance(name, str):
            raise ValueError(f"a policy name is a string such as 'h2o' or 'h2o:int4', got {name!r}")
        found = _NAME.match(name.strip())
        if found is None:
            raise ValueError(f"{name!r} is not a cache name: policy[(option=value,...)][:storage], "
                             "e.g. 'h2o', 'h2o:int4' or 'h2o(recent=0,normalize=true):int4'")
        policy, text, storage = found.groups()
        if storage is not None:
            try:
                parse_storage(storage)
            except ValueError as e:
                raise ValueError(f"{e} (in {name!r}: name a cache policy[:storage], e.g. 'h2o:int4')") from None
        return cls(policy.strip(), Options(_options(name, text)), storage or "full", storage is not None)

    def with_options(self, options: Mapping[str, object] | None) -> CacheName:
        """This name with ``options`` set as well; ValueError for an option set both in the name
        and in ``options`` (each option is set once)."""
        if not options:
            return self
        if not isinstance(options, Mapping):
            raise ValueError(f"policy options are a mapping of option name -> value, got {type(options).__name__}")
        twice = sorted(set(self.options) & set(options))
        if twice:
            raise ValueError(f"{str(self)!r} sets {', '.join(twice)} in its name, and the same option is given "
                             "again outside it: set each option once")
        return CacheName(self.policy, Options({**self.options, **options}), self.storage, self.storage_named)

    def __str__(self) -> str:
        shown = ",".join(f"{k}={_shown(v)}" for k, v in sorted(self.options.items()))
        return self.policy + (f"({shown})" if shown else "") + (f":{self.storage}" if self.storage_named else "")


def _options(name: str, text: str | None) -> dict[str, object]:
    """The options between a name's parentheses: ``"window=64,kernel=5"`` -> {"window": 64,
    "kernel": 5}."""
    options: dict[str, object] = {}
    for item in filter(None, (part.strip() for part in (text or "").split(","))):
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key.isidentifier() or not value:
            raise ValueError(f"{name!r}: {item!r} is not option=value")
        if key in options:
            raise ValueError(f"{name!r}: option {key!r} given twice")
        options[key] = _value(value)
    return options


def _value(text: str) -> object:
    """An option value as written in a name: an int, a float, true/false, or else the text."""
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _shown(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)
