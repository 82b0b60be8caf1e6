"""Typed policy options: one field helper and one validator for every policy.

A policy's options are a frozen dataclass whose fields are made with ``option``, which records a
one-line help text and, for a string option, its valid values. Types and choices are checked
here, once, for every policy; a policy's own ``__post_init__`` checks only what is particular to
it (a range, say).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class NoOptions:
    """A policy without options."""


@dataclass(frozen=True)
class OptionInfo:
    """What a user needs to know about one option (the CLI builds its flags from this)."""

    name: str
    type: type
    default: object
    help: str
    choices: tuple[str, ...] | None = None


def option(default: object, help: str, choices: tuple[str, ...] | None = None):
    """A dataclass field with a default, a one-line help text and (for strings) its valid values."""
    if choices is not None and default not in choices:
        raise ValueError(f"default {default!r} is not one of the choices {choices}")
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices})


def describe(options_cls: type) -> list[OptionInfo]:
    """The options of ``options_cls`` in declaration order."""
    return [
        OptionInfo(f.name, type(f.default), f.default, f.metadata.get("help", ""), f.metadata.get("choices"))
        for f in dataclasses.fields(options_cls)
    ]


def build(policy: str, options_cls: type, given: dict[str, object]):
    """``options_cls(**given)`` after checking names, types and choices, with errors that name the
    policy, the option and what it accepts."""
    infos = {info.name: info for info in describe(options_cls)}
    unknown = sorted(set(given) - set(infos))
    if unknown:
        raise ValueError(
            f"policy {policy!r} has no option {', '.join(map(repr, unknown))}; "
            f"valid options: {', '.join(infos) or 'none'}"
        )
    for name, value in given.items():
        info = infos[name]
        # bool is an int to Python, but `sinks=True` is a mistake, and `recent=3.5` should not round;
        # an int is a fine float.
        if info.type is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        else:
            ok = isinstance(value, info.type) and (info.type is bool or not isinstance(value, bool))
        if not ok:
            raise ValueError(f"option {name!r} of policy {policy!r} must be {info.type.__name__}, got {value!r}")
        if info.choices is not None and value not in info.choices:
            raise ValueError(
                f"option {name!r} of policy {policy!r} must be one of {', '.join(map(str, info.choices))}, got {value!r}"
            )
    given = {k: float(v) if infos[k].type is float else v for k, v in given.items()}
    return options_cls(**given)
