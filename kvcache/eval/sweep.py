"""The sweep driver: list the cells, skip those already in the output directory, run the rest,
and write each result the moment it finishes.

    plan(...)               the cells of a grid, dense once per (task, length) as the reference
    pending(cells, ...)     the cells with no result file yet
    run(...)                runs the pending cells with ``run_cell`` (or any function with its
                            signature: the passkey grid's ``passkey.Runner``), a progress bar
                            over cells with the time left; with ``run_cell``, the cells that
                            share their samples run together (``run_cells``: one prefill of
                            each sample's context for the policies that compute it alike)
    load(out, ...)          the results of the given cells, in their order

Results live in ``OUT/cells/<cell key>.json``; the key (cell.py) hashes every setting the result
depends on, so a rerun with the same arguments finds the finished cells, and a changed setting
runs afresh. A result is written to a temporary file and renamed, so an interrupted sweep leaves
finished cells or none, never a partial file.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Callable, Sequence

from tqdm import tqdm

from .cell import PROTOCOLS, Bench, Cell, keeps_all, run_cell, run_cells, sample_group

CELLS = "cells"


def plan(policies: Sequence[str], ratios: Sequence[float], tasks: Sequence[str], lengths: Sequence[int],
         protocols: Sequence[str] = PROTOCOLS, samples: int = 5, seed: int = 0) -> list[Cell]:
    """Every (policy, ratio, task, length, protocol), task-major so that partial results cover
    whole tasks first; a policy that keeps everything runs once per (task, length) at ratio 0
    (with no compression both protocols are the same run)."""
    cells = []
    for task in tasks:
        for length in lengths:
            for policy in policies:
                if keeps_all(policy):
                    cells.append(Cell(policy, 0.0, task, length, protocols[0], samples, seed))
                    continue
                for protocol in protocols:
                    for ratio in ratios:
                        cells.append(Cell(policy, ratio, task, length, protocol, samples, seed))
    return cells


def result_path(out: Path, cell: Cell, bench: Bench) -> Path:
    return Path(out) / CELLS / f"{cell.key(bench)}.json"


def _finished(path: Path) -> bool:
    try:
        return "score" in json.loads(path.read_text())
    except (OSError, ValueError):
        return False


def pending(cells: Sequence[Cell], bench: Bench, out: Path) -> list[Cell]:
    return [c for c in cells if not _finished(result_path(out, c, bench))]


def write_atomic(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


Runner = Callable[[object, object, Cell, Bench], dict]


def run(model, tokenizer, cells: Sequence[Cell], bench: Bench, out: Path, runner: Runner = run_cell,
        progress: bool = True) -> list[dict]:
    """Run every cell not yet finished under ``out``; returns all the cells' results."""
    out = Path(out)
    todo = pending(cells, bench, out)
    bar = tqdm(total=len(cells), initial=len(cells) - len(todo), desc="eval", unit="cell", disable=not progress,
               dynamic_ncols=True)
    try:
        for group in batches(todo) if runner is run_cell else [[cell] for cell in todo]:
            bar.set_postfix_str(group[0].label() + (f" (+{len(group) - 1} sharing its samples)" if len(group) > 1 else ""))
            results = run_cells(model, tokenizer, group, bench) if runner is run_cell \
                else [runner(model, tokenizer, group[0], bench)]
            for cell, result in zip(group, results):
                write_atomic(result_path(out, cell, bench), result)
                bar.update()
    finally:
        bar.close()
    return load(out, cells, bench)


def batches(cells: Sequence[Cell]) -> list[list[Cell]]:
    """``cells`` grouped by their samples (``sample_group``), each group in the order of its
    first cell and its cells in their order."""
    groups: dict[tuple, list[Cell]] = {}
    for cell in cells:
        groups.setdefault(sample_group(cell), []).append(cell)
    return list(groups.values())


def load(out: Path, cells: Sequence[Cell], bench: Bench) -> list[dict]:
    results = []
    for cell in cells:
        path = result_path(out, cell, bench)
        if _finished(path):
            results.append(json.loads(path.read_text()))
    return results
