"""The leaderboard's averages, their standard errors and the paired difference from dense, on
results written by hand (the statistics are checked against ``statistics``, not re-derived)."""

import math
import statistics

import pytest

from kvcache.eval import leaderboard

AGNOSTIC = "query_agnostic"


def result(policy, ratio, task, scores, length=4096, protocol=AGNOSTIC, first=0):
    return {"cell": {"policy": policy, "ratio": ratio, "task": task, "length": length, "protocol": protocol,
                     "samples": len(scores), "seed": 0},
            "skipped": None, "score": sum(scores) / len(scores),
            "samples": [{"index": first + i, "score": s} for i, s in enumerate(scores)]}


DENSE_A, DENSE_B = [100.0, 100.0, 0.0, 100.0], [0.0, 50.0, 50.0, 0.0]
TOVA_A, TOVA_B = [100.0, 0.0, 0.0, 100.0], [0.0, 50.0, 100.0, 0.0]
RESULTS = [result("dense", 0.0, "a", DENSE_A), result("dense", 0.0, "b", DENSE_B),
           result("tova", 0.5, "a", TOVA_A), result("tova", 0.5, "b", TOVA_B),
           result("knorm", 0.5, "a", DENSE_A), result("knorm", 0.5, "b", DENSE_B)]


def se(values):
    return statistics.stdev(values) / math.sqrt(len(values))


def test_standard_error_of_the_average_over_tasks():
    errors = leaderboard.errors(RESULTS)
    want = math.sqrt(se(TOVA_A) ** 2 + se(TOVA_B) ** 2) / 2
    assert errors[("tova", 0.5, AGNOSTIC)] == pytest.approx(want)
    assert errors[("dense", 0.0, AGNOSTIC)] == pytest.approx(math.sqrt(se(DENSE_A) ** 2 + se(DENSE_B) ** 2) / 2)
    # The average it belongs to is the leaderboard's.
    assert leaderboard.average(leaderboard.table(RESULTS)[("tova", 0.5, AGNOSTIC)]) == pytest.approx(
        (statistics.mean(TOVA_A) + statistics.mean(TOVA_B)) / 2)


def test_lengths_average_within_a_task():
    short, long = [0.0, 100.0, 100.0], [0.0, 0.0, 100.0, 100.0]
    results = [result("dense", 0.0, "a", short, length=1024), result("dense", 0.0, "a", long, length=4096)]
    # Task score = mean over lengths, so each length's variance of the mean counts a quarter.
    want = math.sqrt(se(short) ** 2 / 4 + se(long) ** 2 / 4)
    assert leaderboard.errors(results)[("dense", 0.0, AGNOSTIC)] == pytest.approx(want)


def test_paired_difference_from_dense():
    paired = leaderboard.against_dense(RESULTS)
    diff_a = [t - d for t, d in zip(TOVA_A, DENSE_A)]
    diff_b = [t - d for t, d in zip(TOVA_B, DENSE_B)]
    mean, error = paired[("tova", 0.5, AGNOSTIC)]
    assert mean == pytest.approx((statistics.mean(diff_a) + statistics.mean(diff_b)) / 2)
    assert error == pytest.approx(math.sqrt(se(diff_a) ** 2 + se(diff_b) ** 2) / 2)
    # A row that answers as dense does on every sample differs by exactly nothing, with no noise,
    # though its own average has the same (large) standard error as dense's.
    assert paired[("knorm", 0.5, AGNOSTIC)] == (0.0, 0.0)
    assert leaderboard.errors(RESULTS)[("knorm", 0.5, AGNOSTIC)] > 10
    assert ("dense", 0.0, AGNOSTIC) not in paired


def test_pairs_only_the_samples_both_ran():
    # tova ran samples 2-5 of task a; dense 0-3: the pair is samples 2 and 3.
    results = [result("dense", 0.0, "a", DENSE_A), result("tova", 0.5, "a", [0.0, 100.0, 50.0, 50.0], first=2)]
    mean, error = leaderboard.against_dense(results)[("tova", 0.5, AGNOSTIC)]
    diffs = [0.0 - DENSE_A[2], 100.0 - DENSE_A[3]]
    assert mean == pytest.approx(statistics.mean(diffs)) and error == pytest.approx(se(diffs))


def test_one_sample_has_no_error_and_no_dense_no_pairs():
    results = [result("dense", 0.0, "a", [100.0]), result("tova", 0.5, "a", [0.0])]
    assert leaderboard.errors(results) == {("dense", 0.0, AGNOSTIC): None, ("tova", 0.5, AGNOSTIC): None}
    assert leaderboard.against_dense(results) == {("tova", 0.5, AGNOSTIC): (-100.0, None)}
    assert leaderboard.against_dense(results[1:]) == {}
    table = leaderboard.markdown(results, {"model": "m"})
    assert "| tova | 0.0 |" in table and "±" not in table


def test_markdown_shows_errors_and_the_paired_table():
    table = leaderboard.markdown(RESULTS, {"model": "m"})
    tova = leaderboard.average(leaderboard.table(RESULTS)[("tova", 0.5, AGNOSTIC)])
    error = leaderboard.errors(RESULTS)[("tova", 0.5, AGNOSTIC)]
    assert f"| tova | {tova:.1f} ± {error:.1f} |" in table
    mean, paired = leaderboard.against_dense(RESULTS)[("tova", 0.5, AGNOSTIC)]
    assert f"| tova | {mean:+.1f} ± {paired:.1f} |" in table and "| knorm | +0.0 ± 0.0 |" in table
    head = table.index("difference from dense")
    assert table.index("average score") < head < table.index("score per task")
    assert "| dense |" not in table[head:table.index("score per task")]


def test_plot_draws_the_errors(tmp_path):
    pytest.importorskip("matplotlib")
    from kvcache.eval import plots

    data = leaderboard.table(RESULTS)
    names = plots.sweep_plots(data, ["a", "b"], {"model": "m"}, tmp_path, leaderboard.errors(RESULTS))
    assert names == ["score_vs_ratio.png", "task_heatmap_ratio-0.5.png"]
    assert all((tmp_path / n).read_bytes()[:4] == b"\x89PNG" for n in names)


def test_the_report_says_where_dense_scores_zero():
    zero = [result("dense", 0.0, "c", [0.0, 0.0]), result("tova", 0.5, "c", [0.0, 0.0])]
    assert leaderboard.dense_zeros(RESULTS) == []
    assert leaderboard.dense_zeros(RESULTS + zero) == ["c"]
    report = leaderboard.markdown(RESULTS + zero, {"benchmark": "ruler"})
    assert "dense scores 0 on c: the model cannot do it" in report
    assert "dense scores 0" not in leaderboard.markdown(RESULTS, {"benchmark": "ruler"})
