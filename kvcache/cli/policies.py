"""``kvcache policies``: the cache policies, their options and the storages."""

from __future__ import annotations

import argparse

from .. import load, option_info, policies, storages
from ..cache import budget_options
from ..cache.registry import break_even
from .args import (
    flag_value,
)


def _option_usage(info) -> str:
    flag = "--" + info.name.replace("_", "-")
    if info.type is bool:
        return f"{flag}/--no-{flag[2:]} (default: {flag_value(info)})"
    value = "{" + ",".join(info.choices) + "}" if info.choices else {int: "N", float: "X"}.get(info.type, "VALUE")
    return f"{flag} {value} (default: {info.default})"


def add_parser(commands) -> None:
    commands.add_parser("policies", help="list the cache policies, their options and the storages")


def run(args: argparse.Namespace) -> None:
    table = policies()
    width = max(map(len, table))
    for name, description in table.items():
        print(f"{name:<{width}}  {description}")
        for info in option_info(name):
            print(f"{'':<{width}}    {_option_usage(info)}  {info.help}")
        small = budget_options(name, 16)
        if small:
            shown = ", ".join(f"{k}={v}" for k, v in small.items())
            print(f"{'':<{width}}    (a default left out that does not fit a small cache_length gives way to the "
                  f"paper's value for it: {shown} at 16)")
    print("\nstorages (name a cache policy:storage, e.g. h2o:int4; default full):")
    for name, description in storages().items():
        print(f"{name:<{width}}  {description}")
    model = load()
    below = {name: break_even(model, f"dense:{name}") for name in storages() if name.startswith("int")}
    shown = ", ".join(f"below {n} slots at {name}" if n and n > 1 else f"never at {name}" for name, n in below.items())
    print("\nmodels with sliding-window layers (Gemma 3, Qwen2/Qwen3 with use_sliding_window, Mistral): a sliding "
          "layer whose budget covers its window holds a ring of exactly that window, whatever the policy, so the "
          "policy bounds the global layers, where the cache grows; a budget below the window leaves the layer to the "
          "policy at that budget, the window applied on top.")
    print(f"\nint8, int4 and int2 never hold more bytes than full precision: where their codes would (the scales, and "
          f"KIVI's full-precision residual of {_kivi_group()} tokens per row and layer, outweigh the codes' saving on "
          f"a small cache), the cache holds full precision instead, and the generate summary says so. For the bundled "
          f"model (batch 1), full precision {shown}. A layout named outright (kivi4, token4/32) is built as named.")


def _kivi_group() -> int:
    from ..cache.storages import LAYOUTS

    return LAYOUTS["kivi"].default_group
