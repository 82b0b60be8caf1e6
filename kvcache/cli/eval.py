"""``kvcache eval``: its flags, and what it does once they are parsed.

    passkey   the streaming perplexity / agreement / passkey grid of kvcache/eval/quality.py, each
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

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from ..checkpoints.load import BUNDLED_MODEL, WEIGHTS, load, load_tokenizer
from ..errors import KVCacheError
from ..eval import dataset as ds
from ..eval import leaderboard, ruler, sweep
from ..eval.cell import BATCH, PROTOCOLS, Bench
from ..eval.sample import chat_parts
from .args import (
    DTYPES,
    THREADS_HELP,
    apply_threads,
    cache_names,
    comma_list,
    device_arg,
    dtype_arg,
    int_at_least,
)

DEFAULT_EVAL_OUT = "kvcache-eval"


def add_parser(commands) -> None:
    ev = commands.add_parser(
        "eval", help="quality of policies against dense: RULER (offline), your dataset, or perplexity and passkey",
        description="--benchmark passkey (default): streaming perplexity, agreement and passkey retrieval. "
                    "--benchmark ruler: RULER's 13 tasks generated offline at --lengths tokens, kvpress's protocol "
                    "(--ratios, query-agnostic and query-aware). --dataset FILE.jsonl: your own tasks. RULER and "
                    "dataset sweeps write each cell to --out as it finishes; rerunning resumes. See docs/eval.md.",
        allow_abbrev=False)
    ev.add_argument("--benchmark", choices=("passkey", "ruler", "dataset"),
                    help="what to run (default: dataset with --dataset, else passkey)")
    ev.add_argument("--model", metavar="PATH", help="checkpoint directory or GGUF file (default: bundled)")
    ev.add_argument("--dtype", choices=DTYPES, help="default: float32 on CPU, the checkpoint's elsewhere")
    ev.add_argument("--device", type=device_arg, default="cpu", help="e.g. cpu, cuda, cuda:1 (default: cpu)")
    ev.add_argument("--weights", choices=WEIGHTS, default="full",
                    help="int4: the model's projections as 4-bit codes (CPU only; the cells are kept apart from "
                         "full weights' in --out) (default: full)")
    ev.add_argument("--texts", metavar="DIR",
                    help="held-out .txt files for streaming, passkey filler and RULER's essay haystack (default: the "
                         "ones packaged in kvcache/data/texts)")
    ev.add_argument("--policies", "--policy", type=cache_names, metavar="A,B",
                    help="comma-separated (default: every policy the benchmark runs; the passkey grid runs all "
                         "but kvzip), each policy[(option=value,...)][:storage], e.g. "
                         "dense,snapkv,snapkv(window=64,kernel=5):int8; --policy is the same flag")
    ev.add_argument("--budgets", type=comma_list(float), metavar="F,F",
                    help="fractions of the context KEPT (passkey default: 0.125,0.25,0.5)")
    ev.add_argument("--ratios", type=comma_list(float), metavar="F,F",
                    help="ruler/dataset: fractions of the context REMOVED, as kvpress counts them "
                         "(default: 0.25,0.5,0.75); or give --budgets")
    ev.add_argument("--lengths", type=comma_list(int), metavar="N,N",
                    help="context lengths in tokens (passkey default: 512,1024,2048; ruler: 4096)")
    ev.add_argument("--tasks", type=comma_list(str), metavar="A,B", help="ruler/dataset tasks (default: all)")
    ev.add_argument("--protocols", type=comma_list(str), metavar="A,B",
                    help="query_agnostic (the context is compressed before the question), query_aware (with it); "
                         "default both")
    ev.add_argument("--samples", type=int_at_least(1), metavar="N", help="ruler/dataset samples per task (default: 5)")
    ev.add_argument("--seed", type=int, metavar="N", help="ruler: prompts are a function of the seed (default: 0)")
    ev.add_argument("--dataset", metavar="FILE.jsonl",
                    help="JSON lines with context, question, answers (optional max_new_tokens, answer_prefix, task, "
                         "metric); with --benchmark ruler it feeds qa_1/qa_2")
    ev.add_argument("--metric", choices=("string_match_all", "string_match_part", "exact_match", "f1"),
                    help="score every sample by this metric (default: the task's own)")
    ev.add_argument("--chat", action="store_true", help="wrap prompts in the checkpoint's chat template")
    ev.add_argument("--depths", type=comma_list(float), metavar="D,D",
                    help="needle depths in [0, 1] (default: 0,0.25,0.5,0.75,1)")
    ev.add_argument("--trials", type=int_at_least(1), metavar="N", help="passkeys per cell (default: 4)")
    ev.add_argument("--stream-tokens", type=int_at_least(2), metavar="N", help="held-out tokens for streaming (default: 2048)")
    ev.add_argument("--out", default=DEFAULT_EVAL_OUT, metavar="DIR",
                    help=f"directory for report.json, report.md and the PNG plots (default: ./{DEFAULT_EVAL_OUT}); "
                         "finished cells are kept there and a rerun resumes")
    ev.add_argument("--no-plots", action="store_true", help="write the JSON and Markdown reports only (no matplotlib)")
    ev.add_argument("--threads", type=int_at_least(1), metavar="N", help=THREADS_HELP)
    ev.add_argument("--batch", type=int_at_least(1), metavar="N",
                    help="ruler/dataset: decode the answers of up to N cells to a sample as one batch, each row "
                         "attending its own cache (default: 8; each holds a cache at once; 1: one at a time)")
    ev.add_argument("--quick", action="store_true", help="a smoke run of well under a minute")
    ev.add_argument("--report-only", action="store_true",
                    help="ruler/dataset: write the report from the cells already finished under --out, "
                         "running none (a sweep still under way, or one to be finished later)")
    ev.add_argument("--ray", nargs="?", const="", metavar="ADDRESS",
                    help="run the cells as Ray tasks, one model per worker, on a local cluster or on "
                         "the one at ADDRESS (ray start --head prints it); needs kvcache[ray]. See docs/distributed.md")


def _require_matplotlib() -> None:
    """Fail before the grid runs, not after, if the plots cannot be drawn."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise KVCacheError(
            "kvcache eval draws its plots with matplotlib, which is not installed: pip install 'kvcache[eval]' "
            "(or pass --no-plots for the JSON and Markdown reports only)"
        ) from None


def run(args: argparse.Namespace) -> None:
    apply_threads(args.threads)
    out = out_dir(args.out, create=False)  # before anything is loaded: a bad --out fails at once
    if not args.no_plots:
        _require_matplotlib()
    run_benchmark(args, out, dtype_arg(args.dtype, args.device), progress=sys.stderr.isatty())


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
    from ..cache.names import CacheName
    from ..cache.registry import check_names
    from ..cache.storages import check_storage

    check_names(policies, "--policies")
    if model is not None:
        for name in policies:
            storage = CacheName.parse(name).storage
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


def run_benchmark(args, out: Path, dtype: torch.dtype | None, progress: bool) -> None:
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
    from ..cache.names import CacheName
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
    policies = list(dict.fromkeys(str(CacheName.parse(p)) for p in policies))
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
        from ..eval import ray_sweep

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
        from ..eval import plots

        data = leaderboard.table(results)
        written += plots.sweep_plots(data, leaderboard.task_order(results), header, out,
                                     leaderboard.errors(results))
    print(table, end="")
    print(f"wrote {out}/: {', '.join(written)}", file=sys.stderr)


def _passkey(args, out: Path, dtype: torch.dtype | None, progress: bool) -> None:
    from ..eval import passkey
    from ..eval.quality import Grid, markdown

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
        from ..eval import ray_sweep

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
        from ..eval import plots

        written += plots.passkey_plots(report, out)
    print(table, end="")
    print(f"wrote {out}/: {', '.join(written)}", file=sys.stderr)
