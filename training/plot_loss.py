"""Plot a training run's loss.jsonl (from train.py): training loss, held-out loss and passkey accuracy.

    python training/plot_loss.py data/reference_model/loss.jsonl docs/reference_model/loss.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log", type=Path)
    parser.add_argument("png", type=Path)
    parser.add_argument("--smooth", type=int, default=10, help="moving average over this many records")
    args = parser.parse_args()

    records = [json.loads(line) for line in args.log.read_text().splitlines() if line.strip()]
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "heldout_loss" in r]
    steps = [r["step"] for r in train]
    k = max(1, args.smooth)

    def smooth(values: list[float]) -> list[float]:
        return [sum(values[max(0, i - k + 1) : i + 1]) / len(values[max(0, i - k + 1) : i + 1])
                for i in range(len(values))]

    fig, (ax_loss, ax_key) = plt.subplots(1, 2, figsize=(11, 4))
    ax_loss.plot(steps, smooth([r["lm_loss"] for r in train]), label="training (all tokens)")
    ax_loss.plot(steps, smooth([r["loss"] for r in train]), label="training (answers weighted)", alpha=0.6)
    ax_loss.plot([r["step"] for r in evals], [r["heldout_loss"] for r in evals], "o-", label="held-out text")
    ax_loss.set(xlabel="step", ylabel="cross-entropy (nats/token)", ylim=(None, min(8.0, ax_loss.get_ylim()[1])))
    ax_loss.legend()
    ax_loss.set_title("loss")
    keyed = [r for r in evals if "passkey" in r]
    ax_key.plot([r["step"] for r in keyed], [100 * r["passkey"] for r in keyed], "o-", color="C2")
    # A log stitched from resumed stages (a "stage" field per record) gets a line where each begins.
    starts = [r["step"] for i, r in enumerate(records) if "stage" in r and (i == 0 or records[i - 1].get("stage") != r["stage"])]
    for ax in (ax_loss, ax_key):
        for x in starts[1:]:
            ax.axvline(x, color="grey", lw=0.6, ls=":")
    ax_key.set(xlabel="step", ylabel="passkey accuracy (%)", ylim=(-5, 105))
    ax_key.set_title("dense passkey (train.py --eval-length), depths 0-100%")
    fig.tight_layout()
    args.png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.png, dpi=110)


if __name__ == "__main__":
    main()
