"""Cells and the sweep driver: kvpress's protocol on a tiny model, scores in [0, 100], and
resumption that recomputes no finished cell."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import DEVICE

import kvcache
from kvcache.eval import leaderboard, sweep
from kvcache.eval.cell import Bench, Cell, make_cell_cache, run_cell
from kvcache.eval.sample import encode

BENCH = Bench.make("ruler")


def grid(samples=1):
    return sweep.plan(["dense", "h2o", "window"], [0.5], ["niah_single_1", "qa_1"], [512],
                      ["query_agnostic", "query_aware"], samples=samples, seed=0)


def test_plan_runs_dense_once_per_task_and_length():
    cells = grid()
    assert sum(c.policy == "dense" for c in cells) == 2
    assert all(c.ratio == 0 for c in cells if c.policy == "dense")
    assert len(cells) == 2 * (1 + 2 * 2)
    assert len({c.key(BENCH) for c in cells}) == len(cells)


def test_a_cell_key_changes_with_every_setting():
    cell = Cell("h2o", 0.5, "vt", 1024, "query_agnostic", 3, 0)
    others = [Cell("h2o", 0.25, "vt", 1024, "query_agnostic", 3, 0), Cell("h2o", 0.5, "vt", 1024, "query_aware", 3, 0),
              Cell("h2o", 0.5, "vt", 1024, "query_agnostic", 4, 0), Cell("h2o", 0.5, "vt", 1024, "query_agnostic", 3, 1)]
    keys = {cell.key(BENCH)} | {c.key(BENCH) for c in others} | {cell.key(Bench.make("ruler", chat=True))}
    keys |= {cell.key(Bench.make("ruler", weights="int4"))}
    assert len(keys) == 7
    with pytest.raises(ValueError, match="weights='int3'"):
        Bench.make("ruler", weights="int3")


def test_full_weights_keep_the_keys_cells_had_before_weights_were_a_setting():
    """Sweeps already on disk must still be found: a full-weight cell's key is the one it had
    before ``Bench.weights`` existed (this literal is a cell file of docs/eval/smollm2-ruler4k)."""
    cell = Cell("dense", 0.0, "cwe", 4096, "query_agnostic", 6, 0)
    assert cell.key(Bench.make("ruler")) == "cwe-4096-query_agnostic-dense-0-6ce2610b57"


@pytest.mark.parametrize("ratio, protocol", [(0.5, "query_agnostic"), (0.75, "query_aware")])
def test_the_cache_keeps_kvpress_count_of_the_compressed_part(tiny, tokenizer, ratio, protocol):
    from kvcache.eval import ruler

    sample = ruler.make("niah_single_1", tokenizer, 512)
    enc = encode(tokenizer, sample)
    first = len(enc.context) + (len(enc.question) if protocol == "query_aware" else 0)
    total = len(enc) + sample.max_new_tokens
    cache = make_cell_cache(tiny, "h2o", ratio, first, total)
    with torch.inference_mode():
        tiny(torch.tensor([enc.ids[:first]], device=DEVICE), cache, last_only=True)
    kept = int(first * (1 - ratio))
    assert [int(layer.held[0]) for layer in cache.layers] == [kept] * len(cache.layers)
    # The rest is appended without evicting: the cache grows by exactly the tokens that follow.
    with torch.inference_mode():
        tiny(torch.tensor([enc.ids[first:]], device=DEVICE), cache, last_only=True)
    assert int(cache.layers[0].held[0]) == kept + len(enc) - first


def test_dense_cell_equals_a_plain_generate(tiny, tokenizer):
    from kvcache.eval import ruler

    result = run_cell(tiny, tokenizer, Cell("dense", 0.0, "niah_single_1", 512, "query_agnostic", 1), BENCH)
    sample = ruler.make("niah_single_1", tokenizer, 512)
    plain = kvcache.generate(tiny, encode(tokenizer, sample).ids, max_new_tokens=sample.max_new_tokens)
    assert result["samples"][0]["prediction"] == tokenizer.decode(plain)
    assert 0.0 <= result["score"] <= 100.0


def test_a_resumed_sweep_recomputes_no_finished_cell(tiny, tokenizer, tmp_path):
    cells = grid()
    ran = []

    def counting(model, tok, cell, bench):
        ran.append(cell)
        if len(ran) == 4:
            raise KeyboardInterrupt  # the sweep is interrupted in its fourth cell
        return run_cell(model, tok, cell, bench)

    with pytest.raises(KeyboardInterrupt):
        sweep.run(tiny, tokenizer, cells, BENCH, tmp_path, runner=counting, progress=False)
    files = sorted((tmp_path / sweep.CELLS).iterdir())
    assert len(files) == 3 and all(f.suffix == ".json" and not f.name.startswith(".tmp") for f in files)
    before = {f.name: f.read_text() for f in files}

    ran.clear()
    results = sweep.run(tiny, tokenizer, cells, BENCH, tmp_path, runner=lambda *a: ran.append(a[2]) or run_cell(*a),
                        progress=False)
    assert ran == cells[3:]  # only the unfinished cells, in order
    assert {f.name: f.read_text() for f in (tmp_path / sweep.CELLS).iterdir() if f.name in before} == before
    assert len(results) == len(cells)

    ran.clear()
    again = sweep.run(tiny, tokenizer, cells, BENCH, tmp_path, runner=lambda *a: ran.append(a[2]) or run_cell(*a),
                      progress=False)
    assert ran == [] and again == results


def test_results_scores_and_leaderboard(tiny, tokenizer, tmp_path):
    results = sweep.run(tiny, tokenizer, grid(), BENCH, tmp_path, progress=False)
    ran = [r for r in results if not r["skipped"]]
    assert {r["cell"]["task"] for r in ran} == {"niah_single_1"}
    assert all(0.0 <= r["score"] <= 100.0 for r in ran)
    assert all(r["cell"]["task"] == "qa_1" and "--dataset" in r["skipped"] for r in results if r["skipped"])
    json.dumps(results)  # JSON-able, as a remote runner must return
    table = leaderboard.markdown(results, {"model": "tiny", "lengths": "512"})
    assert "- model: tiny" in table and "skipped qa_1" in table
    assert table.index("## query-agnostic") < table.index("## query-aware")
    assert "| h2o | 0.5 |" in table and "| dense | 0 |" in table


def outcomes(result):
    """A result's samples without their timings (which differ from run to run)."""
    return [{k: v for k, v in o.items() if k != "seconds"} for o in result["samples"]]


def niah(samples, seed=0):
    return sweep.plan(["dense", "tova", "h2o"], [0.5], ["niah_single_1"], [512], ["query_agnostic"],
                      samples=samples, seed=seed)


def test_raising_the_sample_count_runs_only_the_new_samples(tiny, tokenizer, tmp_path):
    one = sweep.run(tiny, tokenizer, niah(1), BENCH, tmp_path, progress=False)
    other_seed = sweep.run(tiny, tokenizer, niah(1, seed=1), BENCH, tmp_path, progress=False)
    three = sweep.run(tiny, tokenizer, niah(3), BENCH, tmp_path, progress=False)
    fresh = sweep.run(tiny, tokenizer, niah(3), BENCH, tmp_path / "fresh", progress=False)
    assert [outcomes(r) for r in three] == [outcomes(r) for r in fresh]
    for before, after, seeded in zip(one, three, other_seed):
        # Sample 0 is the earlier run's own outcome, its time included: nothing ran it again.
        assert after["samples"][0] == before["samples"][0]
        assert after["samples"][0] != seeded["samples"][0]
        assert [o["index"] for o in after["samples"]] == [0, 1, 2]
        assert after["score"] == sum(o["score"] for o in after["samples"]) / 3
        assert after["seconds"] == pytest.approx(sum(o["seconds"] for o in after["samples"]))
    # Fewer samples than a finished cell holds: its first ones, with no model call at all.
    hook_calls = []
    tiny.layer_hook = lambda i, x: hook_calls.append(i)
    try:
        two = sweep.run(tiny, tokenizer, niah(2), BENCH, tmp_path, progress=False)
    finally:
        tiny.layer_hook = None
    assert hook_calls == []
    assert [r["samples"] for r in two] == [r["samples"][:2] for r in three]


def test_a_result_written_before_weights_were_a_setting_is_grown_from(tiny, tokenizer, tmp_path):
    [one] = sweep.run(tiny, tokenizer, niah(1)[:1], BENCH, tmp_path, progress=False)
    [path] = (tmp_path / sweep.CELLS).glob("*.json")
    written = json.loads(path.read_text())
    del written["bench"]["weights"]  # as a file of an older sweep holds it
    path.write_text(json.dumps(written))
    [two] = sweep.run(tiny, tokenizer, niah(2)[:1], BENCH, tmp_path, progress=False)
    assert two["samples"][0] == one["samples"][0]
    # int4 weights are another setting: nothing of the full-weight file is taken up.
    assert sweep.known(tmp_path, niah(2)[0], Bench.make("ruler", weights="int4")) == []


def test_an_interrupted_cell_keeps_its_finished_samples(tiny, tokenizer, tmp_path):
    cells = niah(2)

    def interrupt(i, x):
        # Result files appear once the first sample has run through every cell: the next
        # forward (the second sample's) is interrupted.
        if i == 0 and any((tmp_path / sweep.CELLS).glob("*.json")):
            raise KeyboardInterrupt

    tiny.layer_hook = interrupt
    try:
        with pytest.raises(KeyboardInterrupt):
            sweep.run(tiny, tokenizer, cells, BENCH, tmp_path, progress=False)
    finally:
        tiny.layer_hook = None
    files = {p.name: json.loads(p.read_text()) for p in (tmp_path / sweep.CELLS).glob("*.json")}
    assert len(files) == len(cells)
    assert all("score" not in r and [o["index"] for o in r["samples"]] == [0] for r in files.values())
    assert sweep.pending(cells, BENCH, tmp_path) == cells  # a partial cell is not a finished one
    assert sweep.load(tmp_path, cells, BENCH) == []

    resumed = sweep.run(tiny, tokenizer, cells, BENCH, tmp_path, progress=False)
    fresh = sweep.run(tiny, tokenizer, cells, BENCH, tmp_path / "fresh", progress=False)
    assert [outcomes(r) for r in resumed] == [outcomes(r) for r in fresh]
    for r in resumed:
        assert r["samples"][0] == files[sweep.result_path(tmp_path, Cell(**r["cell"]), BENCH).name]["samples"][0]


def test_a_cell_file_name_keeps_plain_names_and_spells_out_a_variant():
    assert Cell("h2o:int4", 0.5, "vt", 1024, "query_agnostic", 3, 0).key(BENCH).startswith(
        "vt-1024-query_agnostic-h2o-int4-0.5-")
    variant = Cell("snapkv(kernel=5,window=64):int8", 0.5, "vt", 1024, "query_agnostic", 3, 0)
    assert variant.key(BENCH).startswith("vt-1024-query_agnostic-snapkv-kernel-5-window-64-int8-0.5-")
    assert variant.key(BENCH) != Cell("snapkv:int8", 0.5, "vt", 1024, "query_agnostic", 3, 0).key(BENCH)
