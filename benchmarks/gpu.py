"""Every GPU figure of docs/gpu.md in one command: the test suite on the device, then decode,
policies under compile, packed-code attention and drift, each benchmark the script (or module) of
its own name (benchmarks/decode.py, policies.py, quantized.py, kvcache.drift) called in this
process with the options this script records next to its figures. Writes one JSON and one markdown table; the JSON is rewritten
after every part and every decode cell, so a run cut short keeps what it measured.

Parts (``--parts``, default all, in this order):
    suite     ``KVCACHE_TEST_DEVICE=<device> python -m pytest -q tests``: counts and failures.
    decode    decode.py at the 1B and 8B shapes (random weights, bfloat16) with 1k prompts at batch
              1, 16 and 64 and 32k prompts at batch 1: kvcache eager and compiled against
              transformers eager and transformers' static cache compiled, the read-bandwidth
              roofline and both compile times, all in this run.
    policies  policies.py under compile (captured decode steps) at cache_length 2048 after an 8k
              prompt, on the 1B shape.
    packed    quantized.py at 32k tokens, batch 16, bfloat16: one layer's decode step over 8- and
              4-bit packed codes (the Triton kernel on CUDA) against SDPA over bfloat16 keys, then
              end-to-end decode of the 1B shape over int8/int4/int2 against dense.
    drift     ``kvcache drift`` on the device (kvcache.drift.report) for the bundled model in
              bfloat16 and float32: cached vs uncached, chunked, a row batched with padding vs
              alone (batch invariance), reused prefixes; kvcache against transformers on the
              same weights.

``--quick`` keeps the cells the floors are judged on (1k prompts: 1B at batch 1 and 16, 8B at
batch 1), the floor policies, fewer steps and repeats. ``--device cpu --quick`` is a smoke test
of this script on tiny shapes (seconds of compute; CI runs it): its figures mean nothing.

    python benchmarks/gpu.py [--quick] [--device cuda] [--parts suite,decode,policies,packed,drift] [--out DIR]

Exit status: 0 when every part ran and the suite passed (a floor missed is reported, not an
error), 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import traceback
import xml.etree.ElementTree as ET
from pathlib import Path

import torch

import decode  # benchmarks/decode.py: the script's own folder is on the path
import policies
import quantized

import kvcache
from kvcache import drift

ROOT = Path(__file__).resolve().parent.parent
PARTS = ["suite", "decode", "policies", "packed", "drift"]

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
        timing = ["--new-tokens", "32", "--repeats", "2"]
        return [common + timing + ["--shapes", "1B@1k", "--batch", "1,16"],
                common + timing + ["--shapes", "8B@1k", "--batch", "1"]]
    timing = ["--new-tokens", "64", "--repeats", "3"]
    return [common + timing + ["--shapes", "1B@1k", "--batch", "1,16,64"],
            common + timing + ["--shapes", "1B@32k", "--batch", "1"],
            common + timing + ["--shapes", "8B@1k", "--batch", "1,16,64"],
            common + timing + ["--shapes", "8B@32k", "--batch", "1"]]


def policies_run(device: str, quick: bool) -> list[str]:
    if device == "cpu":
        return ["--device", "cpu", "--compiled", "--model", "tiny", "--policies", "window,h2o",
                "--cache-length", "64", "--prompt", "256", "--steps", "4", "--repeats", "1", "--threads", "1"]
    floor_policies = "window,sink,sink_absolute,h2o,tova,snapkv"
    # Every policy whose step can be captured (policies.py skips the _reserve64 variants under compile).
    chosen = floor_policies if quick else ",".join(name for name in policies.POLICIES if name != "dense")
    steps, repeats = ("32", "2") if quick else ("64", "3")
    return ["--device", device, "--compiled", "--model", "1B", "--dtype", "bfloat16", "--policies", chosen,
            "--cache-length", "2048", "--prompt", "8192", "--steps", steps, "--repeats", repeats]


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
    return {"layer": common + ["--parts", "layer"], "model": common + ["--parts", "model"]}


def drift_setup(device: str) -> tuple[list[str], drift.Setup]:
    """The dtypes and prompt of the drift part: the CLI's defaults on a GPU, a short prompt on the CPU."""
    if device == "cpu":
        return ["float32"], drift.Setup(tokens=64, chunk=16, prefix=20, steps=4)
    return ["bfloat16", "float32"], drift.Setup()


def suite_command(device: str, quick: bool, junit: Path) -> list[str]:
    # On the CPU the suite itself is CI's first step: the smoke test runs the device fixture's tests.
    tests = ["tests/test_test_device.py"] if device == "cpu" and quick else ["tests"]
    return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", *tests]


# ---- parts ----------------------------------------------------------------------------------------------


def run_suite(device: str, quick: bool, out: Path) -> dict:
    junit = out / "suite.xml"
    command = suite_command(device, quick, junit)
    env = {**os.environ, "KVCACHE_TEST_DEVICE": device}
    log(f"suite: KVCACHE_TEST_DEVICE={device} {' '.join(command[1:])}")
    start = time.perf_counter()
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    (out / "suite.log").write_text(proc.stdout + proc.stderr)
    result = {"command": f"KVCACHE_TEST_DEVICE={device} python " + " ".join(command[1:]), "returncode": proc.returncode,
              "seconds": round(time.perf_counter() - start, 1), "log": str(out / "suite.log")}
    if junit.exists():
        suite = ET.parse(junit).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
        counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
        failed = [f"{case.get('classname')}::{case.get('name')}" for case in suite.iter("testcase")
                  if case.find("failure") is not None or case.find("error") is not None]
        result.update(counts, failed=failed)
    else:
        result["tail"] = (proc.stdout + proc.stderr)[-2000:]
    log(f"suite: {result.get('passed')} passed, {result.get('failures')} failed, {result.get('errors')} errors, "
        f"{result.get('skipped')} skipped (exit {proc.returncode})")
    return result


def run_decode(device: str, quick: bool, out: dict, save) -> dict:
    """Every cell into ``out``, ``save()`` after each; a command line that fails leaves its traceback
    under ``errors`` and the others run."""
    out.update({"commands": [], "bandwidth_GBps": [], "cells": {}, "errors": {}})

    def on_cell(name: str, figures: dict) -> None:
        out["cells"][name] = figures
        save()

    for argv in decode_runs(device, quick):
        command = "python benchmarks/decode.py " + " ".join(argv)
        out["commands"].append(command)
        log(command)
        try:
            result = decode.run(decode.parser().parse_args(argv), fail, on_cell)
        except Exception:
            out["errors"][command.split("--shapes ")[1].split()[0]] = traceback.format_exc()
            log(f"decode failed:\n{traceback.format_exc()}")
            decode.free_memory(decode.parse_device(device, fail))
            continue
        out["bandwidth_GBps"].append(result["bandwidth_GBps"])
        out["cells"].update(result["shapes"])
    return out


def run_policies(device: str, quick: bool) -> dict:
    argv = policies_run(device, quick)
    command = "python benchmarks/policies.py " + " ".join(argv)
    log(command)
    return {"command": command, **policies.run(policies.parser().parse_args(argv), fail)}


def run_packed(device: str, quick: bool) -> dict:
    """The layer and the model figures; a sub-part that fails leaves its traceback under ``errors``."""
    out: dict = {"commands": [], "errors": {}}
    for sub, argv in packed_runs(device, quick).items():
        out["commands"].append("python benchmarks/quantized.py " + " ".join(argv))
        log(out["commands"][-1])
        try:
            result = quantized.run(quantized.parser().parse_args(argv), fail)
        except Exception:
            out["errors"][sub] = traceback.format_exc()
            log(f"packed {sub} failed:\n{out['errors'][sub]}")
            continue
        out.update({key: value for key, value in result.items() if key in ("layer_speed", "model_speed")})
    return out


def run_drift(device: str, quick: bool) -> dict:
    dtypes, setup = drift_setup(device)
    log(f"drift: the bundled model, {','.join(dtypes)} on {device}")
    return drift.report(None, dtypes, device=device, setup=setup)


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


def markdown(report: dict) -> str:
    meta = report["meta"]
    lines = [f"# kvcache GPU run: {meta['device_name']}", "",
             f"{meta['started']}, torch {meta['torch']}, triton {meta['triton']}, transformers {meta['transformers']}, "
             f"kvcache {meta['kvcache']}, {'quick' if meta['quick'] else 'full'} run, {report.get('seconds', '-')} s.", ""]
    if meta["device"] == "cpu":
        lines += ["A smoke test of benchmarks/gpu.py on tiny shapes: its figures say nothing about the GPU floors.", ""]
    suite = report.get("suite")
    if suite:
        lines += ["## Test suite", "", "| command | passed | failed | errors | skipped | seconds |", "|---|---|---|---|---|---|",
                  f"| `{suite['command']}` | {suite.get('passed')} | {suite.get('failures')} | {suite.get('errors')} | "
                  f"{suite.get('skipped')} | {suite['seconds']} |", ""]
        lines += [f"- failed: `{name}`" for name in suite.get("failed", [])]
        lines += [""] if suite.get("failed") else []
    cells = report.get("decode", {}).get("cells", {})
    if cells:
        lines += ["## Decode (tok/s per row; compile s)", "",
                  "| cell | batch | kvcache eager | kvcache compiled | transformers eager | transformers static compiled | "
                  "compiled ratio | roofline tok/s | compiled % of roofline | compile s kvcache / transformers | peak GiB kvcache compiled |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for name, cell in cells.items():
            kc, tc = cell.get("kvcache_compiled", {}), cell.get("transformers_static_compiled", {})
            roof = cell["roofline"]["roofline_tok_s"]
            share = None if not kc else 100 * kc["decode_tok_s"] / roof
            peak = kc.get("peak_bytes")
            lines.append(
                f"| {name} | {cell['batch_size']} | {number(cell['kvcache']['decode_tok_s'])} | {number(kc.get('decode_tok_s'))} | "
                f"{number(cell['transformers']['decode_tok_s'])} | {number(tc.get('decode_tok_s'))} | "
                f"{number(cell.get('decode_ratio_compiled_kvcache_over_transformers'), 2)} | {number(roof)} | {number(share)} | "
                f"{number(kc.get('compile_s'))} / {number(tc.get('compile_s'))} | {number(None if peak is None else peak / 2**30, 2)} |")
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
        lines += ["## Packed codes: end-to-end decode", "", "| cache | ms per step | speed-up over full precision |", "|---|---|---|"]
        lines += [f"| {name} | {row['median_ms']} | {row['speedup_vs_full_precision']} |" for name, row in per_token.items()]
        lines.append("")
    if report.get("drift"):
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
        "python": platform.python_version(), "quick": quick,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (a smoke test, with --quick)")
    p.add_argument("--quick", action="store_true", help="the floor cells only, fewer steps (see the docstring)")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    p.add_argument("--out", type=Path, default=Path("gpu-run"), help="directory of gpu.json and gpu.md (default gpu-run)")
    args = p.parse_args(argv)
    device = decode.parse_device(args.device, p.error)
    parts = [part.strip() for part in args.parts.split(",") if part.strip()]
    if not parts or any(part not in PARTS for part in parts):
        p.error(f"--parts {args.parts!r}: choose from {','.join(PARTS)}")
    if device.type == "cpu" and not args.quick:
        p.error("--device cpu runs the tiny smoke-test shapes only: add --quick")
    args.out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = args.out / "gpu.json", args.out / "gpu.md"

    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    report: dict = {"meta": meta(device, args.quick), "errors": {}}
    start = time.perf_counter()

    def save() -> None:
        """Both files as the report stands (after every part, and after every decode cell)."""
        report["floors"] = floors(report)
        report["seconds"] = round(time.perf_counter() - start, 1)
        json_path.write_text(json.dumps(report, indent=2) + "\n")
        md_path.write_text(markdown(report) + "\n")

    runners = {"suite": lambda: run_suite(args.device, args.quick, args.out),
               "decode": lambda: run_decode(args.device, args.quick, report.setdefault("decode", {}), save),
               "policies": lambda: run_policies(args.device, args.quick),
               "packed": lambda: run_packed(args.device, args.quick),
               "drift": lambda: run_drift(args.device, args.quick)}
    for part in (part for part in PARTS if part in parts):
        part_start = time.perf_counter()
        try:
            report[part] = runners[part]()
        except Exception:  # a part that crashes is reported; the others still run
            report["errors"][part] = traceback.format_exc()
            log(f"{part} failed:\n{report['errors'][part]}")
        # A part whose runs are kept apart (decode, packed) lists the tracebacks of those that failed.
        part_errors = report.get(part, {}).get("errors") if part in ("decode", "packed") else None
        for sub, error in (part_errors or {}).items():
            report["errors"][f"{part} {sub}"] = error
        report.setdefault("part_seconds", {})[part] = round(time.perf_counter() - part_start, 1)
        decode.free_memory(device)
        save()
    log(f"wrote {json_path} and {md_path} ({report['seconds']} s)")
    print(markdown(report))
    suite_failed = "suite" in report and report["suite"]["returncode"] != 0
    return 1 if report["errors"] or suite_failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
