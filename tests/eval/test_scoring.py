"""The metrics: RULER's string matches, SQuAD's exact match and F1, all in [0, 100]."""

from __future__ import annotations

import pytest

from kvcache.eval.metrics import score


def test_string_match_all_is_the_share_of_references_found():
    assert score("string_match_all", " 1234567 and 7654321.", ("1234567", "7654321")) == 100.0
    assert score("string_match_all", "1234567", ("1234567", "7654321", "1111111", "2222222")) == 25.0
    assert score("string_match_all", "Nothing", ("1234567",)) == 0.0
    assert score("string_match_all", "ABCDE", ("abcde",)) == 100.0  # case-insensitive, as RULER


def test_string_match_part_needs_one_reference():
    assert score("string_match_part", "It was Paris.", ("paris", "Lyon")) == 100.0
    assert score("string_match_part", "London", ("paris", "Lyon")) == 0.0


def test_exact_match_and_f1_normalise_like_squad():
    assert score("exact_match", "  The Eiffel Tower!\n", ("eiffel tower",)) == 100.0
    assert score("exact_match", "Eiffel", ("eiffel tower",)) == 0.0
    assert score("f1", "Eiffel", ("eiffel tower",)) == pytest.approx(100 * 2 / 3)
    assert score("f1", "nothing alike", ("eiffel tower",)) == 0.0


def test_control_characters_are_removed_first():
    assert score("exact_match", "\x01answer\x02", ("answer",)) == 100.0


def test_unknown_metric_is_named():
    with pytest.raises(ValueError, match="unknown metric 'bleu'"):
        score("bleu", "a", ("a",))
