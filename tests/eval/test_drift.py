"""The drift report: every comparison for both engines, aligned reuse exact, the table and the
command line (tiny random checkpoint without a tokenizer, so the prompts are random ids)."""

from __future__ import annotations

import json

import pytest
from conftest import DEVICE

from kvcache.cli import main
from kvcache.eval.drift import COMPARISONS, Setup, report, table

SETUP = Setup(tokens=64, chunk=16, prefix=20, steps=4)


@pytest.fixture(scope="module")
def data(llama_ckpt):
    pytest.importorskip("transformers")
    return report(llama_ckpt.path, ["float32"], device=DEVICE, setup=SETUP)


def test_every_comparison_for_both_engines(data):
    cells = {(r["comparison"], r["engine"]): r for r in data["results"]}
    assert set(cells) == {(c, e) for c in COMPARISONS for e in ("kvcache", "transformers")}
    for (comparison, engine), r in cells.items():
        if engine == "transformers" and comparison.endswith("aligned"):
            assert r["max_abs"] is None  # transformers has no aligned mode
            continue
        assert 0 <= r["max_abs"] <= 1e-4 and 0.99 <= r["top1"] <= 1.0, (comparison, engine, r)
        assert r["positions"] > 0


def test_aligned_reuse_is_exact_and_fresh_within_tolerance(data):
    kv = {r["comparison"]: r for r in data["results"] if r["engine"] == "kvcache"}
    assert kv["reused prefix vs fresh, aligned"]["max_abs"] == 0.0
    assert kv["reused prefix vs fresh"]["max_abs"] <= 1e-5
    assert kv["reused prefix vs fresh"]["positions"] == 1 + SETUP.steps


def test_table_has_a_row_per_comparison_and_engine(data):
    text = table(data)
    assert "float32" in text and "top-1" in text
    for comparison in COMPARISONS:
        assert comparison in text
    assert text.count("transformers") >= len(COMPARISONS)


def test_cli_json_and_errors(llama_ckpt, capsys):
    args = ["drift", "--model", str(llama_ckpt.path), "--dtype", "float32", "--tokens", "32", "--chunk", "8",
            "--prefix", "12", "--no-transformers", "--json", "--threads", "1"]
    assert main(args) == 0
    data = json.loads(capsys.readouterr().out)
    assert {r["engine"] for r in data["results"]} == {"kvcache"}
    assert data["setup"]["tokens"] == 32 and data["transformers"] is None
    assert main(args[:4] + ["float8"]) == 2
    assert "--dtype takes" in capsys.readouterr().err
    assert main(["drift", "--model", str(llama_ckpt.path), "--tokens", "16", "--prefix", "16"]) == 2
    assert "--prefix (16) must be shorter" in capsys.readouterr().err
