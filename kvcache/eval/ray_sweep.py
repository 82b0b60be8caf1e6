"""A sweep's cells as Ray tasks (``kvcache eval --ray [ADDRESS]``): a pool of actors, each loading
the model once, runs the pending cells; the driver writes each result the moment it arrives, as
the serial driver does (sweep.py), so an interrupted sweep resumes and the results equal a serial
run's. A worker process that dies costs only the cell it was running: Ray restarts the actor
(reloading the model) and the cell is run again, up to ``retries`` times. An error raised by a
cell itself (a bad dataset record, say) is not retried: it ends the sweep, as it would serially.

Ray is an optional dependency (``pip install 'kvcache[ray]'``); every machine of a cluster needs
kvcache, the checkpoint (at the same path) and the data.
"""

from __future__ import annotations

import os
import time
from collections import Counter, deque
from collections.abc import Sequence
from pathlib import Path

import torch
from tqdm import tqdm

from ..checkpoints.load import load, load_tokenizer
from . import sweep
from .cell import Bench, Cell, run_cell

PROBE_S = 0.5      # between calls that ask a restarting worker whether it is back
RESTART_S = 120.0  # how long a worker may take to come back (it reloads the model) before it is dropped


def _ray():
    try:
        import ray
    except ImportError:
        raise ImportError("--ray needs the ray package: pip install 'kvcache[ray]' (or pip install ray)") from None
    return ray


class CellWorker:
    """One Ray actor: the model (in ``dtype``, on ``device``, its projections held as ``weights``
    says) and tokenizer of ``source`` (None: the bundled model), loaded once, and the cells given
    to it run one at a time with ``runner``."""

    def __init__(self, source: str | None, dtype: torch.dtype | None, device: str, threads: int,
                 runner: sweep.Runner, weights: str = "full") -> None:
        torch.set_num_threads(threads)
        self.model = load(source, dtype=dtype, device=device, weights=weights)
        self.tokenizer = load_tokenizer(source)
        self.runner = runner

    def run(self, cell: Cell, bench: Bench) -> dict:
        return self.runner(self.model, self.tokenizer, cell, bench)

    def pid(self) -> int:
        return os.getpid()


def run(source: str | Path | None, cells: Sequence[Cell], bench: Bench, out: Path, *, address: str | None = None,
        workers: int | None = None, threads: int = 1, retries: int = 2, runner: sweep.Runner = run_cell,
        dtype: torch.dtype | None = torch.float32, device: str | torch.device = "cpu", weights: str = "full",
        progress: bool = True) -> list[dict]:
    """Run every cell not yet finished under ``out`` on Ray; returns all the cells' results, in
    the order of ``cells`` (as ``sweep.run`` does).

    source:  the checkpoint directory every worker loads (None: the bundled model).
    address: a running cluster's address (``ray start --head`` prints it; "auto" finds a local
             one); None starts a local cluster for this sweep, unless Ray is already initialised.
    workers: actors (default: the cluster's CPUs divided by ``threads``, at most one a pending cell).
    threads: torch threads per worker; each actor reserves as many CPUs (and a GPU when ``device``
             is CUDA: Ray then gives each its own).
    dtype, device, weights: what each worker loads the model in and on, and how it holds the
             projections (``kvcache.load``'s; dtype None: the checkpoint's).
    retries: how many times a cell whose worker died is run again before the sweep fails.
    """
    ray = _ray()
    if workers is not None and workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    if threads < 1 or retries < 0:
        raise ValueError(f"threads must be >= 1 and retries >= 0, got threads={threads}, retries={retries}")
    out = Path(out)
    todo = deque(sweep.pending(cells, bench, out))
    if not todo:
        return sweep.load(out, cells, bench)
    started = not ray.is_initialized()
    if started:
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
    try:
        cpus = int(ray.cluster_resources().get("CPU", 1))
        count = min(len(todo), workers or max(1, cpus // threads))
        device = torch.device(device)
        gpus = 1 if device.type == "cuda" else 0
        actor = ray.remote(num_cpus=threads, num_gpus=gpus, max_restarts=-1)(CellWorker)
        source = None if source is None else str(source)
        # Ray makes the actor's GPU its "cuda:0"; a CPU worker loads on the CPU.
        where = "cuda" if gpus else str(device)
        pool = [actor.remote(source, dtype, where, threads, runner, weights) for _ in range(count)]
        try:
            _drive(ray, pool, todo, len(cells), bench, out, retries, progress)
        finally:
            for a in pool:
                ray.kill(a)
    finally:
        if started:
            ray.shutdown()
    return sweep.load(out, cells, bench)


def _drive(ray, pool: list, todo: deque, total: int, bench: Bench, out: Path, retries: int, progress: bool) -> None:
    """Keep every actor busy with one cell until none is left; write each result as it comes.

    A worker whose process died is probed (a trivial call) until Ray has restarted it, and only
    then given another cell; one that does not come back within ``RESTART_S`` is dropped."""
    deaths: Counter = Counter()
    idle, running, probing = list(pool), {}, Counter()
    alive = len(pool)
    bar = tqdm(total=total, initial=total - len(todo), desc="eval (ray)", unit="cell", disable=not progress,
               dynamic_ncols=True)
    try:
        while todo or any(cell is not None for _, cell in running.values()):
            if alive == 0:
                raise RuntimeError(f"every Ray worker died and none came back within {RESTART_S} s; "
                                   f"{len(todo)} cells are left (a rerun resumes them)")
            while todo and idle:
                worker, cell = idle.pop(), todo.popleft()
                running[worker.run.remote(cell, bench)] = (worker, cell)
            bar.set_postfix_str(f"{sum(c is not None for _, c in running.values())} running on {alive} workers, "
                                f"{len(todo)} queued")
            (ref,), _ = ray.wait(list(running), num_returns=1)
            worker, cell = running.pop(ref)
            try:
                result = ray.get(ref)
            except ray.exceptions.RayActorError as e:
                if cell is None:  # a probe: the worker is still restarting
                    probing[worker] += 1
                    if probing[worker] * PROBE_S > RESTART_S:
                        alive -= 1
                        continue
                    time.sleep(PROBE_S)
                else:
                    # The worker process died (killed, out of memory, its node lost): Ray
                    # restarts the actor; the cell goes back to the front of the queue.
                    deaths[cell] += 1
                    if deaths[cell] > retries:
                        raise RuntimeError(f"cell {cell.key(bench)}: its worker died {deaths[cell]} times "
                                           f"(retries={retries}); last: {e}") from None
                    bar.write(f"a worker died running {cell.key(bench)}; running it again")
                    todo.appendleft(cell)
                running[worker.pid.remote()] = (worker, None)
                continue
            idle.append(worker)
            probing.pop(worker, None)
            if cell is not None:
                sweep.write_atomic(sweep.result_path(out, cell, bench), result)
                bar.update()
    finally:
        bar.close()
