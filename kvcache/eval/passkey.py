"""The passkey grid (kvcache/eval/quality.py) as a sweep's cells: ``kvcache eval`` (the default
benchmark) writes each unit of the grid to ``OUT/cells/`` as it finishes, so a rerun resumes, and
runs them serially (sweep.py) or on Ray actors (ray_sweep.py, ``--ray``) with the same results.

A cell is one ``evaluate.Unit`` (the streaming run of a policy and budget, or one passkey point:
protocol, length, depth) with the grid's settings it depends on; the ``Runner`` computes it from
the model, the tokenizer and the texts of ``Bench.texts`` (tokenized once per process).
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass

from .cell import Bench
from .quality import PROTOCOLS, Grid, Unit, report, run_unit, units
from .sample import chat_parts
from .tasks import read_texts


@dataclass(frozen=True)
class PasskeyCell:
    """``evaluate.Unit``'s fields and the grid settings its row depends on."""

    kind: str
    policy: str
    budget: float
    protocol: str | None
    length: int | None
    depth: float | None
    trials: int
    stream_tokens: int
    chunk: int
    seed: int

    @property
    def unit(self) -> Unit:
        return Unit(self.kind, self.policy, self.budget, self.protocol, self.length, self.depth)

    def key(self, bench: Bench) -> str:
        """A file name that identifies the cell and everything its result depends on."""
        spec = json.dumps([asdict(self), bench.spec()], sort_keys=True)
        digest = hashlib.sha256(spec.encode()).hexdigest()[:10]
        policy = self.policy.replace(":", "-")
        where = "" if self.kind == "streaming" else f"-{self.protocol}-{self.length}-{self.depth:g}"
        return f"{self.kind}-{policy}-{self.budget:g}{where}-{digest}"

    def label(self) -> str:
        """What the progress bar shows while the cell runs."""
        where = "" if self.kind == "streaming" else f" {self.protocol} {self.length} {self.depth:g}"
        return f"{self.kind} {self.policy} {self.budget:g}{where}"


def plan(grid: Grid, protocols: tuple[str, ...] = PROTOCOLS) -> list[PasskeyCell]:
    """The grid's cells, in report order (``evaluate.units``)."""
    return [PasskeyCell(u.kind, u.policy, u.budget, u.protocol, u.length, u.depth, grid.trials, grid.stream_tokens,
                        grid.chunk, grid.seed) for u in units(grid, protocols)]


class Runner:
    """Runs a cell (``sweep.Runner``'s signature); keeps the tokenized texts of each ``Bench.texts``
    for the next cell of the same process (a Ray actor takes its own copy)."""

    def __init__(self) -> None:
        self._streams: dict[tuple[str | None, int], object] = {}

    def __getstate__(self) -> dict:
        return {"_streams": {}}  # a copy (a Ray actor's) tokenizes for itself

    def stream(self, tokenizer, texts: str | None):
        """The token stream of ``texts`` (None: the packaged texts); ValueError if there are none."""
        key = (texts, id(tokenizer))
        if key not in self._streams:
            self._streams = {key: (tokenizer, read_texts(texts, tokenizer))}  # (holds the tokenizer: ids stay unique)
        return self._streams[key][1]

    def __call__(self, model, tokenizer, cell: PasskeyCell, bench: Bench) -> dict:
        start = time.perf_counter()
        stream = self.stream(tokenizer, bench.texts)
        row = run_unit(model, tokenizer, cell.unit, stream, stream, trials=cell.trials,
                       stream_tokens=cell.stream_tokens, chunk=cell.chunk, seed=cell.seed,
                       chat=chat_parts(tokenizer) if bench.chat else None)
        score = row["accuracy"] if cell.kind == "passkey" else row["top1_agreement"]
        return {"cell": asdict(cell), "bench": asdict(bench), "score": 100 * score, "row": row,
                "seconds": time.perf_counter() - start}


def grid_report(grid: Grid, cells: list[PasskeyCell], results: list[dict]) -> dict:
    """The grid's report (``evaluate.report``) from every cell's result, in the order of ``cells``."""
    rows = {json.dumps(r["cell"], sort_keys=True): r["row"] for r in results}
    missing = [c for c in cells if json.dumps(asdict(c), sort_keys=True) not in rows]
    if missing:
        raise ValueError(f"{len(missing)} of {len(cells)} cells have no result (first: {missing[0].label()})")
    return report(grid, [(c.unit, rows[json.dumps(asdict(c), sort_keys=True)]) for c in cells])
