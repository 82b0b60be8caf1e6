"""Argument types and flags shared by the commands: each type raises ArgumentTypeError, whose
message argparse shows after the flag; one flag per policy option."""

from __future__ import annotations

import argparse

import torch

from .. import option_info, policies
from ..runtime.threads import set_threads

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


THREADS_HELP = (
    "CPU threads for torch (default: 1 for a model of up to 50M parameters, such as the bundled one; "
    "else torch's, usually one per core, but no more than the cores the load average leaves idle; "
    "OMP_NUM_THREADS, when set, is kept). Use 1 when another CPU-bound process shares the machine: "
    "threads then wait on each other at every operation (docs/cli.md, Threads, has the figures)"
)


def cache_length_arg(value: str) -> int | float:
    """``--cache-length``: a whole number is a token count (300, or 1e3 in exponent form), a
    number with a decimal point a fraction of the prompt in (0, 1] (0.25; 1.0 is the whole)."""
    text = value.strip()
    accepted = "a token count such as 300, or a fraction of the prompt in (0, 1] such as 0.25 (1.0: the whole prompt)"
    if text.isdigit():
        if int(text) < 1:
            raise argparse.ArgumentTypeError(f"expected {accepted}; got {value!r} (a cache holds at least 1 token)")
        return int(text)
    try:
        number = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {accepted}; got {value!r}") from None
    if number <= 0:
        raise argparse.ArgumentTypeError(f"expected {accepted}; got {value!r} ({'negative' if number else 'zero'}: "
                                         "a cache holds at least 1 token)")
    if "." not in text and number >= 1 and number.is_integer() and number < 2**63:
        return int(number)  # 1e3: a token count in exponent form
    if not 0 < number <= 1:
        what = ("a number with a decimal point is a fraction; write a token count without one" if "." in text
                else "not a whole number of tokens")
        raise argparse.ArgumentTypeError(f"expected {accepted}; got {value!r} ({what})")
    return number


def int_at_least(low: int):
    def parse(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            number = None
        if number is None or number < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {value!r}")
        return number

    return parse


def number(value: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {value!r}") from None


def device_arg(value: str) -> torch.device:
    try:
        device = torch.device(value)
    except RuntimeError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError("CUDA is not available in this PyTorch build or on this machine")
    return device


def comma_list(convert):
    def parse(value: str) -> list:
        try:
            return [convert(v.strip()) for v in value.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {value!r}") from None

    return parse


def cache_names(value: str) -> list[str]:
    """Comma-separated cache names, whose option lists keep their own commas:
    ``dense,snapkv(window=64,kernel=5)`` -> ["dense", "snapkv(window=64,kernel=5)"]."""
    names, part, depth = [], "", 0
    for ch in value:
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            names.append(part)
            part = ""
        else:
            part += ch
    names.append(part)
    return [n.strip() for n in names if n.strip()]


def dtype_arg(name: str | None, device: torch.device) -> torch.dtype | None:
    """The --dtype choice; None lets ``load`` choose (float32 on CPU, the checkpoint's own dtype
    elsewhere)."""
    return None if name is None else DTYPES[name]


def apply_threads(threads: int | None) -> None:
    """``--threads``; without it each command chooses for its model once loaded (kvcache/runtime/threads.py)."""
    set_threads(threads)


def policy_flags() -> dict[str, list[tuple[str, object]]]:
    """Each policy option's name -> [(policy, its OptionInfo)] over every policy that has it."""
    found: dict[str, list] = {}
    for name in policies():
        for info in option_info(name):
            found.setdefault(info.name, []).append((name, info))
    return dict(sorted(found.items()))


def flag_value(info) -> str:
    if info.type is bool:
        return "on" if info.default else "off"
    return str(info.default)


def add_policy_options(parser: argparse.ArgumentParser) -> None:
    """One flag per policy option (``--recent 32``); which policy accepts which is checked by make_cache."""
    group = parser.add_argument_group("policy options (see `kvcache policies`; each applies to the policies named)")
    for option, owners in policy_flags().items():
        # The shortest help text is the one that holds for every policy (others add particulars).
        first = min((info for _, info in owners), key=lambda info: len(info.help))
        defaults = ", ".join(f"{policy} {flag_value(info)}" for policy, info in owners)
        choices = tuple(dict.fromkeys(c for _, info in owners for c in info.choices or ())) or None
        # default=None marks an option the user did not give, so only given ones reach the policy.
        kwargs = {"dest": f"opt_{option}", "default": None, "help": f"{first.help} (default: {defaults})"}
        flag = "--" + option.replace("_", "-")
        if first.type is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, **kwargs)
        elif choices is not None:
            group.add_argument(flag, choices=choices, **kwargs)
        else:
            convert = number if first.type is float else int_at_least(0) if first.type is int else str
            metavar = {int: "N", float: "X"}.get(first.type, "VALUE")
            group.add_argument(flag, type=convert, metavar=metavar, **kwargs)
