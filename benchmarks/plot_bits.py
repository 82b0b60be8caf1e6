"""Top-1 agreement against bits per element, one point per storage or screened method (the mean
over texts, with the range of texts as an error bar), from the JSON of ``agreement.py`` (real
storages: filled markers) and ``kv_screen.py`` (simulated methods: hollow markers), with the
floors of docs/quantized.md drawn as boxes to reach.

    python benchmarks/plot_bits.py agreement.json screen.json [...] --out docs/quantized_bits.png
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# (most bits per element, least top-1 agreement): the floors of docs/quantized.md.
FLOORS = ((5.0, 0.98), (3.75, 0.95), (3.0, 0.90))


def points(paths: list[str]) -> dict[tuple[str, bool], list[dict]]:
    """Rows by (label, real storage?), one per text (a text met in several reports: the last)."""
    found = defaultdict(dict)
    for path in paths:
        with open(path) as f:
            report = json.load(f)
        for row in report["results"]:
            real = "storage" in row
            found[(row["storage"] if real else row["method"], real)][row["text"]] = row
    return {key: list(rows.values()) for key, rows in found.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("reports", nargs="+", help="JSON of agreement.py or kv_screen.py")
    p.add_argument("--out", required=True, help="PNG to write")
    p.add_argument("--only", nargs="+", default=None, help="the storages and methods to draw (default: all)")
    p.add_argument("--floor", type=float, default=0.6, help="the lowest agreement drawn; points below are listed")
    p.add_argument("--title", default="SmolLM2-135M-Instruct, float32, 4096-token streams in 256-token chunks")
    args = p.parse_args()
    fig, ax = plt.subplots(figsize=(9, 6))
    for bits, floor in FLOORS:
        ax.fill_between([0, bits], floor, 1.0, color="C2", alpha=0.08, linewidth=0)
        ax.plot([0, bits, bits], [floor, floor, 1.0], color="C2", linewidth=0.8, linestyle=":")
    below = []
    for (label, real), rows in sorted(points(args.reports).items()):
        if args.only is not None and label not in args.only:
            continue
        agree = [r["top1_agreement"] for r in rows]
        bits = sum(r["bits_per_element"] for r in rows) / len(rows)
        mean = sum(agree) / len(agree)
        if mean < args.floor:
            below.append(f"{label} {mean:.0%}")
            continue
        err = [[mean - min(agree)], [max(agree) - mean]]
        style = dict(color="C0", marker="s") if real else dict(color="C1", marker="o", markerfacecolor="none")
        ax.errorbar([bits], [mean], yerr=err, linestyle="none", capsize=2, markersize=6, **style)
        ax.annotate(label, (bits, mean), textcoords="offset points", xytext=(4, 3), fontsize=7)
    ax.set_xlabel("bits per stored element (codes, scales, full-precision tokens, positions)")
    ax.set_ylabel("top-1 agreement with dense (mean over texts, bar: range)")
    ax.set_xlim(2, 9)
    ax.set_ylim(args.floor, 1.0)
    note = f"; below the axis: {', '.join(below)}" if below else ""
    ax.set_title(f"{args.title}\nsquares: storages; circles: screened methods (simulated); shaded: the floors{note}",
                 fontsize=10)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)


if __name__ == "__main__":
    main()
