"""Rules of the package's shape that a reader relies on: one loop over a model's logits
(generate.decode_loop, which generate, kvzip and eval run), and no function longer than
``LONGEST`` lines."""

from __future__ import annotations

import ast
from pathlib import Path

import kvcache

ROOT = Path(kvcache.__file__).parent
# Calls that turn logits into tokens.
PICKS = {"greedy", "sample", "argmax", "multinomial"}


def functions():
    for path in sorted(ROOT.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield path.relative_to(ROOT.parent), node


def _called(node) -> set[str]:
    names = set()
    for call in ast.walk(node):
        if isinstance(call, ast.Call):
            f = call.func
            names.add(f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else "")
    return names


def test_one_loop_turns_a_models_logits_into_tokens():
    """A loop that picks tokens from logits (greedy, sampling, argmax) and feeds them back to a model
    (its ``decode``, its forward, a captured step) is a second decode loop: decode_loop itself
    picks through its hook and is the only loop allowed to."""
    loops = []
    for path, fn in functions():
        for node in ast.walk(fn):
            if isinstance(node, (ast.For, ast.While)):
                called = _called(node)
                if called & PICKS and called & {"decode", "model", "step"}:
                    loops.append(f"{path}:{node.lineno} in {fn.name}")
    assert loops == [], loops


# The most lines a function of the package may take, its docstring left out (a docstring is the
# function's reference, not its logic).
LONGEST = 80


def _length(fn) -> int:
    lines = fn.end_lineno - fn.lineno + 1
    first = fn.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        lines -= first.end_lineno - first.lineno + 1
    return lines


def test_no_function_is_longer_than_longest():
    long = sorted(f"{path}:{fn.lineno} {fn.name} ({_length(fn)} lines)" for path, fn in functions()
                  if _length(fn) > LONGEST)
    assert long == [], long
