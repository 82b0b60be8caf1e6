"""The process's resident memory as the memory benchmarks read it (Linux /proc)."""

from __future__ import annotations

import ctypes


def status(key: str) -> int:
    """A byte count from /proc/self/status: ``VmRSS`` (resident now) or ``VmHWM`` (its peak)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def trim() -> None:
    """Give freed heap memory back to the system, so the resident set reflects what is held."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def reset_peak() -> None:
    """Make ``VmHWM`` start again from the current resident set."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
