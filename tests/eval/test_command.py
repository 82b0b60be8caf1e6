"""``kvcache eval`` for RULER and datasets: reports, plots, resumption, and clear errors."""

from __future__ import annotations

import json

import pytest

from kvcache.cli import main

pytestmark = pytest.mark.cpu_only("the command line loads its model on the CPU by default")

pytest.importorskip("matplotlib")


def test_out_that_is_a_file_is_a_clear_error(tmp_path, capsys):
    target = tmp_path / "report.txt"
    target.write_text("mine")
    for benchmark in ("passkey", "ruler"):
        assert main(["eval", "--benchmark", benchmark, "--out", str(target)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("kvcache: error: --out ") and "is not a directory" in err
        assert "Traceback" not in err
    assert target.read_text() == "mine"


def test_ruler_sweep_writes_report_and_plots_and_resumes(tiny_dir, tmp_path, capsys):
    out = tmp_path / "out"
    args = ["eval", "--benchmark", "ruler", "--model", str(tiny_dir), "--tasks", "niah_single_1,qa_1",
            "--lengths", "512", "--policies", "dense,window,sink", "--budgets", "0.25,0.5", "--samples", "1",
            "--threads", "1", "--out", str(out)]
    assert main(args) == 0
    captured = capsys.readouterr()
    report = json.loads((out / "report.json").read_text())
    assert report["header"]["lengths"] == "512" and report["header"]["samples per task"] == 1
    names = {r["cell"]["task"] for r in report["results"]}
    assert names == {"niah_single_1", "qa_1"}
    assert {r["cell"]["ratio"] for r in report["results"]} == {0.0, 0.75, 0.5}
    md = (out / "report.md").read_text()
    assert md.startswith("# kvcache eval: ruler") and f"- model: {tiny_dir}" in md and "- lengths: 512" in md
    for png in ("score_vs_ratio.png", "task_heatmap_ratio-0.5.png", "task_heatmap_ratio-0.75.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    assert "18 cells (0 already" in captured.err
    assert main(args) == 0
    assert "18 cells (18 already" in capsys.readouterr().err


def test_dataset_benchmark_scores_the_file(tiny_dir, tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"context": "The capital is Paris.", "question": "What is the capital?",
                                "answers": ["Paris"], "max_new_tokens": 3, "task": "capitals"}) + "\n")
    out = tmp_path / "out"
    assert main(["eval", "--dataset", str(data), "--model", str(tiny_dir), "--policies", "dense,h2o",
                 "--ratios", "0.5", "--protocols", "query_aware", "--no-plots", "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["header"]["benchmark"] == "dataset"
    assert {(r["cell"]["policy"], r["cell"]["task"]) for r in report["results"]} == {("dense", "capitals"), ("h2o", "capitals")}
    assert all(0 <= r["score"] <= 100 for r in report["results"])


@pytest.mark.parametrize("flags, message", [
    (["--benchmark", "ruler", "--trials", "2"], "--trials apply to --benchmark passkey only"),
    (["--ratios", "0.5"], "--ratios apply to --benchmark ruler or dataset"),
    (["--benchmark", "ruler", "--ratios", "0.5", "--budgets", "0.5"], "not both"),
    (["--benchmark", "ruler", "--ratios", "1.0"], "in \\[0, 1\\)"),
    (["--benchmark", "ruler", "--tasks", "niah"], "unknown RULER task\\(s\\) niah"),
    (["--benchmark", "ruler", "--protocols", "aware"], "unknown protocol\\(s\\) aware"),
    (["--benchmark", "dataset"], "needs a dataset file"),
])
def test_bad_flags_are_clear_errors(tmp_path, capsys, flags, message):
    import re

    assert main(["eval", *flags, "--no-plots", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert re.search(message, err) and "Traceback" not in err
