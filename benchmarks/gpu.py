"""Every GPU figure of docs/gpu.md in one command: the test suite on the device, then decode,
policies under compile, packed-code attention and drift, each benchmark the script (or module) of
its own name (benchmarks/decode.py, policies.py, quantized.py, kvcache.eval.drift) with the options this
script records next to its figures. Writes one JSON and one markdown table; both are rewritten
after every part, every decode cell, every policy, each packed sub-part and each drift dtype, so a
run cut short keeps what it measured.

Parts (``--parts``, default all, in this order):
    suite     ``KVCACHE_TEST_DEVICE=<device> python -m pytest tests``, on a GPU under pytest-xdist
              (``-n`` from the CPU count, ``--max-worker-restart``, ``--timeout 60`` with
              pytest-timeout) when it is installed, serially otherwise; the plugin
              benchmarks/outcomes_plugin.py writes each outcome to ``suite-outcomes.jsonl`` as it
              happens (a run that is stopped keeps them), and ends a worker that a CUDA error left
              unusable (xdist replaces it). Counts, failed test ids and the commonest failures.
    decode    decode.py at the 1B and 8B shapes (random weights, bfloat16) with 1k prompts at batch
              1, 16 and 64 and 32k prompts at batch 1: kvcache eager and compiled against
              transformers eager and transformers' static cache compiled, the read-bandwidth
              roofline and both compile times, all in this run.
    policies  policies.py under compile (captured decode steps) at cache_length 2048 after an 8k
              prompt, on the 1B shape, one policy at a time against dense.
    packed    quantized.py at 32k tokens, batch 16, bfloat16: one layer's decode step over 8- and
              4-bit packed codes (the Triton kernel on CUDA) against SDPA over bfloat16 keys, then
              end-to-end decode of the 1B shape over int8/int4/int2 against dense.
    drift     ``kvcache drift`` on the device (kvcache.eval.drift.report) for the bundled model in
              bfloat16 and float32: cached vs uncached, chunked, a row batched with padding vs
              alone (batch invariance), reused prefixes; kvcache against transformers on the
              same weights.

Budgets. Each part runs under a wall-clock budget (``BUDGETS``; ``--budget-s PART=S[,PART=S...]``
changes some): a part still running at its budget is stopped (its process group killed), recorded
as "timed out after S s" and keeps what it had written; the parts after it still run. The suite is
pytest's process; the benchmark parts run in this script with ``--child``, on a GPU one process
per part (a CUDA error, memory or compiled graphs of one part do not reach the next), on the CPU
one process for them all, with the suite alongside. A part's process starts while the part before
it runs, loads torch, transformers and the compiler, and waits for its turn, from which its budget
counts. The defaults fit a ``--quick`` run on one GPU into 9 minutes.

``--quick`` keeps the cells the floors are judged on (1k prompts: 1B at batch 1 and 16, 8B at
batch 1), the floor policies, dense and dense:int4 end to end, fewer steps and repeats.
``--device cpu --quick`` is a smoke test of this script on tiny shapes (CI runs it): its figures
mean nothing.

    python benchmarks/gpu.py [--quick] [--device cuda] [--parts suite,decode,policies,packed,drift]
                             [--budget-s suite=180,decode=150] [--out DIR]

Exit status: 0 when every part ran to its end and the suite passed (a floor missed is reported,
not an error), 1 otherwise.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import xml.etree.ElementTree as ET
from pathlib import Path

import decode  # benchmarks/decode.py: the script's own folder is on the path
import policies
import quantized
import torch

import kvcache
from kvcache.eval import drift
from kvcache.runtime.threads import set_threads

ROOT = Path(__file__).resolve().parent.parent
PARTS = ["suite", "decode", "policies", "packed", "drift"]

# Seconds per part. "gpu-quick" sums to 535 s: with each process's start and the stops' grace,
# under 9 minutes, for a machine lent 10 minutes a run. The others only stop a part that hangs.
BUDGETS = {
    "gpu-quick": {"suite": 170, "decode": 200, "policies": 75, "packed": 50, "drift": 40},
    "gpu-full": {"suite": 1800, "decode": 3600, "policies": 1200, "packed": 1200, "drift": 600},
    "cpu": {"suite": 600, "decode": 600, "policies": 600, "packed": 600, "drift": 600},
}
STOP_GRACE_S = 5  # SIGTERM, then SIGKILL this much later
SUITE_TEST_TIMEOUT_S = 60  # pytest-timeout's limit per test on a GPU
MAX_FAILED_LISTED = 100  # in gpu.md; the JSON lists every one

# Floors of docs/gpu.md (H100, bfloat16, batch 1, 1k prompt unless said).
DECODE_SPEEDUP_FLOOR = 1.3  # kvcache compiled / transformers' static cache compiled
ROOFLINE_FLOOR = 0.70  # 8B, kvcache compiled
PACKED_FLOORS = {"int8": 1.5, "int4": 2.5}  # layer step, speed-up over bfloat16 SDPA
PACKED_MODEL_FLOOR = 1.3  # end-to-end dense:int4 over dense


def log(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


def fail(message: str):
    raise ValueError(message)


# ---- the plan: each part's options, as the benchmark scripts' command lines --------------------------


def decode_runs(device: str, quick: bool) -> list[list[str]]:
    """decode.py command lines, one per group of cells that share a prompt length and batches."""
    # A GPU's read bandwidth is the 1 GiB probe's; a probe the size of one step's reads (8B at batch
    # 64: 25 GB) would only take memory.
    common = ["--device", device, "--compiled", "--no-working-set-bandwidth"]
    if device == "cpu":
        # One batch of 2 rows: the batched path (batch 1 is the same code), each engine compiled once.
        return [common + ["--shapes", "tiny@64", "--batch", "2", "--new-tokens", "8", "--repeats", "1",
                          "--bandwidth-mib", "64", "--threads", "1"]]
    if quick:
        # 8B first: two H100 runs measured the 1B cells and ran out of the part's time before 8B.
        timing = ["--new-tokens", "32", "--repeats", "2"]
        return [common + timing + ["--shapes", "8B@1k", "--batch", "1"],
                common + timing + ["--shapes", "1B@1k", "--batch", "1,16"]]
    # Runs of one model follow each other: run_decode builds it once for both.
    timing = ["--new-tokens", "64", "--repeats", "3"]
    return [common + timing + ["--shapes", "1B@1k", "--batch", "1,16,64"],
            common + timing + ["--shapes", "1B@32k", "--batch", "1"],
            common + timing + ["--shapes", "8B@1k", "--batch", "1,16,64"],
            common + timing + ["--shapes", "8B@32k", "--batch", "1"]]


def policies_run(device: str, quick: bool) -> list[str]:
    if device == "cpu":
        return ["--device", "cpu", "--compiled", "--model", "tiny", "--policies", "window,h2o", "--group-size", "1",
                "--cache-length", "64", "--prompt", "256", "--steps", "4", "--repeats", "1", "--threads", "1"]
    # The floors' policies first (window, sink <= 1.05x dense; h2o, tova, snapkv <= 1.2x): each is
    # a group of its own, its figure saved once timed, so a part stopped at its budget keeps the
    # first ones. h2o comes after tova and snapkv: its 8k-token prefill weighs every query (an H100
    # run's 75 s ended before it printed), theirs only a few.
    floor_policies = "window,sink,tova,snapkv,h2o,sink_absolute"
    # Every policy whose step can be captured (batched eviction, the _reserve64 variants, is not).
    captured = [name for name, options in policies.POLICIES.items() if name != "dense" and not options.get("reserve")]
    chosen = floor_policies if quick else ",".join(dict.fromkeys(floor_policies.split(",") + captured))
    steps, repeats = ("32", "2") if quick else ("64", "3")
    return ["--device", device, "--compiled", "--model", "1B", "--dtype", "bfloat16", "--policies", chosen,
            "--group-size", "1", "--cache-length", "2048", "--prompt", "8192", "--steps", steps, "--repeats", repeats]


def packed_runs(device: str, quick: bool) -> dict[str, list[str]]:
    """quantized.py command lines: the layer, then the model (run apart, so that one failing keeps the other)."""
    if device == "cpu":
        common = ["--device", "cpu", "--storages", "int8,int4", "--batch", "2", "--speed-tokens", "1024",
                  "--steps", "2", "--repeats", "1", "--new-tokens", "3", "--model", "tiny"]
    else:
        steps, repeats, new = ("8", "2", "8") if quick else ("16", "3", "16")
        common = ["--device", device, "--dtype", "bfloat16", "--storages", "int8,int4,int2", "--batch", "16",
                  "--speed-tokens", "32768", "--steps", steps, "--repeats", repeats, "--new-tokens", new,
                  "--model", "1B"]
        if quick:  # the floor's pair: a 32k prompt at batch 16 is prefilled once per cache
            common += ["--caches", "dense,dense:int4"]
    return {"layer": common + ["--parts", "layer"], "model": common + ["--parts", "model"]}


def drift_setup(device: str) -> tuple[list[str], drift.Setup]:
    """The dtypes and prompt of the drift part: the CLI's defaults on a GPU, a short prompt on the CPU."""
    if device == "cpu":
        return ["float32"], drift.Setup(tokens=64, chunk=16, prefix=20, steps=4)
    return ["bfloat16", "float32"], drift.Setup()


def suite_workers(device: str) -> int | None:
    """pytest-xdist workers for the suite: on a GPU one per CPU core less two, at most 14 (each
    holds a CUDA context); None (serial) on the CPU, where the smoke test runs a few tests."""
    if device == "cpu":
        return None
    return max(1, min(14, (os.cpu_count() or 1) - 2))


def suite_command(device: str, quick: bool, junit: Path, workers: int | None = None,
                  test_timeout: int | None = None) -> list[str]:
    # On the CPU the suite itself is CI's first step: the smoke test runs the device fixture's tests.
    tests = ["tests/test_test_device.py"] if device == "cpu" and quick else ["tests"]
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "benchmarks.outcomes_plugin",
               f"--junitxml={junit}"]
    if workers is not None:
        command += ["-n", str(workers), "--max-worker-restart", "400"]
    if test_timeout is not None:
        command += ["--timeout", str(test_timeout)]
    return command + tests


def parse_budgets(text: str, error) -> dict[str, float]:
    """``PART=S[,PART=S...]`` as {part: seconds}; ``error(message)`` (argparse's) when it is not that."""
    budgets: dict[str, float] = {}
    for item in (item.strip() for item in text.split(",")):
        if not item:
            continue
        part, sep, value = item.partition("=")
        part = part.strip()
        if not sep:
            error(f"--budget-s {text!r}: {item!r} is not PART=SECONDS (e.g. suite=200,decode=150)")
        if part not in PARTS:
            error(f"--budget-s {text!r}: unknown part {part!r}; choose from {','.join(PARTS)}")
        if part in budgets:
            error(f"--budget-s {text!r}: {part} is given twice")
        try:
            seconds = float(value)
        except ValueError:
            error(f"--budget-s {text!r}: {part}'s budget {value.strip()!r} is not a number of seconds")
        if not seconds > 0 or seconds == float("inf"):
            error(f"--budget-s {text!r}: {part}'s budget must be a positive number of seconds, not {value.strip()!r}")
        budgets[part] = seconds
    if not budgets:
        error(f"--budget-s {text!r}: give PART=SECONDS, e.g. suite=200,decode=150")
    return budgets


def default_budgets(device: torch.device, quick: bool) -> dict[str, float]:
    return dict(BUDGETS["cpu" if device.type == "cpu" else "gpu-quick" if quick else "gpu-full"])


# ---- processes under a budget --------------------------------------------------------------------------

_RUNNING: set[subprocess.Popen] = set()


def _stop(proc: subprocess.Popen) -> None:
    """Ends ``proc`` and what it started (its own process group): SIGTERM, then SIGKILL."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=STOP_GRACE_S)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # whatever of the group is left
    except ProcessLookupError:
        pass
    proc.wait()


def wait_limited(proc: subprocess.Popen, budget: float | None) -> tuple[int, bool]:
    """Waits for ``proc`` at most ``budget`` seconds, then stops it: (exit status, timed out). Stops
    it too when this process is interrupted."""
    try:
        proc.wait(timeout=budget)
        return proc.returncode, False
    except subprocess.TimeoutExpired:
        _stop(proc)
        return proc.returncode, True
    except BaseException:
        _stop(proc)
        raise
    finally:
        _RUNNING.discard(proc)


def start(command: list[str], **popen) -> subprocess.Popen:
    """``command`` in a process group of its own (what it starts ends with it when it is stopped)."""
    proc = subprocess.Popen(command, cwd=ROOT, start_new_session=True, **popen)
    _RUNNING.add(proc)
    return proc


def _on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)  # unwinds wait_limited and main, which stop the parts' processes


def timed_out(budget: float) -> str:
    return f"timed out after {budget:g} s"


# ---- the suite --------------------------------------------------------------------------------------------


def failure_message(text: str) -> str:
    """The line a failure's text ends on (its last ``E`` line), for counting failures of one kind."""
    if "crashed while running" in text:
        return "an xdist worker ended while running the test (a crash, or the plugin's exit after a CUDA error)"
    errors = [line[1:].strip() for line in text.splitlines() if line.startswith("E ")]
    lines = errors or text.strip().splitlines() or [""]
    return lines[-1][:200]


def read_outcomes(path: Path) -> dict:
    """The suite's counts from the outcomes plugin's lines, one outcome per test: failed (its call
    failed, or xdist reported its worker dead), error (its setup or teardown failed), xfailed,
    skipped or passed; the failed tests' ids and the ten commonest failure messages."""
    by_test: dict[str, list[dict]] = {}
    collected, finished = 0, False
    for text in path.read_text().splitlines():
        try:
            line = json.loads(text)
        except json.JSONDecodeError:  # a line cut by a kill
            continue
        if line.get("event") == "collected":
            collected = max(collected, line["count"])
        elif line.get("event") == "finished":
            finished = True
        elif "nodeid" in line:
            by_test.setdefault(line["nodeid"], []).append(line)
    outcomes: dict[str, str] = {}
    messages: collections.Counter = collections.Counter()
    for nodeid, lines in by_test.items():
        failed = [line for line in lines if line["outcome"] == "failed"]
        # The line that decides: a failed call, then a failed setup or teardown, then xdist's report.
        failed.sort(key=lambda line: {"call": 0, "setup": 1, "teardown": 1, "collect": 1}.get(line["when"], 2))
        if failed:
            outcomes[nodeid] = "error" if failed[0]["when"] in ("setup", "teardown", "collect") else "failed"
            messages[failure_message(failed[0].get("longrepr", ""))] += 1
        elif any(line["outcome"] == "skipped" for line in lines):
            outcomes[nodeid] = "xfailed" if any(line.get("wasxfail") for line in lines) else "skipped"
        else:
            outcomes[nodeid] = "passed"
    counts = collections.Counter(outcomes.values())
    return {
        "tests": max(collected, len(outcomes)), "passed": counts["passed"], "failures": counts["failed"],
        "errors": counts["error"], "skipped": counts["skipped"], "xfailed": counts["xfailed"],
        "not_reported": max(0, collected - len(outcomes)), "finished": finished,
        "failed": [nodeid for nodeid, outcome in outcomes.items() if outcome in ("failed", "error")],
        "commonest_failures": [{"count": n, "message": m} for m, n in messages.most_common(10)],
    }


def read_junit(junit: Path) -> dict:
    suite = ET.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    failed = [f"{case.get('classname')}::{case.get('name')}" for case in suite.iter("testcase")
              if case.find("failure") is not None or case.find("error") is not None]
    return {**counts, "failed": failed}


def start_suite(device: str, quick: bool, out: Path, budget: float | None) -> dict:
    """Starts the suite's pytest (``finish_suite`` waits for it): what ``finish_suite`` needs."""
    junit, outcomes, log_path = out / "suite.xml", out / "suite-outcomes.jsonl", out / "suite.log"
    for path in (junit, outcomes):
        path.unlink(missing_ok=True)
    workers, note = suite_workers(device), None
    if workers is not None and importlib.util.find_spec("xdist") is None:
        workers, note = None, "pytest-xdist is not installed: the suite ran serially (pip install pytest-xdist)"
        log(f"suite: {note}")
    test_timeout = None
    if device != "cpu" and importlib.util.find_spec("pytest_timeout") is not None:
        test_timeout = SUITE_TEST_TIMEOUT_S
    command = suite_command(device, quick, junit, workers, test_timeout)
    # The repository root on the path: the plugin is benchmarks.outcomes_plugin (the benchmarks
    # folder itself would shadow packages such as vllm with scripts of the same name).
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "KVCACHE_TEST_DEVICE": device, "KVCACHE_OUTCOMES": str(outcomes), "PYTHONPATH": path}
    shown = f"KVCACHE_TEST_DEVICE={device} python " + " ".join(command[1:])
    log(f"suite: {shown} (budget {budget:g} s)" if budget else f"suite: {shown}")
    with log_path.open("w") as stream:
        proc = start(command, stdout=stream, stderr=subprocess.STDOUT, env=env)
    state = {"proc": proc, "began": time.perf_counter(), "budget": budget, "command": shown, "workers": workers,
             "note": note, "junit": junit, "outcomes": outcomes, "log": log_path}

    # A clock of its own: on the CPU the suite runs alongside the other parts, finish_suite comes later.
    def note_the_end() -> None:
        proc.wait()
        state.setdefault("ended", time.perf_counter())

    def stop_at_budget() -> None:
        if proc.poll() is None:
            state["stopped"] = True
            _stop(proc)

    threading.Thread(target=note_the_end, daemon=True).start()
    if budget is not None:
        state["timer"] = threading.Timer(budget, stop_at_budget)
        state["timer"].daemon = True
        state["timer"].start()
    return state


def finish_suite(state: dict) -> dict:
    """Waits for the suite (``start_suite``) until its budget is spent, then reads its outcomes."""
    budget, outcomes, junit, log_path = state["budget"], state["outcomes"], state["junit"], state["log"]
    try:
        returncode, _ = wait_limited(state["proc"], None)  # stopped at its budget by start_suite's timer
    finally:
        if "timer" in state:
            state["timer"].cancel()
    stopped = state.get("stopped", False)
    seconds = round(state.get("ended", time.perf_counter()) - state["began"], 1)
    result = {"command": state["command"], "returncode": returncode, "seconds": seconds,
              "workers": state["workers"] or 1, "log": str(log_path), "outcomes": str(outcomes)}
    if state["note"]:
        result["note"] = state["note"]
    if stopped:
        result["timed_out"] = timed_out(budget)
    if outcomes.exists():
        result.update(read_outcomes(outcomes))
    elif junit.exists():
        result.update(read_junit(junit))
    if "tests" not in result or not result["tests"]:
        result["tail"] = log_path.read_text()[-2000:]
    log(f"suite: {result.get('passed')} passed, {result.get('failures')} failed, {result.get('errors')} errors, "
        f"{result.get('skipped')} skipped of {result.get('tests')} in {seconds} s (exit {returncode}"
        f"{', ' + result['timed_out'] if stopped else ''})")
    return result


# ---- the other parts, each in a process of its own (``--child``) -----------------------------------------


def run_decode(device: str, quick: bool, out: dict, save) -> None:
    """Every cell into ``out``, ``save()`` after each; a command line that fails leaves its traceback
    under ``errors`` and the others run."""
    out.update({"commands": [], "bandwidth_GBps": [], "cells": {}, "errors": {}})

    def on_cell(name: str, figures: dict) -> None:
        out["cells"][name] = figures
        save()

    models: dict = {}  # the last model built, used again by the next run of the same shape's model
    for argv in decode_runs(device, quick):
        command = "python benchmarks/decode.py " + " ".join(argv)
        out["commands"].append(command)
        log(command)
        save()
        try:
            result = decode.run(decode.parser().parse_args(argv), fail, on_cell, models)
        except Exception:
            out["errors"][command.split("--shapes ")[1].split()[0]] = traceback.format_exc()
            log(f"decode failed:\n{traceback.format_exc()}")
            models.clear()
            decode.free_memory(decode.parse_device(device, fail))
            continue
        out["bandwidth_GBps"].append(result["bandwidth_GBps"])
        out["cells"].update(result["shapes"])
        save()


def run_policies(device: str, quick: bool, out: dict, save) -> None:
    """The report as it stands after every group of policies into ``out``, ``save()`` after each."""
    argv = policies_run(device, quick)
    out["command"] = "python benchmarks/policies.py " + " ".join(argv)
    log(out["command"])
    save()

    def on_group(report: dict) -> None:
        out.update(report)
        save()

    out.update(policies.run(policies.parser().parse_args(argv), fail, on_group))


def run_packed(device: str, quick: bool, out: dict, save) -> None:
    """The layer and the model figures; a sub-part that fails leaves its traceback under ``errors``."""
    out.update({"commands": [], "errors": {}})
    for sub, argv in packed_runs(device, quick).items():
        out["commands"].append("python benchmarks/quantized.py " + " ".join(argv))
        log(out["commands"][-1])
        save()
        try:
            result = quantized.run(quantized.parser().parse_args(argv), fail)
        except Exception:
            out["errors"][sub] = traceback.format_exc()
            log(f"packed {sub} failed:\n{out['errors'][sub]}")
            continue
        out.update({key: value for key, value in result.items() if key in ("layer_speed", "model_speed")})
        save()


def run_drift(device: str, quick: bool, out: dict, save) -> None:
    """One dtype at a time (``save()`` after each), into one report."""
    dtypes, setup = drift_setup(device)
    for dtype in dtypes:
        log(f"drift: the bundled model, {dtype} on {device}")
        report = drift.report(None, [dtype], device=device, setup=setup)
        results = out.get("results", []) + report["results"]
        out.update(report, results=results)
        save()


RUNNERS = {"decode": run_decode, "policies": run_policies, "packed": run_packed, "drift": run_drift}


# ---- floors and the table ------------------------------------------------------------------------------


def floors(report: dict) -> list[dict]:
    """Every floor the report has the figures for: what, the floor, the value, met."""
    rows = []

    def add(what: str, floor: float, value: float | None, at_most: bool = False) -> None:
        met = None if value is None else (value <= floor if at_most else value >= floor)
        rows.append({"floor": what, "bound": f"{'<=' if at_most else '>='} {floor:.3g}", "value": value, "met": met})

    for name, cell in report.get("decode", {}).get("cells", {}).items():
        if "kvcache_compiled" not in cell or cell["prompt_tokens"] > 1024:
            continue
        model, batch = cell["model"]["key"], cell["batch_size"]
        kc, tc = cell["kvcache_compiled"], cell["transformers_static_compiled"]
        if batch in (1, 16):
            add(f"{name}: kvcache compiled / transformers static compiled decode", DECODE_SPEEDUP_FLOOR,
                cell["decode_ratio_compiled_kvcache_over_transformers"])
        if model == "8B" and batch == 1:
            add(f"{name}: kvcache compiled share of the roofline", ROOFLINE_FLOOR,
                kc["decode_tok_s"] / cell["roofline"]["roofline_tok_s"])
        add(f"{name}: compile s, kvcache / transformers", 1.0, kc["compile_s"] / tc["compile_s"], at_most=True)
    for length, rows_ in report.get("policies", {}).get("results", {}).items():
        for name, row in rows_.items():
            if "floor" in row:
                add(f"policies @{length} compiled: {name} / dense step", row["floor"], row["vs_dense"], at_most=True)
    packed = report.get("packed", {})
    steps = packed.get("layer_speed", {}).get("steps", {})
    for storage, floor in PACKED_FLOORS.items():
        if storage in steps:
            add(f"packed {storage} layer step: speed-up over SDPA", floor, steps[storage]["speedup_vs_sdpa"])
    per_token = packed.get("model_speed", {}).get("per_token", {})
    if "dense:int4" in per_token:
        add("end-to-end dense:int4 decode: speed-up over dense", PACKED_MODEL_FLOOR,
            per_token["dense:int4"]["speedup_vs_full_precision"])
    # Drift no larger than transformers' on the same weights, comparison by comparison.
    cells = {(r["comparison"], r["engine"], r["dtype"]): r for r in report.get("drift", {}).get("results", [])}
    for (comparison, engine, dtype), mine in cells.items():
        theirs = cells.get((comparison, "transformers", dtype))
        if engine == "kvcache" and theirs and mine["max_abs"] is not None and theirs["max_abs"] is not None:
            add(f"drift {dtype}, {comparison}: kvcache's max abs logit difference (bound: transformers')", theirs["max_abs"],
                mine["max_abs"], at_most=True)
    return rows


def number(value, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def suite_markdown(suite: dict) -> list[str]:
    lines = ["## Test suite", "", "| command | passed | failed | errors | skipped | not reported | seconds |",
             "|---|---|---|---|---|---|---|",
             f"| `{suite['command']}` | {suite.get('passed')} | {suite.get('failures')} | {suite.get('errors')} | "
             f"{suite.get('skipped')} | {suite.get('not_reported', 0)} | {suite['seconds']} |", ""]
    notes = [suite[key] for key in ("timed_out", "note") if key in suite]
    if suite.get("tests") and not suite.get("finished", True):
        notes.append(f"the run did not finish: {suite['tests']} collected, {suite.get('not_reported', 0)} without an outcome")
    lines += [f"- {note}" for note in notes] + ([""] if notes else [])
    if suite.get("commonest_failures"):
        lines += ["| failures | message |", "|---|---|"]
        lines += [f"| {row['count']} | `{row['message'].replace('|', '/')}` |" for row in suite["commonest_failures"]]
        lines.append("")
    failed = suite.get("failed", [])
    lines += [f"- failed: `{name}`" for name in failed[:MAX_FAILED_LISTED]]
    if len(failed) > MAX_FAILED_LISTED:
        lines.append(f"- ... and {len(failed) - MAX_FAILED_LISTED} more (every one in gpu.json; "
                     f"tracebacks in {suite.get('outcomes')})")
    return lines + ([""] if failed else [])


def markdown(report: dict) -> str:
    meta = report["meta"]
    lines = [f"# kvcache GPU run: {meta['device_name']}", "",
             f"{meta['started']}, torch {meta['torch']}, triton {meta['triton']}, transformers {meta['transformers']}, "
             f"kvcache {meta['kvcache']}, {'quick' if meta['quick'] else 'full'} run, {report.get('seconds', '-')} s.", ""]
    if meta.get("budgets_s"):
        spent = report.get("part_seconds", {})
        lines += ["Budgets (s spent / s allowed): " + ", ".join(
            f"{part} {spent.get(part, '-')} / {budget:g}" for part, budget in meta["budgets_s"].items()) + ".", ""]
    if meta["device"] == "cpu":
        lines += ["A smoke test of benchmarks/gpu.py on tiny shapes: its figures say nothing about the GPU floors.", ""]
    if report.get("timed_out"):
        lines += ["Stopped at their budgets (what they measured before is below): "
                  + ", ".join(f"{part} {why}" for part, why in report["timed_out"].items()) + ".", ""]
    if report.get("suite"):
        lines += suite_markdown(report["suite"])
    cells = report.get("decode", {}).get("cells", {})
    if cells:
        lines += ["## Decode (tok/s per row; compile s)", "",
                  "| cell | batch | kvcache eager | kvcache compiled | transformers eager | transformers static compiled | "
                  "compiled ratio | roofline tok/s | compiled % of roofline | compile s kvcache / transformers | "
                  "peak GiB kvcache compiled |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for name, cell in cells.items():
            kc, tc = cell.get("kvcache_compiled", {}), cell.get("transformers_static_compiled", {})
            roof = cell["roofline"]["roofline_tok_s"]
            share = None if not kc else 100 * kc["decode_tok_s"] / roof
            peak = kc.get("peak_bytes")
            lines.append(
                f"| {name} | {cell['batch_size']} | {number(cell['kvcache']['decode_tok_s'])} | "
                f"{number(kc.get('decode_tok_s'))} | "
                f"{number(cell['transformers']['decode_tok_s'])} | {number(tc.get('decode_tok_s'))} | "
                f"{number(cell.get('decode_ratio_compiled_kvcache_over_transformers'), 2)} | {number(roof)} | {number(share)} | "
                f"{number(kc.get('compile_s'))} / {number(tc.get('compile_s'))} | "
                f"{number(None if peak is None else peak / 2**30, 2)} |")
        lines.append("")
    results = report.get("policies", {}).get("results", {})
    for length, rows in results.items():
        lines += [f"## Policies under compile, cache_length {length}", "", "| policy | step ms | vs dense | floor | compile s |",
                  "|---|---|---|---|---|"]
        for name, row in rows.items():
            if "step_ms" in row:
                lines.append(f"| {name} | {row['step_ms']:.3f} | {row['vs_dense']:.3f} | {row.get('floor', '-')} | "
                             f"{number(row.get('compile_s'))} |")
            else:
                lines.append(f"| {name} | - | - | - | {row.get('skipped', '')} |")
        lines.append("")
    steps = report.get("packed", {}).get("layer_speed", {}).get("steps", {})
    if steps:
        lines += ["## Packed codes: one layer's decode step", "", "| storage | median ms | speed-up over SDPA |", "|---|---|---|"]
        lines += [f"| {name} | {row['median_ms']} | {row['speedup_vs_sdpa']} |" for name, row in steps.items()]
        lines.append("")
    per_token = report.get("packed", {}).get("model_speed", {}).get("per_token", {})
    if per_token:
        lines += ["## Packed codes: end-to-end decode", "", "| cache | ms per step | speed-up over full precision |",
                  "|---|---|---|"]
        lines += [f"| {name} | {row['median_ms']} | {row['speedup_vs_full_precision']} |" for name, row in per_token.items()]
        lines.append("")
    if report.get("drift", {}).get("results"):
        lines += ["## Drift (`kvcache drift`)", "", "```", drift.table(report["drift"]).rstrip(), "```", ""]
    if report.get("floors"):
        lines += ["## Floors", "", "| floor | bound | value | met |", "|---|---|---|---|"]
        lines += [f"| {row['floor']} | {row['bound']} | {'-' if row['value'] is None else format(row['value'], '.3g')} | "
                  f"{row['met']} |" for row in report["floors"]]
        lines.append("")
    for part, error in report.get("errors", {}).items():
        lines += [f"## {part}: failed", "", "```", error.strip(), "```", ""]
    return "\n".join(lines)


# ---- main ---------------------------------------------------------------------------------------------------


def meta(device: torch.device, quick: bool) -> dict:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    import transformers

    return {
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.machine()})",
        "torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton_version,
        "transformers": transformers.__version__, "kvcache": kvcache.__version__,
        "python": platform.python_version(), "quick": quick, "cpu_count": os.cpu_count(),
    }


def write_atomically(path: Path, text: str) -> None:
    """A reader (the parent of a part's process, one that is stopped mid-write) sees the old file or the new one."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)


def start_parts(parts: list[str], args, where: Path) -> subprocess.Popen:
    """A process (this script with ``--child``) that runs ``parts`` one after the other, started
    ahead of its turn: it loads what the parts use, then waits for a line on its stdin
    (``run_parts`` sends it)."""
    command = [sys.executable, str(Path(__file__).resolve()), "--child", "--wait-turn", "--device", args.device,
               "--parts", ",".join(parts), "--out", str(where)] + (["--quick"] if args.quick else [])
    # Its log goes where this one's goes; stdout stays this script's table.
    return start(command, stdin=subprocess.PIPE, stdout=sys.stderr, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def read_report(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):  # not written yet (it is replaced whole, never cut)
        return {}


def run_parts(parts: list[str], proc: subprocess.Popen, budgets: dict, where: Path, report: dict) -> list[str]:
    """Gives the process of ``parts`` (``start_parts``) its turn and follows the part it runs (its
    JSON's ``running``): a part that passes its budget is stopped with the process. Puts each
    part's figures (as far as it got), errors, seconds and time-out into ``report``; returns the
    parts it did not reach (after a part was stopped, or the process ended inside one)."""
    log(f"{', '.join(parts)}: a process, budgets " + ", ".join(f"{part} {budgets[part]:g} s" for part in parts))
    try:
        proc.stdin.write(b"go\n")
        proc.stdin.close()
    except BrokenPipeError:  # it ended while it waited: its exit status says so
        pass
    path = where / "gpu.json"
    # The first part's clock runs from its turn; each next one's from when the process names it.
    current, since, stopped = parts[0], time.perf_counter(), None
    try:
        while True:
            try:
                proc.wait(timeout=0.25)
                break
            except subprocess.TimeoutExpired:
                pass
            running = read_report(path).get("running", current)
            if running != current:
                current, since = running, time.perf_counter()
            if time.perf_counter() - since > budgets[current]:
                stopped = current
                _stop(proc)
                break
    except BaseException:
        _stop(proc)
        raise
    finally:
        _RUNNING.discard(proc)
    child = read_report(path)
    done = child.get("done", [])
    if not stopped:  # the part it was in when it ended, if it ended inside one
        current = child.get("running", current)
    for part in parts:
        if part in child:
            report[part] = child[part]
        if part in child.get("part_seconds", {}):
            report.setdefault("part_seconds", {})[part] = child["part_seconds"][part]
    report["errors"].update(child.get("errors", {}))
    if stopped:
        report.setdefault(stopped, {})["timed_out"] = report["timed_out"][stopped] = timed_out(budgets[stopped])
        report.setdefault("part_seconds", {})[stopped] = round(time.perf_counter() - since, 1)
        log(f"{stopped}: {timed_out(budgets[stopped])}; keeping what it wrote")
    elif current not in done:  # the process ended inside a part (killed, out of memory?)
        report["errors"][current] = (f"its process ended with exit status {proc.returncode} while it ran {current}: "
                                     "see the log")
    # The parts after the one it was in when it ended: a new process runs them.
    return [part for part in parts[parts.index(current) + 1 :] if part not in done] if current in parts else []


def prepare(parts: list[str]) -> None:
    """Loads what ``parts`` load on their first step (transformers' Llama; torch's compiler, which a
    first compile in a process takes seconds to set up, for decode and policies), as their process
    waits for its turn. Nothing here touches a GPU."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM  # noqa: F401

    if {"decode", "policies"} & set(parts):
        try:
            torch.compile(lambda x: x * 2 + 1, fullgraph=True)(torch.ones(4))
        except Exception as e:  # no C++ compiler, say: the part's own first compile will say more
            log(f"(a warm-up compile on the CPU failed: {type(e).__name__}: {e})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (a smoke test, with --quick)")
    p.add_argument("--quick", action="store_true", help="the floor cells only, fewer steps (see the docstring)")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    p.add_argument("--budget-s", metavar="PART=S[,PART=S...]",
                   help="wall-clock seconds of some parts (a part still running then is stopped, its figures so far "
                        f"kept); defaults: --quick on a GPU {BUDGETS['gpu-quick']}, a full run {BUDGETS['gpu-full']}, "
                        f"the CPU {BUDGETS['cpu']['suite']} s each")
    p.add_argument("--out", type=Path, default=Path("gpu-run"), help="directory of gpu.json and gpu.md (default gpu-run)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # the parts, in this process
    p.add_argument("--wait-turn", action="store_true", help=argparse.SUPPRESS)  # --child: start on a line of stdin
    args = p.parse_args(argv)
    device = decode.parse_device(args.device, p.error)
    parts = [part.strip() for part in args.parts.split(",") if part.strip()]
    if not parts or any(part not in PARTS for part in parts):
        p.error(f"--parts {args.parts!r}: choose from {','.join(PARTS)}")
    if device.type == "cpu" and not args.quick:
        p.error("--device cpu runs the tiny smoke-test shapes only: add --quick")
    budgets = default_budgets(device, args.quick)
    if args.budget_s is not None:
        budgets.update(parse_budgets(args.budget_s, p.error))
    if args.child and "suite" in parts:
        p.error("--child runs parts other than the suite")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    if args.wait_turn:
        prepare(parts)
        if not sys.stdin.readline():  # the parent ended before these parts' turn
            return 1
    args.out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = args.out / "gpu.json", args.out / "gpu.md"
    report: dict = {"meta": meta(device, args.quick), "errors": {}}
    parts = [part for part in PARTS if part in parts]
    if not args.child:
        report["meta"]["budgets_s"] = {part: budgets[part] for part in parts}
        report["timed_out"] = {}
    start = time.perf_counter()

    def save() -> None:
        """The files as the report stands (after every part, and after every cell, group or dtype of one)."""
        report["floors"] = floors(report)
        report["seconds"] = round(time.perf_counter() - start, 1)
        write_atomically(json_path, json.dumps(report, indent=2) + "\n")
        if not args.child:
            write_atomically(md_path, markdown(report) + "\n")

    if args.child:
        if device.type == "cpu":
            # As the benchmarks' own --threads 1: on a small shared machine torch's parallel regions
            # stall (drift's would take 5x longer on 2 cores).
            set_threads(1)
        report["done"], report["part_seconds"] = [], {}
        for part in parts:
            report["running"] = part  # the parent's clock for this part's budget
            save()
            part_start = time.perf_counter()
            try:
                RUNNERS[part](args.device, args.quick, report.setdefault(part, {}), save)
            except Exception:  # reported to the parent through the JSON
                report["errors"][part] = traceback.format_exc()
                log(f"{part} failed:\n{report['errors'][part]}")
            # A part whose runs are kept apart (decode, packed) lists the tracebacks of those that failed.
            for sub, error in (report[part].get("errors") or {}).items() if part in ("decode", "packed") else ():
                report["errors"][f"{part} {sub}"] = error
            report["part_seconds"][part] = round(time.perf_counter() - part_start, 1)
            report["done"].append(report.pop("running"))
            decode.free_memory(device)
            save()
        return 1 if report["errors"] else 0

    signal.signal(signal.SIGTERM, _on_sigterm)
    log("budgets: " + ", ".join(f"{part} {budgets[part]:g} s" for part in parts)
        + f" (at most {sum(budgets[part] for part in parts):g} s)")
    # A GPU gives each part a process of its own: a CUDA error, memory held or compiled graphs of one
    # part do not reach the next. On the CPU (the smoke test) one process runs them all, as
    # processes cost more there than the parts, and the suite (the device fixture's few tests, in
    # pytest processes of their own) runs alongside them, which take one thread.
    benchmarks = [part for part in parts if part != "suite"]
    groups = [benchmarks] if device.type == "cpu" and benchmarks else [[part] for part in benchmarks]
    alongside = device.type == "cpu" and "suite" in parts and bool(benchmarks)
    suite: dict | None = None

    def end_suite() -> None:
        try:
            report["suite"] = finish_suite(suite)
        except Exception:
            report["errors"]["suite"] = traceback.format_exc()
            log(f"suite failed:\n{report['errors']['suite']}")
        if "timed_out" in report.get("suite", {}):
            report["timed_out"]["suite"] = timed_out(budgets["suite"])
        report.setdefault("part_seconds", {})["suite"] = report.get("suite", {}).get("seconds")
        save()

    with tempfile.TemporaryDirectory(prefix="kvcache-gpu-parts-") as workdir:
        # Each group's process starts while the part before it runs (the first with the suite).
        waiting = [(group, start_parts(group, args, Path(workdir) / str(i))) for i, group in enumerate(groups[:1])]
        try:
            if "suite" in parts:
                try:
                    suite = start_suite(args.device, args.quick, args.out, budgets["suite"])
                except Exception:
                    report["errors"]["suite"] = traceback.format_exc()
                    log(f"suite failed:\n{report['errors']['suite']}")
                    save()
                if suite is not None and not alongside:
                    end_suite()
            for i in range(len(groups)):
                group, proc = waiting.pop(0)
                if i + 1 < len(groups):
                    waiting.append((groups[i + 1], start_parts(groups[i + 1], args, Path(workdir) / str(i + 1))))
                where = Path(workdir) / str(i)
                while group:  # after a part is stopped, the rest of its group in a new process
                    group = run_parts(group, proc, budgets, where, report)
                    save()
                    if group:
                        where = where.with_name(where.name + "+")
                        proc = start_parts(group, args, where)
            if alongside and suite is not None:
                end_suite()
        finally:
            for proc in list(_RUNNING):  # a part waiting for its turn, or the suite, when this run is interrupted
                _stop(proc)
                _RUNNING.discard(proc)
    log(f"wrote {json_path} and {md_path} ({report['seconds']} s)")
    print(markdown(report))
    suite_failed = "suite" in report and report["suite"]["returncode"] != 0
    return 1 if report["errors"] or report["timed_out"] or suite_failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
