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
    # A grid not yet run: --report-only reports the finished cells and runs none.
    (out / "report.json").unlink()
    wider = [a.replace("dense,window,sink", "dense,window,sink,h2o") for a in args]
    assert main(wider + ["--report-only"]) == 0
    assert "26 cells (18 already" in capsys.readouterr().err
    report = json.loads((out / "report.json").read_text())
    assert {r["cell"]["policy"] for r in report["results"]} == {"dense", "window", "sink"}
    assert len(report["results"]) == 18 and len(list((out / "cells").glob("*.json"))) == 18


def test_report_only_needs_finished_cells(tiny_dir, tmp_path, capsys):
    out = tmp_path / "none"
    assert main(["eval", "--benchmark", "ruler", "--model", str(tiny_dir), "--tasks", "niah_single_1",
                 "--lengths", "512", "--policies", "dense", "--samples", "1", "--report-only", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--report-only: none of the 1 cells is finished" in err and "Traceback" not in err
    assert not out.exists()


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
    (["--report-only"], "--report-only applies to --benchmark ruler or dataset"),
    (["--batch", "4"], "--batch apply to --benchmark ruler or dataset"),
    (["--benchmark", "ruler", "--batch", "4", "--ray"], "with --ray each cell runs alone"),
])
def test_bad_flags_are_clear_errors(tmp_path, capsys, flags, message):
    import re

    assert main(["eval", *flags, "--no-plots", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert re.search(message, err) and "Traceback" not in err


@pytest.mark.parametrize("flags, message", [
    # passkey: the misspelled policy comes after two that would run
    (["--policies", "dense,sink,h20", "--lengths", "512,1024", "--budgets", "0.25,0.5", "--trials", "2"],
     "--policies: unknown policy\\(ies\\) h20; available: "),
    (["--policies", "dense,h2o:int6"], "unknown storage 'int6'"),
    (["--policies", "h20,h2o:int7"], "unknown policy\\(ies\\) h20.*unknown storage 'int7'"),
    # a storage this model's head size cannot hold: found after loading, still before any cell
    (["--policies", "dense,h2o:token4/7"], "--policies h2o:token4/7: .*must divide head_dim"),
    (["--benchmark", "ruler", "--policies", "dense,window,h20", "--lengths", "512"], "unknown policy\\(ies\\) h20"),
    (["--benchmark", "ruler", "--policies", "dense,h2o:kivi9"], "unknown storage 'kivi9'"),
    (["--benchmark", "ruler", "--policies", "dense,h2o:token4/7", "--lengths", "512"], "must divide head_dim"),
    (["--benchmark", "ruler", "--tasks", "niah_single_1,qa_3", "--lengths", "512"], "unknown RULER task\\(s\\) qa_3"),
    # a length the task's smallest sample does not fit
    (["--benchmark", "ruler", "--tasks", "niah_single_1", "--lengths", "512,32"], "niah_single_1 does not fit 32 tokens"),
    # a checkpoint with no chat template, asked for conversations
    (["--benchmark", "ruler", "--chat", "--lengths", "512"], "--chat: .* has no chat template"),
    (["--chat", "--lengths", "512"], "--chat: .* has no chat template"),
])
def test_a_bad_grid_fails_before_any_cell_and_writes_nothing(tiny_dir, tmp_path, monkeypatch, capsys, flags, message):
    import re

    def must_not_run(*args, **kwargs):
        raise AssertionError("a cell ran before the grid was checked")

    monkeypatch.setattr("kvcache.eval.quality.evaluate", must_not_run)
    monkeypatch.setattr("kvcache.eval.sweep.run", must_not_run)
    monkeypatch.setattr("kvcache.eval.ray_sweep.run", must_not_run)
    out = tmp_path / "new" / "out"
    assert main(["eval", "--model", str(tiny_dir), *flags, "--no-plots", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvcache: error: ") and re.search(message, err) and "Traceback" not in err, err
    assert not (tmp_path / "new").exists()


def test_a_bad_dataset_task_fails_before_any_cell_and_writes_nothing(tiny_dir, tmp_path, monkeypatch, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"context": "c", "question": "q", "answers": ["a"], "task": "capitals"}) + "\n")
    monkeypatch.setattr("kvcache.eval.sweep.run", lambda *a, **k: pytest.fail("a cell ran"))
    out = tmp_path / "out"
    assert main(["eval", "--dataset", str(data), "--model", str(tiny_dir), "--tasks", "capitals,capitols",
                 "--no-plots", "--out", str(out)]) == 2
    assert "capitols not in" in capsys.readouterr().err
    assert not out.exists()


def test_an_out_directory_that_cannot_be_made_fails_at_once(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    assert main(["eval", "--no-plots", "--out", str(tmp_path / "file" / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvcache: error: --out ") and "writable directory" in err
