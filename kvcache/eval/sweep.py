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
    known(out, cell, ...)   the outcomes of a cell's samples that some file already holds

Results live in ``OUT/cells/<cell key>.json``; the key (cell.py) hashes every setting the result
depends on, so a rerun with the same arguments finds the finished cells, and a changed setting
runs afresh. A file is written to a temporary file and renamed, so it is never torn. While a cell
runs, its file holds the samples finished so far and no score; a rerun takes them up and runs
only the rest. A sample depends on its index and the seed, not on how many samples a cell has,
so raising ``--samples`` runs only the new ones: the outcomes of the same cell with another
sample count are reused (``known``).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path

from tqdm import tqdm

from .cell import BATCH, PROTOCOLS, Bench, Cell, keeps_all, run_cell, run_cells, sample_group
from .shared import SharedPrefill

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
        progress: bool = True, batch: int = BATCH) -> list[dict]:
    """Run every cell not yet finished under ``out``; returns all the cells' results. ``batch``:
    with ``run_cell``, how many cells' answers to a sample decode together (``run_cells``)."""
    out = Path(out)
    todo = pending(cells, bench, out)
    bar = tqdm(total=len(cells), initial=len(cells) - len(todo), desc="eval", unit="cell", disable=not progress,
               dynamic_ncols=True)
    shared = SharedPrefill()  # one for every group: each cache configuration checked once a sweep
    try:
        for group in batches(todo) if runner is run_cell else [[cell] for cell in todo]:
            label = group[0].label() + (f" (+{len(group) - 1} sharing its samples)" if len(group) > 1 else "")
            bar.set_postfix_str(label)
            if runner is run_cell:
                def save(partials: list[dict], group=group, label=label) -> None:
                    for cell, result in zip(group, partials):
                        write_atomic(result_path(out, cell, bench), result)
                    bar.set_postfix_str(f"{label}, sample {len(partials[0]['samples'])}/{group[0].samples} done")

                # (A cell alone gains nothing from a recording: it would replay it once.)
                results = run_cells(model, tokenizer, group, bench, [known(out, c, bench) for c in group], save,
                                    shared if len(group) > 1 else None, batch)
            else:
                results = [runner(model, tokenizer, group[0], bench)]
            for cell, result in zip(group, results):
                write_atomic(result_path(out, cell, bench), result)
                bar.update()
    finally:
        bar.close()
    return load(out, cells, bench)


def known(out: Path, cell: Cell, bench: Bench) -> list[dict]:
    """The outcomes of ``cell``'s samples that files under ``out`` already hold: its own partial
    result (an interrupted run), or a result, finished or not, of the same cell with another
    sample count. Outcomes carry the seconds their cell spent on them (an older file's seconds
    are shared out evenly among its samples)."""
    spec = asdict(cell)
    found: dict[int, dict] = {}
    stem = cell.key(bench).rsplit("-", 1)[0]  # the key without its hash: same for any sample count
    for path in sorted((Path(out) / CELLS).glob(f"{stem}-*.json")):
        try:
            data = json.loads(path.read_text())
            same = {**data["cell"], "samples": cell.samples} == spec and Bench.spec_of(data["bench"]) == bench.spec()
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not a cell result: the sweep never wrote it
        if not same or data.get("skipped"):
            continue
        outcomes = data.get("samples") or []
        share = data.get("seconds", 0.0) / max(1, len(outcomes))
        for o in outcomes:
            if o["index"] < cell.samples:
                found.setdefault(o["index"], {**o, "seconds": o.get("seconds", share)})
    return [found[i] for i in sorted(found)]


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
