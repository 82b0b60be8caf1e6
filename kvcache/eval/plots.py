"""PNG plots of evaluation reports (needs matplotlib: ``pip install kvcache[eval]``).

Readable at a glance: linear axes with a tick at every budget or ratio that was run, labelled
with its value; one colour, line style and hollow marker shape per policy (markers shrink down
the legend, so a line drawn over an identical one still shows); panels always in the order
query-agnostic, query-aware; each heatmap states the budget or ratio it shows; every figure's
title names the model and lengths.
"""

from __future__ import annotations

from pathlib import Path

PROTOCOL_ORDER = ("query_agnostic", "query_aware")
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">", "h", "p")
LINESTYLES = ("-", "--", "-.", ":")


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("plots need matplotlib: pip install 'kvcache[eval]'") from None
    return plt


def _style(i: int, policy: str) -> dict:
    if policy == "dense":
        return dict(color="black", linestyle="--", linewidth=1.2)
    return dict(marker=MARKERS[i % len(MARKERS)], linestyle=LINESTYLES[i % len(LINESTYLES)],
                color=f"C{i % 10}", markerfacecolor="none", markeredgewidth=1.6,
                markersize=max(4.0, 11.0 - 0.8 * i), linewidth=1.4)


def _protocols(found) -> list[str]:
    found = set(found)
    return [p for p in PROTOCOL_ORDER if p in found]


def _title(header: dict) -> str:
    parts = [f"model {header.get('model', '?')}"]
    for key in ("lengths", "trials", "samples per task"):
        if key in header:
            parts.append(f"{key} {header[key]}")
    return ", ".join(parts)


def _ticks(ax, values, label: str) -> None:
    values = sorted(set(values))
    ax.set_xticks(values)
    ax.set_xticklabels([f"{v:g}" for v in values])
    span = (values[-1] - values[0]) or 0.1
    ax.set_xlim(values[0] - 0.08 * span, values[-1] + 0.08 * span)
    ax.set_xlabel(label)
    ax.grid(alpha=0.3)


# --- the passkey benchmark -------------------------------------------------------------------


def passkey_plots(report: dict, out: Path) -> list[str]:
    """quality_vs_budget.png and one passkey_heatmap_budget-<b>.png per budget; returns the names."""
    names = ["quality_vs_budget.png"]
    quality_vs_budget(report, Path(out) / names[0])
    for budget in sorted({r["budget"] for r in report["passkey"] if r["policy"] != "dense"}):
        name = f"passkey_heatmap_budget-{budget:g}.png"
        passkey_heatmaps(report, Path(out) / name, budget)
        names.append(name)
    return names


def quality_vs_budget(report: dict, path: Path) -> None:
    """Perplexity and passkey accuracy (each protocol) against the budget, one line per policy."""
    plt = _pyplot()
    protocols = _protocols(r["protocol"] for r in report["passkey"])
    fig, axes = plt.subplots(1, 1 + len(protocols), figsize=(5.2 * (1 + len(protocols)), 4.4), squeeze=False)
    axes = axes[0]
    policies = list(dict.fromkeys(s["policy"] for s in report["streaming"]))
    budgets = sorted({s["budget"] for s in report["streaming"] if s["policy"] != "dense"}) or [1.0]
    for i, policy in enumerate(policies):
        rows = [s for s in report["streaming"] if s["policy"] == policy]
        style = _style(i, policy)
        xs = [s["budget"] for s in rows]
        if policy == "dense":
            axes[0].axhline(rows[0]["perplexity"], label=policy, **style)
        else:
            axes[0].plot(xs, [s["perplexity"] for s in rows], label=policy, **style)
        for ax, protocol in zip(axes[1:], protocols):
            accs = []
            for b in xs:
                cell = [r["accuracy"] for r in report["passkey"]
                        if r["policy"] == policy and r["budget"] == b and r["protocol"] == protocol]
                accs.append(100 * sum(cell) / len(cell))
            if policy == "dense":
                ax.axhline(accs[0], label=policy, **style)
            else:
                ax.plot(xs, accs, label=policy, **style)
    _ticks(axes[0], budgets, "cache budget (fraction of the context kept)")
    axes[0].set(ylabel="streaming perplexity", title="perplexity (lower is better)")
    for ax, protocol in zip(axes[1:], protocols):
        _ticks(ax, budgets, "cache budget (fraction of the context kept)")
        ax.set(ylabel="passkey accuracy (%)", ylim=(-5, 105), title=f"passkey, {protocol.replace('_', '-')}")
    axes[-1].legend(loc="center left", bbox_to_anchor=(1.02, 0.5), fontsize=8)
    fig.suptitle(_title(report.get("header", {})), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def passkey_heatmaps(report: dict, path: Path, budget: float) -> None:
    """Accuracy by depth x context length at ``budget`` (stated in the title): one row per
    policy (dense, the reference, first), one column per protocol."""
    plt = _pyplot()
    rows = [r for r in report["passkey"] if r["policy"] == "dense" or r["budget"] == budget]
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    protocols = _protocols(r["protocol"] for r in rows)
    lengths = sorted({r["length"] for r in rows})
    depths = sorted({r["depth"] for r in rows})
    fig, axes = plt.subplots(len(policies), len(protocols), figsize=(3.6 * len(protocols) + 1, 2.4 * len(policies) + 0.8),
                             squeeze=False, constrained_layout=True)
    image = None
    for row, policy in enumerate(policies):
        for col, protocol in enumerate(protocols):
            ax = axes[row][col]
            grid = [[next(r["accuracy"] for r in rows if r["policy"] == policy and r["protocol"] == protocol
                          and r["length"] == n and r["depth"] == d) for n in lengths] for d in depths]
            image = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto", origin="lower")
            ax.set(xticks=range(len(lengths)), xticklabels=lengths, yticks=range(len(depths)),
                   yticklabels=[f"{d:.0%}" for d in depths])
            if row == len(policies) - 1:
                ax.set_xlabel("context length (tokens)")
            if col == 0:
                ax.set_ylabel("needle depth")
            label = "dense (everything kept)" if policy == "dense" else f"{policy}, budget {budget:g}"
            ax.set_title(f"{label}\n{protocol.replace('_', '-')}", fontsize=8)
    fig.colorbar(image, ax=axes, shrink=0.6, label="passkey accuracy")
    fig.suptitle(f"passkey accuracy at budget {budget:g} (fraction of the context kept)\n"
                 f"{_title(report.get('header', {}))}", fontsize=9)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --- RULER and dataset sweeps ----------------------------------------------------------------


def sweep_plots(data: dict, tasks: list[str], header: dict, out: Path, errors: dict | None = None) -> list[str]:
    """score_vs_ratio.png and one task_heatmap_ratio-<r>.png per ratio; returns the names.
    ``data``: {(policy, ratio, protocol): {task: score}} (kvcache.eval.leaderboard.table);
    ``tasks``: the heatmaps' rows, in order; ``errors``: the same keys to each average's
    standard error (kvcache.eval.leaderboard.errors), drawn as error bars where given."""
    if not data:
        return []
    names = ["score_vs_ratio.png"]
    score_vs_ratio(data, header, Path(out) / names[0], errors or {})
    for ratio in sorted({k[1] for k in data if k[1] > 0}):
        name = f"task_heatmap_ratio-{ratio:g}.png"
        task_heatmap(data, tasks, header, ratio, Path(out) / name)
        names.append(name)
    return names


def _average(per_task: dict) -> float:
    return sum(per_task.values()) / len(per_task)


def score_vs_ratio(data: dict, header: dict, path: Path, errors: dict | None = None) -> None:
    """Average score over tasks against the compression ratio, one panel per protocol, with
    one standard error either side where ``errors`` gives it (a band for the rows that keep
    every token; bars, each policy's nudged sideways so that they do not hide each other)."""
    plt = _pyplot()
    errors = errors or {}
    protocols = _protocols(k[2] for k in data)
    policies = list(dict.fromkeys(sorted((k[0] for k in data), key=lambda p: p != "dense")))
    ratios = sorted({k[1] for k in data if k[1] > 0}) or [0.0]
    nudge = 0.012 * ((ratios[-1] - ratios[0]) or 0.1) * 4 / max(len(policies), 1)
    # The axis ends a little above the highest bar, not at 100: a grid that scores 30 at best
    # would otherwise be drawn in the bottom third.
    top = min(103.0, max(_average(v) + (errors.get(k) or 0.0) for k, v in data.items()) + 8.0)
    fig, axes = plt.subplots(1, len(protocols), figsize=(5.4 * len(protocols), 4.4), squeeze=False)
    axes = axes[0]
    for ax, protocol in zip(axes, protocols):
        for i, policy in enumerate(policies):
            keys = sorted((k for k in data if k[0] == policy and k[2] == protocol), key=lambda k: k[1])
            points = [(k[1], _average(data[k]), errors.get(k)) for k in keys]
            style = _style(i, policy)
            if policy == "dense" or all(r == 0 for r, _, _ in points):
                _, score, error = points[0]
                ax.axhline(score, label=f"{policy} (no compression)", **{**style, "marker": None})
                if error is not None:
                    ax.axhspan(score - error, score + error, color=style["color"], alpha=0.08, linewidth=0)
                continue
            xs = [r + (i - len(policies) / 2) * nudge for r, _, _ in points]
            ys = [s for _, s, _ in points]
            if all(e is not None for _, _, e in points):
                ax.errorbar(xs, ys, yerr=[e for _, _, e in points], label=policy, capsize=2, elinewidth=0.9, **style)
            else:
                ax.plot(xs, ys, label=policy, **style)
        _ticks(ax, ratios, "compression ratio (fraction of the context removed)")
        ax.set(ylabel="average score over tasks (0-100)" + (", ± 1 s.e." if errors else ""), ylim=(-3, top),
               title=protocol.replace("_", "-"))
    axes[-1].legend(loc="center left", bbox_to_anchor=(1.02, 0.5), fontsize=8)
    fig.suptitle(_title(header), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def task_heatmap(data: dict, tasks: list[str], header: dict, ratio: float, path: Path) -> None:
    """Score per task x policy at ``ratio`` (stated in the title), one panel per protocol; dense
    is the uncompressed reference column."""
    plt = _pyplot()
    protocols = _protocols(k[2] for k in data)
    policies = list(dict.fromkeys(sorted((k[0] for k in data if k[1] in (0, ratio)), key=lambda p: p != "dense")))
    fig, axes = plt.subplots(1, len(protocols), figsize=(1.0 + (0.7 * len(policies) + 1.6) * len(protocols),
                                                         0.42 * len(tasks) + 2.2), squeeze=False, constrained_layout=True)
    image = None
    for ax, protocol in zip(axes[0], protocols):
        grid = []
        for task in tasks:
            row = []
            for policy in policies:
                per = data.get((policy, ratio, protocol)) or data.get((policy, 0.0, protocol)) or {}
                row.append(per.get(task, float("nan")))
            grid.append(row)
        image = ax.imshow(grid, vmin=0, vmax=100, cmap="RdYlGn", aspect="auto")
        for y, row in enumerate(grid):
            for x, v in enumerate(row):
                if v == v:
                    ax.text(x, y, f"{v:.0f}", ha="center", va="center", fontsize=7)
        ax.set(xticks=range(len(policies)), yticks=range(len(tasks)), yticklabels=tasks)
        ax.set_xticklabels(policies, rotation=45, ha="right")
        ax.set_title(protocol.replace("_", "-"), fontsize=9)
    fig.colorbar(image, ax=axes, shrink=0.7, label="score (0-100)")
    fig.suptitle(f"score per task at compression ratio {ratio:g} (dense: uncompressed)\n{_title(header)}", fontsize=9)
    fig.savefig(path, dpi=120)
    plt.close(fig)
