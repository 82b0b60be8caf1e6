"""PNG plots of an evaluation report (needs matplotlib: ``pip install kvcache[eval]``)."""

from __future__ import annotations

from pathlib import Path


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("plots need matplotlib: pip install 'kvcache[eval]'") from None
    return plt


def quality_vs_budget(report: dict, path: Path) -> None:
    """Perplexity and passkey accuracy (each protocol) against the budget, one line per policy."""
    plt = _pyplot()
    protocols = sorted({r["protocol"] for r in report["passkey"]})
    fig, axes = plt.subplots(1, 1 + len(protocols), figsize=(5 * (1 + len(protocols)), 4))
    policies = list(dict.fromkeys(s["policy"] for s in report["streaming"]))
    for policy in policies:
        rows = [s for s in report["streaming"] if s["policy"] == policy]
        budgets = [s["budget"] for s in rows]
        style = dict(linestyle="--", color="black") if policy == "dense" else dict(marker="o")
        if policy == "dense":
            axes[0].axhline(rows[0]["perplexity"], label=policy, **style)
        else:
            axes[0].plot(budgets, [s["perplexity"] for s in rows], label=policy, **style)
        for ax, protocol in zip(axes[1:], protocols):
            accs = []
            for b in budgets:
                cell = [r["accuracy"] for r in report["passkey"]
                        if r["policy"] == policy and r["budget"] == b and r["protocol"] == protocol]
                accs.append(100 * sum(cell) / len(cell))
            if policy == "dense":
                ax.axhline(accs[0], label=policy, **style)
            else:
                ax.plot(budgets, accs, label=policy, **style)
    axes[0].set(xlabel="cache budget (fraction of context)", ylabel="streaming perplexity", xscale="log")
    axes[0].set_title("perplexity (lower is better)")
    for ax, protocol in zip(axes[1:], protocols):
        ax.set(xlabel="cache budget (fraction of context)", ylabel="passkey accuracy (%)", xscale="log",
               ylim=(-5, 105))
        ax.set_title(f"passkey, {protocol.replace('_', '-')}")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def passkey_heatmaps(report: dict, path: Path, budget: float) -> None:
    """Accuracy by depth x context length, one panel per policy and protocol, at ``budget``."""
    plt = _pyplot()
    rows = [r for r in report["passkey"] if r["budget"] in (budget, 1.0)]
    keys = list(dict.fromkeys((r["policy"], r["protocol"]) for r in rows
                              if r["policy"] == "dense" or r["budget"] == budget))
    lengths = sorted({r["length"] for r in rows})
    depths = sorted({r["depth"] for r in rows})
    cols = 2
    rows_n = (len(keys) + 1) // cols
    fig, axes = plt.subplots(rows_n, cols, figsize=(4.5 * cols, 3.4 * rows_n), squeeze=False,
                             constrained_layout=True)
    for ax, (policy, protocol) in zip(axes.flat, keys):
        grid = [[next(r["accuracy"] for r in rows if r["policy"] == policy and r["protocol"] == protocol
                      and r["length"] == n and r["depth"] == d) for n in lengths] for d in depths]
        image = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto", origin="lower")
        ax.set(xticks=range(len(lengths)), xticklabels=lengths, yticks=range(len(depths)),
               yticklabels=[f"{d:.0%}" for d in depths], xlabel="context length", ylabel="needle depth")
        label = "dense" if policy == "dense" else f"{policy} @ {budget:g}"
        ax.set_title(f"{label}, {protocol.replace('_', '-')}", fontsize=9)
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    fig.colorbar(image, ax=axes, shrink=0.6, label="accuracy")
    fig.savefig(path, dpi=120)
    plt.close(fig)
