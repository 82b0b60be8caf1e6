"""docs/ARCHITECTURE.md's package layout lists the package as it is: every module and folder at the
top level, and every file of the folders it lists file by file (cache/, its storages/ and
policies/); nothing listed that is not there."""

from __future__ import annotations

import re
from pathlib import Path

import kvcache

ROOT = Path(kvcache.__file__).parent
DOC = ROOT.parent / "docs" / "ARCHITECTURE.md"


def listed() -> dict[str, set[str]]:
    """Folder (relative to the package, "" for the top) -> the names the layout lists in it."""
    text = DOC.read_text()
    block = text.split("## Package layout", 1)[1].split("```", 2)[1]
    found: dict[str, set[str]] = {}
    stack: list[tuple[int, str]] = []  # (indent, folder) of the open folders
    for line in block.splitlines()[2:]:  # after the opening line and "kvcache/"
        m = re.match(r"( +)(\S+)", line)
        if m is None or len(m.group(1)) % 2 or not re.fullmatch(r"[\w.]+(/[\w.]*)*", m.group(2)):
            continue
        indent, name = len(m.group(1)), m.group(2)
        if not (name.endswith(".py") or name.endswith("/")):
            continue
        while stack and stack[-1][0] >= indent:
            stack.pop()
        if indent != 2 + 2 * len(stack):
            continue  # a continuation line of a description
        folder = stack[-1][1] if stack else ""
        first = name.split("/")[0] + ("/" if "/" in name else "")
        found.setdefault(folder, set()).add(first)
        if name.endswith("/") and name.count("/") == 1:
            stack.append((indent, f"{folder}{name}"))
    return found


def actual(folder: str) -> set[str]:
    path = ROOT / folder
    return {p.name + ("/" if p.is_dir() else "") for p in path.iterdir()
            if p.name != "__pycache__" and (p.is_dir() or p.suffix == ".py")}


def test_the_layout_lists_every_module_and_nothing_else():
    layout = listed()
    assert "" in layout and "cache/" in layout
    for folder, names in layout.items():
        # (A folder's __init__.py is listed where it holds more than the folder's docstring.)
        names, there = names - {"__init__.py"}, actual(folder) - {"__init__.py"}
        assert names == there, (f"kvcache/{folder}: not listed {sorted(there - names)}, "
                                        f"listed but absent {sorted(names - there)}")


def test_the_layout_names_every_export_of_the_public_api():
    block = DOC.read_text().split("## Package layout", 1)[1].split("__main__.py", 1)[0]
    named = set(re.findall(r"\w+", block.split("__all__", 1)[1]))
    assert set(kvcache.__all__) <= named, sorted(set(kvcache.__all__) - named)
