"""Per-task and average scores of a sweep's results, their sampling error, and the markdown
leaderboard.

``table(results)`` -> {(policy, ratio, protocol): {task: score}} averaged over lengths;
``average`` is the mean over the tasks that ran (skipped ones left out and named).
``errors`` gives each average's standard error over the samples, and ``against_dense`` each
policy's difference from dense paired on the samples both ran: a policy that drops nothing the
answers need differs from dense by no more than its own noise, and the pairing removes what the
two share (a hard sample is hard for both), so the paired error is the one to judge a row by.
"""

from __future__ import annotations

import math
from collections import defaultdict

from .cell import PROTOCOLS
from .ruler import TASKS


def _order(tasks: set[str]) -> list[str]:
    return [t for t in TASKS if t in tasks] + sorted(tasks - set(TASKS))


def task_order(results: list[dict]) -> list[str]:
    """The tasks that ran, RULER's in RULER's order, then a dataset's by name."""
    return _order({r["cell"]["task"] for r in results if not r.get("skipped")})


def skipped(results: list[dict]) -> dict[str, str]:
    return {r["cell"]["task"]: r["skipped"] for r in results if r.get("skipped")}


def dense_zeros(results: list[dict]) -> list[str]:
    """The tasks on which dense, which keeps every token, scores 0 at every length: there the
    model cannot do the task at all, so its policies' scores say nothing about the policies."""
    dense = {key: tasks for key, tasks in table(results).items() if key[0] == "dense"}
    tasks = {task for per in dense.values() for task in per}
    return [t for t in _order(tasks) if all(per.get(t, 0.0) == 0.0 for per in dense.values())]


def table(results: list[dict]) -> dict:
    """{(policy, ratio, protocol): {task: mean score over lengths}}; dense (ratio 0) appears
    under every protocol, since it compresses nothing."""
    return {key: {task: sum(sum(s.values()) / len(s) for s in lengths.values()) / len(lengths)
                  for task, lengths in tasks.items()} for key, tasks in _cells(results).items()}


def average(per_task: dict[str, float]) -> float:
    return sum(per_task.values()) / len(per_task)


def _protocols(results: list[dict]) -> list[str]:
    found = [p for p in PROTOCOLS if any(r["cell"]["protocol"] == p and r["cell"]["ratio"] > 0 for r in results)]
    return found or [PROTOCOLS[0]]


def _cells(results: list[dict]) -> dict:
    """{(policy, ratio, protocol): {task: {length: {sample index: score}}}}, dense under every protocol."""
    protocols = _protocols(results)
    found: dict = defaultdict(lambda: defaultdict(dict))
    for r in results:
        if r.get("skipped"):
            continue
        c = r["cell"]
        for protocol in protocols if c["ratio"] == 0 else [c["protocol"]]:
            scores = {o["index"]: o["score"] for o in r["samples"]}
            found[(c["policy"], c["ratio"], protocol)][c["task"]][c["length"]] = scores
    return found


def _error(per_task: dict[str, dict[int, list[float]]]) -> float | None:
    """Standard error of the mean over tasks of each task's mean over lengths of the mean of its
    values, the values independent draws; None where a (task, length) has fewer than 2."""
    variance = 0.0
    for lengths in per_task.values():
        for values in lengths.values():
            n = len(values)
            if n < 2:
                return None
            mean = sum(values) / n
            variance += sum((x - mean) ** 2 for x in values) / (n - 1) / n / len(lengths) ** 2
    return math.sqrt(variance) / len(per_task)


def errors(results: list[dict]) -> dict:
    """{(policy, ratio, protocol): standard error of ``average(table(results)[key])``}: the scores
    of a cell's samples taken as independent draws (None where a cell has a single sample)."""
    return {key: _error({task: {n: list(s.values()) for n, s in lengths.items()} for task, lengths in tasks.items()})
            for key, tasks in _cells(results).items()}


def against_dense(results: list[dict]) -> dict:
    """{(policy, ratio, protocol): (difference, standard error)} for every compressed row: its
    score minus dense's, sample by sample on the (task, length, sample) both ran, averaged as the
    leaderboard averages, with the standard error of that paired difference (None where a cell
    shares fewer than 2 samples with dense). Empty without dense cells."""
    cells = _cells(results)
    out = {}
    for key, tasks in cells.items():
        dense = cells.get(("dense", 0.0, key[2]))
        if key[0] == "dense" or dense is None:
            continue
        diffs = {task: {n: [s[i] - dense[task][n][i] for i in sorted(s) if i in dense[task].get(n, {})]
                        for n, s in lengths.items() if n in dense[task]}
                 for task, lengths in tasks.items() if task in dense}
        diffs = {task: lengths for task, lengths in diffs.items() if lengths and all(lengths.values())}
        if diffs:
            mean = average({t: sum(sum(v) / len(v) for v in ls.values()) / len(ls) for t, ls in diffs.items()})
            out[key] = (mean, _error(diffs))
    return out


def _pm(value: float, error: float | None, sign: str = "") -> str:
    return f"{value:{sign}.1f}" + ("" if error is None else f" ± {error:.1f}")


def _rows(results: list[dict]):
    data = table(results)
    protocols = [p for p in PROTOCOLS if any(k[2] == p for k in data)]
    for protocol in protocols:
        keys = sorted((k for k in data if k[2] == protocol), key=lambda k: (k[1] > 0, k[0], k[1]))
        yield protocol, [(k[0], k[1], data[k]) for k in keys]


def markdown(results: list[dict], header: dict) -> str:
    """The report: a header naming the model, lengths, samples and seed; per protocol, the
    average score by policy and ratio (± its standard error over the samples), each row's
    difference from dense paired on the same samples, then the per-task scores."""
    lines = ["# kvcache eval: " + header.get("benchmark", "ruler"), ""]
    for name, value in header.items():
        lines.append(f"- {name}: {value}")
    skips = skipped(results)
    for task, why in skips.items():
        lines.append(f"- skipped {task}: {why}")
    zeros = dense_zeros(results)
    if zeros:
        lines.append(f"- dense scores 0 on {', '.join(zeros)}: the model cannot do {'it' if len(zeros) == 1 else 'them'} "
                     "at these lengths even with every token kept, so the policies' scores there say nothing of the "
                     "policies (a larger or instruction-tuned model, or shorter lengths, would)")
    lines.append("")
    tasks = task_order(results)
    spread, paired = errors(results), against_dense(results)
    for protocol, rows in _rows(results):
        ratios = sorted({ratio for _, ratio, _ in rows if ratio > 0})
        policies = list(dict.fromkeys(p for p, _, _ in rows))
        name = protocol.replace("_", "-")

        def grid(title: str, cell, keep=lambda policy: True) -> list[str]:
            out = [title, "", "| policy | " + " | ".join(f"{r:g}" for r in ratios) + " |",
                   "|---|" + "---:|" * len(ratios)]
            for policy in filter(keep, policies):
                ratio_of = {ratio for p, ratio, _ in rows if p == policy}
                at = [0.0] * len(ratios) if ratio_of == {0.0} else ratios  # a row that keeps all fills every ratio
                out.append(f"| {policy} | " + " | ".join(cell((policy, r, protocol)) for r in at) + " |")
            return out + [""]

        data = {(p, r, protocol): per for p, r, per in rows}
        lines += grid(f"## {name}: average score (0-100) by compression ratio",
                      lambda k: _pm(average(data[k]), spread.get(k)) if k in data else "-")
        if any(k[2] == protocol for k in paired):
            lines += grid(f"### {name}: difference from dense on the same samples (points)",
                          lambda k: _pm(*paired[k], sign="+") if k in paired else "-",
                          keep=lambda policy: policy != "dense")
        lines += [f"### {name}: score per task", "",
                  "| policy | ratio | " + " | ".join(tasks) + " | average |",
                  "|---|---:|" + "---:|" * (len(tasks) + 1)]
        for policy, ratio, per in rows:
            cells = [f"{per[t]:.1f}" if t in per else "-" for t in tasks]
            lines.append(f"| {policy} | {ratio:g} | " + " | ".join(cells) + f" | {average(per):.1f} |")
        lines.append("")
    if spread and any(v is not None for v in spread.values()):
        lines += ["± is one standard error over the samples, each sample taken as an independent draw; "
                  "a difference from dense is paired on the samples both ran.", ""]
    return "\n".join(lines)
