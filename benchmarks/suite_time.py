"""How long the README's test command takes, as on a fresh clone: wall and CPU time of
``python -m pytest -q -n auto --dist worksteal tests`` (and, with ``--serial``, of the one-process
``python -m pytest -q tests`` too), each with an empty inductor cache (a first run compiles every
kernel), with the load average sampled during the run so that a figure says what else was running.
The tests are those of this checkout (it is put first on PYTHONPATH), whichever kvcache is installed.

    python benchmarks/suite_time.py [--serial] [--repeats 1] [--out FILE] [-- MORE PYTEST ARGUMENTS]

Prints one JSON object; pytest's own output goes to stderr. The CPU time is that of pytest and
every process it waited for (its workers and theirs).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMMANDS = {
    "xdist": [sys.executable, "-m", "pytest", "-q", "-n", "auto", "--dist", "worksteal", "tests"],
    "serial": [sys.executable, "-m", "pytest", "-q", "tests"],
}


def load_average() -> float:
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def run(command: list[str]) -> dict:
    samples: list[float] = []
    done = threading.Event()

    def sample() -> None:
        while not done.wait(10):
            samples.append(load_average())

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as cache:
        path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "PYTHONPATH": path}
        status = subprocess.run(command, cwd=ROOT, env=env, stdout=sys.stderr).returncode
    wall = time.perf_counter() - start
    done.set()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    samples.sort()
    return {
        "command": " ".join(["python", *command[1:]]), "exit_status": status, "wall_s": round(wall, 1),
        "cpu_user_s": round(after.ru_utime - before.ru_utime, 1), "cpu_sys_s": round(after.ru_stime - before.ru_stime, 1),
        "load_average_during": {"min": samples[0], "median": samples[len(samples) // 2], "max": samples[-1]}
        if samples else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--serial", action="store_true", help="also time the one-process command")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--out")
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments after --, such as --durations=40")
    args = parser.parse_args()
    kinds = ["xdist", "serial"] if args.serial else ["xdist"]
    report = {"machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                          "load_average_before": load_average()},
              "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                       text=True).stdout.strip() or None,
              "runs": [run(COMMANDS[kind] + args.pytest_args) for _ in range(args.repeats) for kind in kinds]}
    text = json.dumps(report, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
