"""The ``kvcache`` parser and dispatch: whole option names only, one-line errors (status 2),
kvcache's warnings as one line, and the status of each way a command ends."""

from __future__ import annotations

import argparse
import difflib
import os
import sys
import warnings

from tqdm import tqdm

from .. import __version__
from ..errors import KVCacheError, KVCacheWarning
from . import drift, eval, finetune, generate, models, policies

# Each command's module: its add_parser(commands) adds its subcommand(s), its run(args) runs one.
COMMANDS = {"generate": generate, "eval": eval, "finetune": finetune, "drift": drift, "policies": policies,
            "convert": models, "fetch": models}


class _Parser(argparse.ArgumentParser):
    """argparse that takes whole option names only: an abbreviation (``--sink`` for ``--sinks``)
    is an unknown option, not silently another one. Every subcommand's parser is one too."""

    def __init__(self, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(**kwargs)

    def error(self, message: str):
        """Every argument error in one line, ``kvcache: error: ...`` and status 2, as errors found
        later are reported (no usage block: ``--help`` prints that)."""
        print(f"kvcache: error: {_argument_message(message, self)}", file=sys.stderr)
        sys.exit(2)


def _argument_message(message: str, parser: argparse.ArgumentParser) -> str:
    """argparse's message, with the command named where argparse calls it ``command``."""
    commands = getattr(parser, "commands", None)
    if commands is None:
        return message
    names = ", ".join(commands)
    if message.startswith("the following arguments are required: command"):
        return f"name a command: {names} (kvcache --help says what each does)"
    if message.startswith("argument command: invalid choice: "):
        given = message.split("invalid choice: ", 1)[1].split(" (choose", 1)[0].strip("'")
        close = difflib.get_close_matches(given, list(commands), n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]}?" if close else ""
        return f"unknown command {given!r}{hint} (the commands: {names})"
    return message


def _unrecognized(extra: list[str], parser: argparse.ArgumentParser) -> str:
    """The error for arguments ``parser`` does not take, with the closest option it does take."""
    message = f"unrecognized arguments: {' '.join(extra)}"
    known = list(parser._option_string_actions)
    for arg in extra:
        if arg.startswith("--"):
            close = difflib.get_close_matches(arg.split("=", 1)[0], known, n=1, cutoff=0.6)
            if close:
                return f"{message} (did you mean {close[0]}?)"
    return message


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvcache", description="KV caching for decoder-only language models.")
    parser.add_argument("--version", action="version", version=f"kvcache {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    # Each subcommand's parser, to report its own unknown arguments with its own usage.
    parser.commands = commands.choices
    for module in dict.fromkeys(COMMANDS.values()):
        module.add_parser(commands)
    return parser


def _warn(message, category, filename, lineno, file=None, line=None) -> None:
    """kvcache's own warnings as one line, like its errors (no source line)."""
    if issubclass(category, KVCacheWarning):
        # Through tqdm, which clears a progress bar drawn on the stream first and redraws it after.
        tqdm.write(f"kvcache: warning: {message}", file=sys.stderr if file is None else file)
    else:
        _default_showwarning(message, category, filename, lineno, file, line)


_default_showwarning = warnings.showwarning


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        command = parser.commands[args.command]
        command.error(_unrecognized(extra, command))
    with warnings.catch_warnings():
        warnings.showwarning = _warn
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    try:
        COMMANDS[args.command].run(args)
    except (KVCacheError, ValueError) as e:
        print(f"kvcache: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader (e.g. `| head`) went away; point stdout at nothing so the exit flush stays quiet.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    return 0
