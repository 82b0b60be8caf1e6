"""What ``kvcache eval`` does once its flags are parsed.

    passkey   the streaming perplexity / agreement / passkey grid of kvcache/evaluate.py, each
              of its units a cell written to ``OUT/cells/`` as it finishes (passkey.py); a rerun
              resumes.
    ruler     RULER's tasks at ``--lengths`` tokens, every (policy, ratio, task, length,
              protocol) cell written to ``OUT/cells/`` as it finishes (sweep.py); a rerun resumes.
    dataset   the tasks of a JSON-lines file (dataset.py), swept the same way.
Every benchmark runs its cells serially or on Ray (``--ray``). The ruler and dataset sweeps end
with report.json, report.md (the leaderboard) and, unless ``--no-plots``, the score-against-ratio
plot and one task x policy heatmap per ratio.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from ..checkpoint import BUNDLED_MODEL, load, load_tokenizer
from . import dataset as ds
from . import leaderboard, ruler, sweep
from .cell import BATCH, PROTOCOLS, Bench
from .sample import chat_parts

DEFAULT_RATIOS = (0.25, 0.5, 0.75)
DEFAULT_RULER_LENGTHS = (4096,)
DEFAULT_SAMPLES = 5


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def out_dir(path: str, create: bool = True) -> Path:
    """``--out`` as a usable directory, or a ValueError saying what to pass. ``create``: make it
    if new; without, only check that it could be made (nothing is written)."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {path} exists and is not a directory; pass a new directory, or the directory of "
                         "an earlier kvcache eval run to resume it")
    if not create:
        parent = next((p for p in out.absolute().parents if p.exists()), None)
        if not out.exists() and parent is not None and not (parent.is_dir() and os.access(parent, os.W_OK | os.X_OK)):
            raise ValueError(f"--out {path}: cannot create the directory ({parent} is not a writable directory); "
                             "pass a writable directory")
        return out
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--out {path}: cannot create the directory ({e.strerror}); pass a writable directory") from None
    return out


def check_grid(policies, model=None) -> None:
    """Every policy[(options)][:storage] of a grid, before any cell runs: one ValueError naming
    each unknown policy, option and storage; with ``model``, also the storages its head size
    cannot hold."""
    from ..cache.registry import check_names, parse_name
    from ..cache.storage import check_storage

    check_names(policies, "--policies")
    if model is not None:
        for name in policies:
            _, storage = parse_name(name)
            if storage != "full":
                try:
                    check_storage(storage, model.config.head_dim)
                except ValueError as e:
                    raise ValueError(f"--policies {name}: {e}") from None


def check_chat(args, tokenizer) -> None:
    """``--chat`` needs a chat template that renders a user's message as it is given."""
    if not args.chat:
        return
    if tokenizer.chat_template is None:
        raise ValueError(f"--chat: {args.model or 'the bundled model'} has no chat template (it was not trained "
                         "for chat); drop --chat")
    chat_parts(tokenizer)


def benchmark(args) -> str:
    kind = args.benchmark or ("dataset" if args.dataset is not None else "passkey")
    if args.benchmark == "passkey" and args.dataset is not None:
        raise ValueError("--dataset applies to --benchmark dataset or ruler, not passkey")
    if kind == "passkey" and args.report_only:
        raise ValueError("--report-only applies to --benchmark ruler or dataset, not passkey")
    return kind


def run(args, out: Path, dtype: torch.dtype | None, progress: bool) -> None:
    """``dtype``: what the model is loaded in (None: the checkpoint's), on ``args.device``."""
    kind = benchmark(args)
    sweep_only = ("ratios", "tasks", "protocols", "samples", "seed", "metric", "batch")
    if kind == "passkey":
        given = [f"--{k}" for k in sweep_only if getattr(args, k) not in (None, False)]
        if given:
            raise ValueError(f"{', '.join(given)} apply to --benchmark ruler or dataset, not passkey")
        return _passkey(args, out, dtype, progress)
    given = [f"--{k.replace('_', '-')}" for k in ("depths", "trials", "stream_tokens") if getattr(args, k) is not None]
    if given:
        raise ValueError(f"{', '.join(given)} apply to --benchmark passkey only")
    return _sweep(args, kind, out, dtype, progress)


def _ratios(args) -> list[float]:
    if args.ratios is not None and args.budgets is not None:
        raise ValueError("give --ratios (the fraction removed) or --budgets (the fraction kept), not both")
    if args.budgets is not None:
        if not all(0 < b <= 1 for b in args.budgets):
            raise ValueError(f"--budgets are fractions of the context kept, in (0, 1], got {args.budgets}")
        return [round(1 - b, 6) for b in args.budgets]
    ratios = list(args.ratios) if args.ratios is not None else list(DEFAULT_RATIOS)
    if not all(0 <= r < 1 for r in ratios) or not ratios:
        raise ValueError(f"--ratios are fractions of the context removed, in [0, 1), got {ratios}")
    return ratios


def _sweep(args, kind: str, out: Path, dtype: torch.dtype | None, progress: bool) -> None:
    from ..cache.registry import canonical_name
    from ..cache.registry import policies as registered

    if args.batch is not None and args.ray is not None:
        raise ValueError("--batch decodes cells together in this process; with --ray each cell runs alone in a "
                         "worker: drop one of them")
    bench = Bench.make(kind, texts=args.texts, dataset=args.dataset, metric=args.metric, chat=args.chat,
                       weights=args.weights)
    ratios = _ratios(args)
    protocols = args.protocols or list(PROTOCOLS)
    bad = [p for p in protocols if p not in PROTOCOLS]
    if bad:
        raise ValueError(f"unknown protocol(s) {', '.join(bad)}; available: {', '.join(PROTOCOLS)}")
    tasks, lengths = _tasks_and_lengths(args, kind)
    policies = args.policies or sorted(registered(), key=lambda name: name != "dense")
    check_grid(policies)
    # One spelling per variant, so that "snapkv(kernel=5, window=64)" finds the cells of "snapkv(window=64,kernel=5)".
    policies = list(dict.fromkeys(canonical_name(p) for p in policies))
    samples = args.samples or DEFAULT_SAMPLES
    if args.quick:
        tasks, lengths, samples = tasks[:2], [0] if kind == "dataset" else [1024], 1
        policies, ratios = [p for p in policies if p in ("dense", "h2o")] or policies[:2], ratios[:1]
    cells = sweep.plan(policies, ratios, tasks, lengths, protocols, samples, args.seed or 0)
    model_name = args.model or f"bundled ({BUNDLED_MODEL.name})"
    tokenizer = load_tokenizer(args.model)
    check_chat(args, tokenizer)
    model = load(args.model, dtype=dtype, device=args.device, weights=args.weights)
    check_grid(policies, model)
    if kind == "ruler":
        # Every (task, length) holds its smallest sample, before anything is written.
        source = ruler.Source(bench.texts, ds.qa_source(bench.dataset) if bench.dataset else ())
        for task, length in dict.fromkeys((c.task, c.length) for c in cells):
            ruler.check_fits(task, tokenizer, length, source, bench.chat)
    finished = sweep.load(Path(out), cells, bench) if args.report_only else []
    if args.report_only and not finished:
        raise ValueError(f"--report-only: none of the {len(cells)} cells is finished in {out}/cells")
    out = out_dir(str(out))  # the first thing written: after every check above
    done = len(cells) - len(sweep.pending(cells, bench, out))
    print(f"kvcache eval: {_count(len(cells), 'cell')} ({done} already in {out}/cells), writing to {out}/", file=sys.stderr)
    if args.report_only:
        results = finished
    elif args.ray is None:
        results = sweep.run(model, tokenizer, cells, bench, out, progress=progress, batch=args.batch or BATCH)
    else:
        from . import ray_sweep

        results = ray_sweep.run(args.model, cells, bench, out, address=args.ray or None, threads=args.threads or 1,
                                dtype=dtype, device=args.device, weights=args.weights, progress=progress)
    header = {"benchmark": kind, "model": model_name, "lengths": ", ".join(map(str, lengths)) if kind == "ruler"
              else "as in the dataset", "samples per task": samples, "seed": args.seed or 0,
              "protocols": ", ".join(protocols), "ratios (fraction removed)": ", ".join(f"{r:g}" for r in ratios),
              "chat template": "yes" if args.chat else "no",
              "dtype": str(next(model.parameters()).dtype).removeprefix("torch."), "weights": args.weights,
              "device": str(args.device)}
    if kind == "dataset" or args.dataset:
        header["dataset"] = args.dataset
    _write_report(args, out, results, header)


def _tasks_and_lengths(args, kind: str) -> tuple[list[str], list[int]]:
    """--tasks (RULER's, or the dataset's) and --lengths, checked: RULER's default lengths, and a
    dataset's 0 (its prompts are as long as they are)."""
    if kind == "ruler":
        tasks = args.tasks or list(ruler.TASKS)
        unknown = [t for t in tasks if t not in ruler.TASKS]
        if unknown:
            raise ValueError(f"unknown RULER task(s) {', '.join(unknown)}; the tasks are {', '.join(ruler.TASKS)}")
        return tasks, args.lengths or list(DEFAULT_RULER_LENGTHS)
    found = ds.tasks(args.dataset)
    tasks = args.tasks or found
    unknown = [t for t in tasks if t not in found]
    if unknown:
        raise ValueError(f"task(s) {', '.join(unknown)} not in {args.dataset}, whose tasks are {', '.join(found)}")
    return tasks, [0]


def _write_report(args, out: Path, results: list[dict], header: dict) -> None:
    """report.json, report.md and (unless --no-plots) the figures under ``out``; the table on stdout."""
    table = leaderboard.markdown(results, header)
    (out / "report.json").write_text(json.dumps({"header": header, "results": results}, indent=1) + "\n")
    (out / "report.md").write_text(table)
    written = ["report.json", "report.md"]
    if not args.no_plots:
        from .. import plots

        data = leaderboard.table(results)
        written += plots.sweep_plots(data, leaderboard.task_order(results), header, out,
                                     leaderboard.errors(results))
    print(table, end="")
    print(f"wrote {out}/: {', '.join(written)}", file=sys.stderr)


def _passkey(args, out: Path, dtype: torch.dtype | None, progress: bool) -> None:
    from ..evaluate import Grid, markdown
    from . import passkey

    grid = Grid()
    if args.quick:
        grid = Grid(policies=["dense", "window", "sink", "h2o"], budgets=[0.25], lengths=[256],
                    depths=[0.0, 0.5, 1.0], trials=1, stream_tokens=256)
    overrides = {k: getattr(args, k) for k in ("policies", "budgets", "lengths", "depths", "trials",
                                               "stream_tokens") if getattr(args, k) is not None}
    check_grid(overrides.get("policies", ()))
    grid = Grid(**{**grid.__dict__, **overrides})
    from ..cache.registry import reconstructs

    check_grid(grid.policies)
    passes = [p for p in grid.policies if reconstructs(p)]
    if passes:
        raise ValueError(f"--policies {', '.join(passes)}: a policy that compresses a context by reconstructing it "
                         "is not run by the passkey grid (streaming perplexity, one prompt at a time); evaluate "
                         "it with --benchmark ruler or --dataset FILE.jsonl")
    tokenizer = load_tokenizer(args.model)
    check_chat(args, tokenizer)
    model = load(args.model, dtype=dtype, device=args.device, weights=args.weights)
    check_grid(grid.policies, model)
    runner = passkey.Runner()
    runner.stream(tokenizer, args.texts)  # the texts, read (and checked) once before anything is written
    out = out_dir(str(out))  # the first thing written: after every check above
    # Every unit of the grid is a cell written to OUT/cells/ as it finishes: a rerun resumes.
    cells, bench = passkey.plan(grid), Bench.make("passkey", texts=args.texts, chat=args.chat, weights=args.weights)
    done = len(cells) - len(sweep.pending(cells, bench, out))
    print(f"kvcache eval: writing the report to {out}/ (--out DIR to change); {_count(len(cells), 'cell')}, {done} already "
          f"in {out}/cells", file=sys.stderr)
    if args.ray is None:
        results = sweep.run(model, tokenizer, cells, bench, out, runner=runner, progress=progress)
    else:
        from . import ray_sweep

        results = ray_sweep.run(args.model, cells, bench, out, address=args.ray or None, threads=args.threads or 1,
                                dtype=dtype, device=args.device, weights=args.weights, runner=runner,
                                progress=progress)
    report = passkey.grid_report(grid, cells, results)
    report["header"] = {"model": args.model or f"bundled ({BUNDLED_MODEL.name})",
                        "lengths": ", ".join(map(str, grid.lengths)), "trials": grid.trials,
                        "depths": ", ".join(f"{d:g}" for d in grid.depths),
                        "budgets (fraction kept)": ", ".join(f"{b:g}" for b in grid.budgets),
                        "streaming tokens": grid.stream_tokens, "weights": args.weights,
                        "chat template": "yes" if args.chat else "no"}
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    table = markdown(report)
    (out / "report.md").write_text(table)
    written = ["report.json", "report.md"]
    if not args.no_plots:
        from .. import plots

        written += plots.passkey_plots(report, out)
    print(table, end="")
    print(f"wrote {out}/: {', '.join(written)}", file=sys.stderr)
