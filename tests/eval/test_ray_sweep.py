"""``kvcache eval --ray``: a sweep's cells (ruler's, and the passkey grid's) as Ray tasks on a
local cluster of 2 CPUs give the serial sweep's results, cell for cell; one model load per
worker, not per cell; a worker that dies costs only its cell, which runs again; a resumed sweep
recomputes no finished cell."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

import kvcache
from kvcache.eval import sweep
from kvcache.eval.cell import Bench, run_cell

ray = pytest.importorskip("ray")
ray_sweep = pytest.importorskip("kvcache.eval.ray_sweep")

# Ray's workers load the model on the CPU (kvcache.load's default): the serial sweep does too.
pytestmark = pytest.mark.cpu_only("Ray workers load the model on the CPU")

BENCH = Bench.make("ruler")


@pytest.fixture(scope="module")
def cluster():
    # Workers unpickle this module's runners by value: they cannot import the tests.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=100 * 2**20)
    yield
    ray.shutdown()


def cells():
    return sweep.plan(["dense", "h2o"], [0.5], ["niah_single_1", "niah_single_2"], [512],
                      ["query_agnostic", "query_aware"], samples=1, seed=0)


def noting(log: str, die_on: str | None):
    """A runner that notes (process, model object, cell) in ``log`` and, the first time it meets
    the cell ``die_on``, kills its own process mid-cell."""

    def runner(model, tokenizer, cell, bench):
        key = cell.key(bench)
        with open(log, "a") as f:
            f.write(json.dumps([os.getpid(), id(model), key]) + "\n")
        marker = Path(log + ".died")
        if key == die_on and not marker.exists():
            marker.write_text("")
            os._exit(1)
        return run_cell(model, tokenizer, cell, bench)

    return runner


def refuse(model, tokenizer, cell, bench):
    raise AssertionError(f"{cell.key(bench)} was finished and must not run again")


def without_time(results):
    """Results less how they were reached: seconds (a cell's and a sample's), and whether a
    sample's first chunk was replayed from a prefill shared with other cells (a serial sweep
    shares; Ray's workers run cells apart)."""
    def sample(s):
        return {k: v for k, v in s.items() if k not in ("prefill", "seconds")} if isinstance(s, dict) else s

    return [{k: ([sample(s) for s in v] if k == "samples" else v) for k, v in r.items() if k != "seconds"}
            for r in results]


def test_ray_sweep_equals_the_serial_sweep(cluster, tiny_dir, tokenizer, tmp_path):
    grid = cells()
    model = kvcache.load(tiny_dir, dtype=torch.float32)  # on the CPU, as the workers load it
    serial = sweep.run(model, tokenizer, grid, BENCH, tmp_path / "serial", progress=False)
    log = str(tmp_path / "ran.jsonl")
    victim = grid[2].key(BENCH)
    results = ray_sweep.run(tiny_dir, grid, BENCH, tmp_path / "ray", workers=2, runner=noting(log, victim),
                            progress=False)
    assert len(results) == len(grid) == len(serial)
    assert without_time(results) == without_time(serial)
    for a, b in zip(sorted((tmp_path / "serial" / "cells").iterdir()), sorted((tmp_path / "ray" / "cells").iterdir())):
        assert a.name == b.name and without_time([json.loads(a.read_text())]) == without_time([json.loads(b.read_text())])
    ran = [json.loads(line) for line in Path(log).read_text().splitlines()]
    keys = [k for _, _, k in ran]
    # The killed cell ran twice, every other cell once.
    assert keys.count(victim) == 2 and sorted(set(keys)) == sorted(c.key(BENCH) for c in grid)
    assert len(keys) == len(grid) + 1
    # One model per worker process: 2 workers, and the killed one's restart.
    assert len({(pid, model) for pid, model, _ in ran}) <= 3 < len(grid)

    # A resumed sweep finds every cell finished: nothing runs (on a cluster or serially).
    again = ray_sweep.run(tiny_dir, grid, BENCH, tmp_path / "ray", workers=2, runner=refuse, progress=False)
    assert without_time(again) == without_time(results)


def test_a_cells_own_error_ends_the_sweep(cluster, tiny_dir, tmp_path):
    with pytest.raises(AssertionError, match="must not run again"):
        ray_sweep.run(tiny_dir, cells()[:2], BENCH, tmp_path, workers=1, runner=refuse, progress=False)


def test_cli_eval_ray_passkey_equals_the_serial_run_and_resumes(cluster, tiny_dir, tmp_path, capsys, monkeypatch):
    """``kvcache eval --ray`` with the default benchmark: the serial report, every unit of the grid
    a cell in OUT/cells; a rerun finds them all and runs nothing. (RULER's cells on Ray are
    compared with the serial sweep above; the command writes one report for every benchmark.)"""
    from kvcache.cli import main
    from kvcache.eval import passkey

    flags = ["eval", "--model", str(tiny_dir), "--policies", "dense,window,h2o:int4", "--budgets", "0.5",
             "--lengths", "64", "--depths", "0,1", "--trials", "1", "--stream-tokens", "64", "--no-plots",
             "--threads", "1"]
    assert main([*flags, "--out", str(tmp_path / "serial")]) == 0
    assert main([*flags, "--out", str(tmp_path / "ray"), "--ray"]) == 0, capsys.readouterr().err
    reports = [json.loads((tmp_path / d / "report.json").read_text()) for d in ("serial", "ray")]
    assert len(reports[0]["streaming"]) == 3 and len(reports[0]["passkey"]) == 3 * 2 * 2
    assert {k: reports[1][k] for k in ("streaming", "passkey")} == {k: reports[0][k] for k in ("streaming", "passkey")}
    cells = sorted(p.name for p in (tmp_path / "ray" / "cells").iterdir())
    assert cells == sorted(p.name for p in (tmp_path / "serial" / "cells").iterdir()) and len(cells) == 15
    capsys.readouterr()
    # Resumed: every cell is there, so none runs (no worker starts: the driver finds them all).
    monkeypatch.setattr(passkey.Runner, "__call__", lambda *a, **k: pytest.fail("a finished cell ran again"))
    assert main([*flags, "--out", str(tmp_path / "ray"), "--ray"]) == 0
    assert "15 cells, 15 already in" in capsys.readouterr().err
    assert json.loads((tmp_path / "ray" / "report.json").read_text())["passkey"] == reports[0]["passkey"]
