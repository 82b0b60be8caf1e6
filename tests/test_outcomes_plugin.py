"""benchmarks/outcomes_plugin.py, the pytest plugin benchmarks/gpu.py counts the suite with: one JSON
line per outcome as it happens, and in an xdist worker an exit after a CUDA error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SUBPROCESS = pytest.mark.cpu_only("runs pytest in a subprocess")

PROBE = '''
from pathlib import Path

import pytest


def test_passes():
    pass


def test_fails():
    assert 1 == 2, "one is not two"


def test_long_failure():
    assert False, "x" * 20000


@pytest.mark.skip(reason="not here")
def test_skipped():
    pass


def test_cuda_error():
    raise RuntimeError("CUDA error: fake")


def test_after():
    Path(__file__).with_name("after-ran").write_text("")
'''


def _run(tmp_path: Path, worker: str | None = None) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """pytest over the probe with the plugin, as an xdist worker named ``worker`` if given."""
    (tmp_path / "test_probe.py").write_text(PROBE)
    outcomes = tmp_path / "outcomes.jsonl"
    env = {key: value for key, value in os.environ.items() if key != "PYTEST_XDIST_WORKER"}
    env["KVCACHE_OUTCOMES"] = str(outcomes)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    if worker is not None:
        env["PYTEST_XDIST_WORKER"] = worker
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "benchmarks.outcomes_plugin",
                           "test_probe.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    lines = [json.loads(line) for line in outcomes.read_text().splitlines()] if outcomes.exists() else []
    return proc, lines


@SUBPROCESS
def test_every_outcome_is_one_json_line(tmp_path):
    proc, lines = _run(tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    tests = {line["nodeid"].split("::")[1]: line for line in lines if "nodeid" in line}
    assert {name: (line["when"], line["outcome"]) for name, line in tests.items()} == {
        "test_passes": ("call", "passed"), "test_fails": ("call", "failed"), "test_long_failure": ("call", "failed"),
        "test_skipped": ("setup", "skipped"), "test_cuda_error": ("call", "failed"), "test_after": ("call", "passed"),
    }
    assert len(tests) == len([line for line in lines if "nodeid" in line])  # passed setups and teardowns left out
    assert "one is not two" in tests["test_fails"]["longrepr"]
    assert "CUDA error: fake" in tests["test_cuda_error"]["longrepr"]
    assert "longrepr" not in tests["test_passes"]
    assert len(tests["test_long_failure"]["longrepr"]) < 4100  # cut to a few KB
    events = [line for line in lines if "event" in line]
    assert [(e["event"], e.get("count", e.get("exitstatus"))) for e in events] == [("collected", 6), ("finished", 1)]
    assert (tmp_path / "after-ran").exists()  # not a worker: a CUDA error does not end the run


@SUBPROCESS
def test_a_worker_ends_after_a_cuda_error(tmp_path):
    proc, lines = _run(tmp_path, worker="gw3")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert not (tmp_path / "after-ran").exists()  # the process ended at the CUDA error, before test_after
    # A worker writes only the failure it ends on (the controller writes the rest), after running
    # on past an ordinary failure.
    assert len(lines) == 1, lines
    (line,) = lines
    assert line["nodeid"].endswith("::test_cuda_error") and line["outcome"] == "failed" and line["worker"] == "gw3"
    assert "CUDA error: fake" in line["longrepr"] and "exit" in line
