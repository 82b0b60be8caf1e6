"""A pytest plugin that writes every test outcome as one JSON line, as it happens.

    KVCACHE_OUTCOMES=outcomes.jsonl python -m pytest -p benchmarks.outcomes_plugin [-n 14] tests

(from the repository root, which ``python -m pytest`` puts on the path). Each line is one report:
``{"nodeid", "when", "outcome", "duration"}``, plus ``"longrepr"`` (its text, cut to
``MAX_TEXT`` characters) for a failure and ``"wasxfail"`` for an expected failure. Passed setup and
teardown phases are left out; calls, failures, errors and skips are all there. ``{"event":
"collected", "count"}`` and ``{"event": "finished", "exitstatus"}`` lines say how many tests were
collected and that the session ended. Each line is appended and closed at once, so a run that is
killed keeps every outcome it reported. benchmarks/gpu.py counts the suite from this file.

Under pytest-xdist the controller writes the lines (workers' reports reach it, and so do the
"worker crashed" reports it makes itself). A worker whose test failed with a CUDA error
("device-side assert", "CUDA error") writes that failure itself, then ends with ``os._exit(1)``:
such an error leaves the process's CUDA context unusable, so every later test on that worker would
fail too; xdist starts a fresh worker instead (``--max-worker-restart``). The failing test's
report has reached the controller by then (this hook runs after xdist's, which sends it).
"""

from __future__ import annotations

import json
import os
import sys
import time

import pytest

ENV = "KVCACHE_OUTCOMES"
MAX_TEXT = 4000
FATAL = ("device-side assert", "CUDA error")


def _write(line: dict) -> None:
    path = os.environ.get(ENV)
    if not path:
        return
    data = (json.dumps(line) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)  # one write with O_APPEND: lines of several processes do not interleave
    finally:
        os.close(fd)


def _worker() -> str | None:
    return os.environ.get("PYTEST_XDIST_WORKER")


def _line(report) -> dict:
    line = {"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
            "duration": round(getattr(report, "duration", 0.0) or 0.0, 4)}
    if hasattr(report, "wasxfail"):
        line["wasxfail"] = True
    if report.failed:
        text = report.longreprtext or ""
        line["longrepr"] = text if len(text) <= MAX_TEXT else text[: MAX_TEXT // 2] + "\n[...]\n" + text[-MAX_TEXT // 2 :]
    return line


@pytest.hookimpl(trylast=True)
def pytest_runtest_logreport(report) -> None:
    worker = _worker()
    if report.when != "call" and report.passed:
        return
    if worker is None:
        _write(_line(report))
        return
    if report.failed and any(marker in (report.longreprtext or "") for marker in FATAL):
        _write({**_line(report), "worker": worker, "exit": "CUDA error: the worker ends, xdist replaces it"})
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def pytest_collectreport(report) -> None:
    if report.failed and _worker() is None:
        _write({"nodeid": report.nodeid, "when": "collect", "outcome": "failed", "duration": 0.0,
                "longrepr": (report.longreprtext or "")[-MAX_TEXT:]})


def pytest_collection_finish(session) -> None:
    if _worker() is None:  # serial: the controller collected; under xdist, the workers did
        _write({"event": "collected", "count": len(session.items), "time": time.time()})


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids) -> None:
    _write({"event": "collected", "count": len(ids), "worker": getattr(node.gateway, "id", None), "time": time.time()})


def pytest_sessionfinish(session, exitstatus) -> None:
    if _worker() is None:
        _write({"event": "finished", "exitstatus": int(exitstatus), "time": time.time()})
