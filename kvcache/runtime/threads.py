"""How many intra-op CPU threads the command line runs a model with.

A small model's matmuls are too short to split: on the CPU every extra intra-op thread adds a
synchronisation per operation and gains nothing, and when another CPU-bound process shares the
cores the threads wait on each other and decoding slows several-fold
(``benchmarks/threads.py``; docs/cli.md, Threads). So a model of up to ``SMALL_MODEL``
parameters on the CPU runs one thread, and a larger one runs torch's choice (usually one per
core) capped at the cores that other processes leave idle (``idle_cores``: 1 thread, not 2, on a
2-core machine where another process keeps one core busy), unless the user said otherwise:
``--threads N``, or ``OMP_NUM_THREADS`` in the environment.
"""

from __future__ import annotations

import os

import torch

# Parameters up to which a CPU model runs one intra-op thread (the bundled model has 5.1M).
SMALL_MODEL = 50_000_000

_given: int | None = None
# torch's own choice, as found when kvcache was imported: a count that differs later was set by
# the program (torch.set_num_threads), which the rule then keeps.
_AT_IMPORT = torch.get_num_threads()
_set_here: set[int] = set()


def set_threads(threads: int | None) -> None:
    """The user's thread count (``--threads``), which every later choice keeps; None: not given."""
    global _given
    _given = threads
    if threads is not None:
        torch.set_num_threads(threads)


def user_chose() -> bool:
    """Whether the user set the thread count: ``--threads``, ``OMP_NUM_THREADS``, or
    ``torch.set_num_threads`` to a count other than torch's own that this module did not set."""
    now = torch.get_num_threads()
    by_program = now != _AT_IMPORT and now not in _set_here
    return _given is not None or bool(os.environ.get("OMP_NUM_THREADS", "").strip()) or by_program


def idle_cores() -> int | None:
    """The cores this process may run on less the system's 1-minute load average (rounded), at
    least 1; None where the system gives no load average. Read when a command has just loaded
    its model, before it computes, so the load is other processes'."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return None
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, usable - round(load))


def for_model(model: torch.nn.Module) -> int:
    """Set the thread count for ``model`` as the module docstring says; returns the count in force."""
    if not user_chose():
        weight = next(model.parameters(), None)
        on_cpu = weight is None or weight.device.type == "cpu"
        if on_cpu and sum(p.numel() for p in model.parameters()) <= SMALL_MODEL:
            _set(1)
        elif on_cpu:
            idle = idle_cores()
            if idle is not None and idle < torch.get_num_threads():
                _set(idle)
    return torch.get_num_threads()


def _set(count: int) -> None:
    _set_here.add(count)
    torch.set_num_threads(count)
