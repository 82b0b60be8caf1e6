"""The passkey grid as a sweep's cells: the same report as the grid run in one process, every
unit its own cell with its own key, and an interrupted run that resumes without recomputing a
finished cell."""

from __future__ import annotations

import json

import pytest

from kvcache.eval import passkey, sweep
from kvcache.eval.cell import Bench, run_cell
from kvcache.eval.quality import Grid, evaluate, units
from kvcache.eval.tasks import read_texts

BENCH = Bench.make("passkey")


def small_grid(**changes) -> Grid:
    settings = dict(policies=["dense", "window", "h2o:int4"], budgets=[0.5], lengths=[64], depths=[0.0, 1.0],
                    trials=1, stream_tokens=64, chunk=16)
    return Grid(**{**settings, **changes})


def rows(report: dict) -> dict:
    return {"streaming": report["streaming"], "passkey": report["passkey"]}


def test_a_cell_per_unit_each_with_its_own_key():
    grid = small_grid()
    cells = passkey.plan(grid)
    assert [c.unit for c in cells] == units(grid)
    # dense once at full budget, the others at each budget: streaming, then 2 protocols x 2 depths.
    assert len(cells) == 3 * (1 + 2 * 2)
    assert len({c.key(BENCH) for c in cells}) == len(cells)
    # Every setting a row depends on changes the key: trials, tokens streamed, chunk, seed, texts.
    cell = cells[1]
    others = [passkey.plan(small_grid(**change))[1] for change in
              (dict(trials=2), dict(stream_tokens=65), dict(chunk=8), dict(seed=1))]
    keys = {cell.key(BENCH), cell.key(Bench.make("passkey", texts="elsewhere"))} | {c.key(BENCH) for c in others}
    assert len(keys) == 6


def test_the_cells_give_the_grid_run_in_one_process(tiny, tokenizer, tmp_path):
    grid = small_grid()
    stream = read_texts(None, tokenizer)
    alone = evaluate(tiny, tokenizer, stream, stream, grid, progress=False)
    cells = passkey.plan(grid)
    results = sweep.run(tiny, tokenizer, cells, BENCH, tmp_path, runner=passkey.Runner(), progress=False)
    assert rows(passkey.grid_report(grid, cells, results)) == rows(alone)
    assert len(list((tmp_path / sweep.CELLS).iterdir())) == len(cells)


def test_an_interrupted_grid_resumes_where_it_stopped(tiny, tokenizer, tmp_path):
    grid = small_grid()
    cells = passkey.plan(grid)
    ran = []

    class Interrupted(Exception):
        pass

    def stops_after(n):
        runner = passkey.Runner()

        def run(model, tok, cell, bench):
            if len(ran) == n:
                raise Interrupted
            ran.append(cell.key(bench))
            return runner(model, tok, cell, bench)

        return run

    with pytest.raises(Interrupted):
        sweep.run(tiny, tokenizer, cells, BENCH, tmp_path, runner=stops_after(4), progress=False)
    assert len(sweep.pending(cells, BENCH, tmp_path)) == len(cells) - 4
    results = sweep.run(tiny, tokenizer, cells, BENCH, tmp_path, runner=stops_after(len(cells)), progress=False)
    # Each cell ran once over both runs, and the report is the uninterrupted one.
    assert sorted(ran) == sorted(c.key(BENCH) for c in cells)
    fresh = sweep.run(tiny, tokenizer, cells, BENCH, tmp_path / "fresh", runner=passkey.Runner(), progress=False)
    assert rows(passkey.grid_report(grid, cells, results)) == rows(passkey.grid_report(grid, cells, fresh))


def test_a_report_needs_every_cell_and_passkey_cells_need_their_runner(tiny, tokenizer):
    grid = small_grid()
    cells = passkey.plan(grid)
    runner = passkey.Runner()
    results = [runner(tiny, tokenizer, c, BENCH) for c in cells[:2]]
    assert json.loads(json.dumps(results)) == results  # JSON as the sweep writes it
    with pytest.raises(ValueError, match=f"{len(cells) - 2} of {len(cells)} cells have no result"):
        passkey.grid_report(grid, cells, results)
    with pytest.raises(ValueError, match="passkey.Runner"):
        run_cell(tiny, tokenizer, cells[0], BENCH)
