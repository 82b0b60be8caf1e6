"""Per-task and average scores of a sweep's results, and the markdown leaderboard.

``scores(results)`` -> rows {policy, ratio, protocol, task, score} averaged over lengths;
``average`` is the mean over the tasks that ran (skipped ones left out and named).
"""

from __future__ import annotations

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


def table(results: list[dict]) -> dict:
    """{(policy, ratio, protocol): {task: mean score over lengths}}; dense (ratio 0) appears
    under every protocol, since it compresses nothing."""
    protocols = [p for p in PROTOCOLS if any(r["cell"]["protocol"] == p and r["cell"]["ratio"] > 0 for r in results)]
    protocols = protocols or [PROTOCOLS[0]]
    sums: dict = defaultdict(lambda: defaultdict(list))
    for r in results:
        if r.get("skipped"):
            continue
        c = r["cell"]
        for protocol in protocols if c["ratio"] == 0 else [c["protocol"]]:
            sums[(c["policy"], c["ratio"], protocol)][c["task"]].append(r["score"])
    return {key: {task: sum(v) / len(v) for task, v in tasks.items()} for key, tasks in sums.items()}


def average(per_task: dict[str, float]) -> float:
    return sum(per_task.values()) / len(per_task)


def _rows(results: list[dict]):
    data = table(results)
    protocols = [p for p in PROTOCOLS if any(k[2] == p for k in data)]
    for protocol in protocols:
        keys = sorted((k for k in data if k[2] == protocol), key=lambda k: (k[1] > 0, k[0], k[1]))
        yield protocol, [(k[0], k[1], data[k]) for k in keys]


def markdown(results: list[dict], header: dict) -> str:
    """The report: a header naming the model, lengths, samples and seed; per protocol, the
    average score by policy and ratio, then the per-task scores."""
    lines = ["# kvcache eval: " + header.get("benchmark", "ruler"), ""]
    for name, value in header.items():
        lines.append(f"- {name}: {value}")
    skips = skipped(results)
    for task, why in skips.items():
        lines.append(f"- skipped {task}: {why}")
    lines.append("")
    tasks = task_order(results)
    for protocol, rows in _rows(results):
        ratios = sorted({ratio for _, ratio, _ in rows if ratio > 0})
        policies = list(dict.fromkeys(p for p, _, _ in rows))
        lines += [f"## {protocol.replace('_', '-')}: average score (0-100) by compression ratio", "",
                  "| policy | " + " | ".join(f"{r:g}" for r in ratios) + " |",
                  "|---|" + "---:|" * len(ratios)]
        for policy in policies:
            mine = {ratio: per for p, ratio, per in rows if p == policy}
            if 0.0 in mine and len(mine) == 1:
                cells = [f"{average(mine[0.0]):.1f}"] * len(ratios)
            else:
                cells = [f"{average(mine[r]):.1f}" if r in mine else "-" for r in ratios]
            lines.append(f"| {policy} | " + " | ".join(cells) + " |")
        lines += ["", f"### {protocol.replace('_', '-')}: score per task", "",
                  "| policy | ratio | " + " | ".join(tasks) + " | average |",
                  "|---|---:|" + "---:|" * (len(tasks) + 1)]
        for policy, ratio, per in rows:
            cells = [f"{per[t]:.1f}" if t in per else "-" for t in tasks]
            lines.append(f"| {policy} | {ratio:g} | " + " | ".join(cells) + f" | {average(per):.1f} |")
        lines.append("")
    return "\n".join(lines)
