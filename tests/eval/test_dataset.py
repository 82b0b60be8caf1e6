"""User datasets: the JSON-lines format, its errors, and how records feed ruler's qa tasks."""

from __future__ import annotations

import json

import pytest

from kvcache.eval import dataset


def write(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return str(path)


def test_records_become_samples_per_task(tmp_path):
    path = write(tmp_path / "d.jsonl", [
        {"context": "Alice lives in Paris.", "question": "Where does Alice live?", "answers": ["Paris"]},
        {"context": ["Doc one.", "Doc two."], "question": "Q?", "answers": "two", "task": "mine",
         "max_new_tokens": 4, "answer_prefix": " Answer:", "metric": "exact_match"},
        {"context": "c", "question": "q", "answers": ["a"], "task": "mine"},
    ])
    samples = dataset.read(path)
    assert [(s.task, s.index) for s in samples] == [("dataset", 0), ("mine", 0), ("mine", 1)]
    first, second = samples[0], samples[1]
    assert first.max_new_tokens == 32 and first.metric == "string_match_part" and first.answer_prefix == ""
    assert second.context == "Doc one.\n\nDoc two." and second.answers == ("two",)
    assert second.max_new_tokens == 4 and second.metric == "exact_match" and second.answer_prefix == " Answer:"
    assert dataset.tasks(path) == ["dataset", "mine"]


@pytest.mark.parametrize("row, message", [
    ("{not json", "line 2: not JSON"),
    ('["a"]', "line 2: a line must be a JSON object"),
    ({"context": "c", "question": "q"}, "line 2: missing 'answers'"),
    ({"context": "c", "question": "q", "answers": []}, "answers must be a non-empty"),
    ({"context": "c", "question": "q", "answers": ["a"], "max_new_tokens": 0}, "max_new_tokens must be a positive"),
    ({"context": "c", "question": "q", "answers": ["a"], "metric": "rouge"}, "unknown metric 'rouge'"),
    ({"context": "c", "question": "q", "answers": ["a"], "extra": 1}, "unknown field\\(s\\) extra"),
    ({"context": [], "question": "q", "answers": ["a"]}, "context must be a string or a non-empty list"),
])
def test_bad_lines_are_named_with_their_number(tmp_path, row, message):
    good = {"context": "c", "question": "q", "answers": ["a"]}
    path = write(tmp_path / "d.jsonl", [good, row])
    with pytest.raises(ValueError, match=message):
        dataset.read(path)


def test_missing_file_and_empty_file(tmp_path):
    with pytest.raises(ValueError, match="is not a file"):
        dataset.read(str(tmp_path / "none.jsonl"))
    (tmp_path / "e.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="has no records"):
        dataset.read(str(tmp_path / "e.jsonl"))


def test_records_feed_the_qa_tasks(tmp_path):
    path = write(tmp_path / "qa.jsonl", [
        {"context": ["gold"], "question": "q1", "answers": ["a"], "task": "qa_1"},
        {"context": ["d1", "d2"], "question": "q2", "answers": ["b"], "task": "qa_2"},
        {"context": "both", "question": "q3", "answers": ["c"]},
    ])
    source = dict(dataset.qa_source(path))
    assert [r.question for r in source["qa_1"]] == ["q1", "q3"]
    assert [r.question for r in source["qa_2"]] == ["q2", "q3"]
    assert source["qa_2"][0].documents == ("d1", "d2")
