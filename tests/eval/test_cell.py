"""A cell of a policy that compresses by reconstruction (kvzip): the context is compressed by
kvcache.generation.reconstruction's pass to kvpress's kept count, and a ratio of 0 is the dense cell."""

from __future__ import annotations

import pytest
import torch

from kvcache.eval.cell import Bench, Cell, make_cell_cache, run_cell
from kvcache.eval.sample import encode
from kvcache.generation import reconstruction as kvzip

BENCH = Bench.make("ruler")


def test_kvzip_at_ratio_zero_is_the_dense_cell(tiny, tokenizer):
    dense = run_cell(tiny, tokenizer, Cell("dense", 0.0, "niah_single_1", 512, "query_agnostic", 1), BENCH)
    mine = run_cell(tiny, tokenizer, Cell("kvzip", 0.0, "niah_single_1", 512, "query_agnostic", 1), BENCH)
    assert mine["samples"][0]["prediction"] == dense["samples"][0]["prediction"]


@pytest.mark.parametrize("protocol", ["query_agnostic", "query_aware"])
def test_a_kvzip_cell_compresses_the_first_chunk_by_reconstruction(tiny, tokenizer, protocol):
    from kvcache.eval import ruler

    ratio = 0.5
    result = run_cell(tiny, tokenizer, Cell("kvzip", ratio, "niah_single_1", 512, protocol, 1), BENCH)
    assert 0.0 <= result["score"] <= 100.0
    sample = ruler.make("niah_single_1", tokenizer, 512)
    enc = encode(tokenizer, sample)
    first = len(enc.context) + (len(enc.question) if protocol == "query_aware" else 0)
    total = len(enc) + sample.max_new_tokens
    kept = int(first * (1 - ratio))
    with torch.inference_mode():
        cache = make_cell_cache(tiny, "kvzip", ratio, first, total)
        kvzip.prefill(tiny, cache, enc.ids[:first], repeat=kvzip.repeat_ids(tokenizer), chunk=None)
    # kvpress's count of the first chunk is kept in every layer and head, all scored by the pass.
    for layer in cache.layers:
        assert int(layer.held[0]) == kept
        assert bool((layer.storage.pos[0, :, :kept] >= 0).all())
        assert bool((layer.stats["scored"][0, :, :kept] == 1).all())
    with torch.inference_mode():
        new = kvzip.generate(tiny, cache, enc.ids[:first], enc.ids[first:], repeat=kvzip.repeat_ids(tokenizer),
                             max_new_tokens=sample.max_new_tokens, chunk=None)[0]
    assert result["samples"][0]["prediction"] == tokenizer.decode(new)
    # Not what a window of the same size would answer from: the pass chose other tokens.
    assert any(set(range(first - kept, first)) != set(p.tolist()) for layer in cache.layers
               for p in layer.storage.pos[0, :, :kept])


@pytest.mark.cpu_only("the command line loads its model on the CPU by default")
def test_the_command_line_runs_kvzip_on_ruler_and_the_passkey_grid_refuses_it(tiny_dir, tmp_path, capsys):
    import json

    from kvcache.cli import main

    out = tmp_path / "o"
    assert main(["eval", "--benchmark", "ruler", "--model", str(tiny_dir), "--tasks", "niah_single_1",
                 "--lengths", "512", "--policy", "dense,kvzip", "--ratios", "0.5", "--samples", "1",
                 "--protocols", "query_agnostic", "--threads", "1", "--no-plots", "--out", str(out)]) == 0
    results = json.loads((out / "report.json").read_text())["results"]
    assert {(r["cell"]["policy"], r["cell"]["ratio"]) for r in results} == {("dense", 0.0), ("kvzip", 0.5)}
    assert all(0.0 <= r["score"] <= 100.0 for r in results)
    capsys.readouterr()
    assert main(["eval", "--policies", "dense,kvzip", "--out", str(tmp_path / "p")]) == 2
    err = capsys.readouterr().err
    assert "--policies kvzip: a policy that compresses a context by reconstructing it" in err
    assert "--benchmark ruler" in err and not (tmp_path / "p" / "report.json").exists()


def test_a_cell_cache_takes_options_over_its_budget_options(tiny):
    plain = make_cell_cache(tiny, "expected_attention", 0.5, 100, 120)
    changed = make_cell_cache(tiny, "expected_attention", 0.5, 100, 120, {"covariance": False, "recent": 3})
    assert plain.cache_length == changed.cache_length and plain.layers[0].spec.reserve == changed.layers[0].spec.reserve
    assert plain.layers[0].options.covariance and plain.layers[0].options.recent == 0
    assert not changed.layers[0].options.covariance and changed.layers[0].options.recent == 3
    # The budget's own options stay unless overridden (4 sinks at 50 kept tokens).
    assert changed.layers[0].options.sinks == plain.layers[0].options.sinks == 4
    with pytest.raises(ValueError, match="covariance"):
        make_cell_cache(tiny, "expected_attention", 0.5, 100, 120, {"covariance": "no"})


def test_a_cell_cache_keeps_the_options_its_name_sets(tiny):
    named = make_cell_cache(tiny, "snapkv(window=2,kernel=3)", 0.5, 100, 120)
    plain = make_cell_cache(tiny, "snapkv", 0.5, 100, 120)
    assert (named.layers[0].options.window, named.layers[0].options.kernel) == (2, 3)
    assert plain.layers[0].options.window == 12  # the paper's at 50 kept tokens: a quarter of them
    assert named.cache_length == plain.cache_length


@pytest.mark.cpu_only("the command line loads its model on the CPU by default")
def test_the_command_line_sweeps_a_variant_named_with_its_options(tiny_dir, tmp_path):
    import json

    from kvcache.cli import main

    out = tmp_path / "o"
    assert main(["eval", "--benchmark", "ruler", "--model", str(tiny_dir), "--tasks", "niah_single_1",
                 "--lengths", "512", "--policies", "snapkv,snapkv(window=2, kernel=3)", "--ratios", "0.5",
                 "--samples", "1", "--protocols", "query_agnostic", "--threads", "1", "--no-plots",
                 "--out", str(out)]) == 0
    results = json.loads((out / "report.json").read_text())["results"]
    assert {r["cell"]["policy"] for r in results} == {"snapkv", "snapkv(kernel=3,window=2)"}
    assert "snapkv(kernel=3,window=2)" in (out / "report.md").read_text()
    names = sorted(p.name for p in (out / "cells").glob("*.json"))
    assert len(names) == 2 and any(n.startswith("niah_single_1-512-query_agnostic-snapkv-kernel-3-window-2-0.5-")
                                   for n in names)
    # The same variant spelled otherwise finds the same cell (--report-only runs none, and fails
    # when it finds none).
    assert main(["eval", "--benchmark", "ruler", "--model", str(tiny_dir), "--tasks", "niah_single_1",
                 "--lengths", "512", "--policies", "snapkv( kernel=3,window=2 )", "--ratios", "0.5",
                 "--samples", "1", "--protocols", "query_agnostic", "--report-only", "--no-plots",
                 "--out", str(out)]) == 0
    again = json.loads((out / "report.json").read_text())["results"]
    assert [r["cell"]["policy"] for r in again] == ["snapkv(kernel=3,window=2)"]
    assert again[0]["samples"] == next(r for r in results if r["cell"]["policy"] != "snapkv")["samples"]


@pytest.mark.cpu_only("int4 weights run on the CPU only")
def test_int4_weights_sweep_into_cells_of_their_own(tiny_dir, tmp_path):
    """``--weights int4`` evaluates the model as ``load(..., weights="int4")`` holds it; its cells
    are kept apart from full weights' in the same --out, and the report says which it is."""
    import json

    from kvcache.cli import main

    out = tmp_path / "o"
    grid = ["eval", "--benchmark", "ruler", "--model", str(tiny_dir), "--tasks", "niah_single_1", "--lengths", "512",
            "--policies", "dense", "--samples", "1", "--threads", "1", "--no-plots", "--out", str(out)]
    assert main(grid) == 0
    full = {p.name for p in (out / "cells").glob("*.json")}
    assert main([*grid, "--weights", "int4"]) == 0
    both = {p.name for p in (out / "cells").glob("*.json")}
    assert len(full) == 1 and len(both) == 2
    report = json.loads((out / "report.json").read_text())
    assert report["header"]["weights"] == "int4"
    [int4] = both - full
    assert json.loads((out / "cells" / int4).read_text())["bench"]["weights"] == "int4"
