"""A first chunk prefilled once and replayed into each policy's cache (kvcache/eval/shared.py)
leaves every cache, logit and answer exactly as the policy's own prefill does; a policy that
attends the chunk otherwise is detected and prefilled on its own. Generation that stops once
the prediction scores 100 gives the score the full generation gives."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import DEVICE

from kvcache.eval import ruler
from kvcache.eval.cell import Bench, Cell, answer, answers, make_cell_cache, run_cell, run_cells, saturated
from kvcache.eval.metrics import score
from kvcache.eval.sample import Sample, encode
from kvcache.eval.shared import SharedPrefill, record, replay

BENCH = Bench.make("ruler")
# Policies whose layers attend a first chunk as the dense cache does, and some that do not.
SHARING = [("dense", 0.0), ("snapkv", 0.5), ("tova", 0.5), ("knorm", 0.25), ("keydiff", 0.75),
           ("expected_attention", 0.5), ("h2o", 0.5)]
NOT_SHARING = [("sink", 0.5), ("window", 0.5), ("snapkv:int8", 0.5)]


@pytest.fixture(scope="module")
def chunk(tiny, tokenizer):
    """(first chunk ids, the rest, max_new_tokens, total) of a 512-token niah sample."""
    sample = ruler.make("niah_single_1", tokenizer, 512)
    enc = encode(tokenizer, sample)
    return enc.context, enc.question + enc.prefix, sample.max_new_tokens, len(enc) + sample.max_new_tokens


def own_prefill(model, policy, ratio, chunk):
    ids, rest, new, total = chunk
    cache = make_cell_cache(model, policy, ratio, len(ids), total)
    with torch.inference_mode():
        logits = model(torch.tensor([ids], device=DEVICE), cache, last_only=True)[:, 0]
    return cache, logits


def assert_same_state(a, b):
    sa, sb = a.snapshot().tensors(), b.snapshot().tensors()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


@pytest.mark.parametrize("policy, ratio", SHARING)
def test_a_replayed_chunk_leaves_the_cache_logits_and_answer_of_the_own_prefill(tiny, chunk, policy, ratio):
    ids, rest, new, total = chunk
    mine, logits = own_prefill(tiny, policy, ratio, chunk)
    recorded = record(tiny, ids)
    replayed = make_cell_cache(tiny, policy, ratio, len(ids), total)
    assert replay(tiny, replayed, recorded)
    assert_same_state(replayed, mine)
    assert torch.equal(recorded.logits, logits)
    # A configuration already checked: the chunk absorbed without its outputs, the same state.
    absorbed = make_cell_cache(tiny, policy, ratio, len(ids), total)
    assert replay(tiny, absorbed, recorded, check=False)
    assert_same_state(absorbed, mine)
    tokens = answer(tiny, mine, logits, rest, new)
    assert answer(tiny, replayed, recorded.logits, rest, new) == tokens
    assert answer(tiny, absorbed, recorded.logits, rest, new) == tokens
    assert_same_state(replayed, mine)  # and after the question and the answer
    assert_same_state(absorbed, mine)


@pytest.mark.parametrize("policy, ratio", NOT_SHARING)
def test_a_policy_that_attends_otherwise_fails_the_replay_and_prefills_on_its_own(tiny, chunk, policy, ratio):
    ids, rest, new, total = chunk
    assert not replay(tiny, make_cell_cache(tiny, policy, ratio, len(ids), total), record(tiny, ids))
    shared = SharedPrefill()
    cache, logits = shared.prefill(tiny, make_cell_cache(tiny, policy, ratio, len(ids), total), ids, policy,
                                   fresh=lambda: make_cell_cache(tiny, policy, ratio, len(ids), total))
    mine, own = own_prefill(tiny, policy, ratio, chunk)
    assert policy in shared.unshared and shared.replays == 0 and not shared.checked
    assert torch.equal(logits, own)
    assert_same_state(cache, mine)


def test_replay_takes_a_fresh_one_row_cache(tiny, chunk):
    ids, rest, new, total = chunk
    recorded = record(tiny, ids)
    cache = make_cell_cache(tiny, "snapkv", 0.5, len(ids), total)
    assert replay(tiny, cache, recorded)
    with pytest.raises(ValueError, match="fresh cache"):
        replay(tiny, cache, recorded)
    with pytest.raises(ValueError, match="one row"):
        replay(tiny, make_cell_cache(tiny, "snapkv", 0.5, len(ids), total).empty_like(batch_size=2), recorded)


@pytest.mark.parametrize("protocol", ["query_agnostic", "query_aware"])
def test_cells_run_together_give_the_results_of_cells_run_alone(tiny, tokenizer, protocol):
    reconstructing = [("kvzip", 0.5), ("kvzip", 0.75), ("kvzip:int8", 0.5)]
    cells = [Cell(p, r, "niah_single_2", 512, protocol, 2) for p, r in SHARING[:3] + NOT_SHARING[:1] + reconstructing]
    together = run_cells(tiny, tokenizer, cells, BENCH)
    for cell, result in zip(cells, together):
        alone = run_cell(tiny, tokenizer, cell, BENCH)
        assert result["cell"] == alone["cell"] and result["score"] == alone["score"]
        assert [s["prediction"] for s in result["samples"]] == [s["prediction"] for s in alone["samples"]]
        assert {s["prefill"] for s in alone["samples"]} == {"own"}
    # The sharing cells replay one recording of each sample's chunk; sink prefills its own; kvzip's
    # ratios take one reconstruction pass a sample, and a quantized kvzip makes its own.
    assert [{s["prefill"] for s in r["samples"]} for r in together] == \
        [{"shared"}] * 3 + [{"own"}] + [{"shared"}] * 2 + [{"own"}]


def test_a_shared_prefill_carried_from_task_to_task_gives_each_tasks_results(tiny, tokenizer):
    # A sweep hands one SharedPrefill to all its groups: configurations checked on one task's
    # chunks are replayed without the check on the next task's, with the same results.
    shared = SharedPrefill()
    policies = SHARING[1:3] + NOT_SHARING[:1]
    for task in ("niah_single_1", "niah_multikey_2"):
        cells = [Cell(p, r, task, 512, "query_agnostic", 1) for p, r in policies]
        carried = run_cells(tiny, tokenizer, cells, BENCH, shared=shared)
        fresh = run_cells(tiny, tokenizer, cells, BENCH)
        for a, b in zip(carried, fresh):
            assert [s["prediction"] for s in a["samples"]] == [s["prediction"] for s in b["samples"]]
            assert a["score"] == b["score"]
        assert shared.checked == {f"{p} {r:g}" for p, r in SHARING[1:3]}
        assert shared.unshared == {f"{p} {r:g}" for p, r in NOT_SHARING[:1]}


def test_a_shared_prefill_refuses_a_second_model(tiny, tokenizer):
    cells = [Cell(p, r, "niah_single_1", 512, "query_agnostic", 1) for p, r in SHARING[:2]]
    shared = SharedPrefill()
    run_cells(tiny, tokenizer, cells, BENCH, shared=shared)
    other = copy.deepcopy(tiny)
    with pytest.raises(ValueError, match="serves another model"):
        run_cells(other, tokenizer, cells, BENCH, shared=shared)
    with pytest.raises(ValueError, match="serves another model"):
        shared.recorded(other, [1, 2, 3])
    assert shared.checked == {f"{p} {r:g}" for p, r in SHARING[1:2]} | {"dense 0"}


def test_answers_decode_a_samples_cells_as_one_batch_each_as_alone(tiny, chunk):
    ids, rest, new, total = chunk
    policies = SHARING[:3] + NOT_SHARING
    alone = [answer(tiny, *own_prefill(tiny, p, r, chunk), rest, new) for p, r in policies]
    filled = [own_prefill(tiny, p, r, chunk) for p, r in policies]
    # One row ends after 3 tokens and leaves the batch; the others go on.
    finished = [lambda tokens: False] * len(policies)
    finished[1] = lambda tokens: len(tokens) == 3
    tokens, seconds = answers(tiny, [c for c, _ in filled], torch.cat([l for _, l in filled]), rest, new, finished)
    assert tokens[1] == alone[1][:3]
    assert tokens[:1] + tokens[2:] == alone[:1] + alone[2:]
    assert all(s > 0 for s in seconds)
    with pytest.raises(ValueError, match="one row of logits"):
        answers(tiny, [c for c, _ in filled], filled[0][1], rest, new, finished)


@pytest.mark.parametrize("batch", [1, 2])
def test_cells_give_the_same_results_at_any_batch(tiny, tokenizer, batch):
    cells = [Cell(p, r, "niah_single_2", 512, "query_agnostic", 2) for p, r in SHARING[:3] + NOT_SHARING[:1]]
    by_batch = run_cells(tiny, tokenizer, cells, BENCH, batch=batch)
    together = run_cells(tiny, tokenizer, cells, BENCH, batch=len(cells))
    for a, b in zip(by_batch, together):
        assert [s["prediction"] for s in a["samples"]] == [s["prediction"] for s in b["samples"]]
        assert all(s["seconds"] > 0 for s in a["samples"])
    with pytest.raises(ValueError, match="at least 1"):
        run_cells(tiny, tokenizer, cells, BENCH, batch=0)


def test_run_cells_rejects_cells_with_other_samples(tiny, tokenizer):
    cells = [Cell("dense", 0.0, "niah_single_1", 512, "query_agnostic", 1),
             Cell("dense", 0.0, "niah_single_1", 512, "query_agnostic", 2)]
    with pytest.raises(ValueError, match="same samples"):
        run_cells(tiny, tokenizer, cells, BENCH)


def fake(metric: str, answers: tuple[str, ...]) -> Sample:
    return Sample("t", 0, "c", "q", "p", answers, 8, metric)


@pytest.mark.parametrize("metric", ["string_match_all", "string_match_part"])
def test_generation_stops_once_the_score_is_full_and_the_score_is_that_of_the_whole(tokenizer, metric):
    sample = fake(metric, ("1234567", "890"))
    whole = tokenizer.encode(" 1234567 and 890. Then more text 42", add_special_tokens=False)
    cut = next(n for n in range(1, len(whole) + 1) if saturated(tokenizer, sample, whole[:n]))
    assert cut < len(whole)
    assert score(metric, tokenizer.decode(whole[:cut]), sample.answers) == 100.0
    assert score(metric, tokenizer.decode(whole), sample.answers) == 100.0
    assert not any(saturated(tokenizer, sample, whole[:n]) for n in range(1, cut))


def test_no_early_stop_under_a_metric_that_more_text_can_lower(tokenizer):
    sample = fake("exact_match", ("1234567",))
    assert not saturated(tokenizer, sample, tokenizer.encode("1234567", add_special_tokens=False))


def test_answer_stops_where_finished_says(tiny, chunk):
    ids, rest, new, total = chunk
    cache, logits = own_prefill(tiny, "dense", 0.0, chunk)
    full = answer(tiny, cache, logits, rest, new)
    cache, logits = own_prefill(tiny, "dense", 0.0, chunk)
    assert answer(tiny, cache, logits, rest, new, finished=lambda tokens: len(tokens) == 3) == full[:3]
