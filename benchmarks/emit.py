"""What every benchmark script ends with: its report as JSON on stdout, and in ``--out`` too."""

from __future__ import annotations

import json
import os
import platform


def emit(report: dict, out: str | None, indent: int = 1) -> None:
    """Print ``report`` as JSON; also write it to the file ``out`` when one is given."""
    text = json.dumps(report, indent=indent)
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")


def machine(load_before: list[float] | tuple[float, ...]) -> dict:
    """The CPU, its core count and the load average measured before the run."""
    return {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "load_average_before": load_before}
