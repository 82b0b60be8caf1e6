"""RULER's tasks: names, target lengths in the model's tokens, determinism, and that each answer
is what the prompt says it is."""

from __future__ import annotations

import re
from collections import Counter

import pytest

from kvcache.eval import ruler
from kvcache.eval.ruler import QARecord, Source
from kvcache.eval.sample import encode

SYNTHETIC = [t for t in ruler.TASKS if t not in ruler.QA_TASKS]


def test_the_thirteen_tasks():
    assert ruler.TASKS == ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
                           "niah_multikey_3", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "qa_1", "qa_2")
    assert ruler.DEPTHS[0] == 0 and ruler.DEPTHS[-1] == 100 and len(ruler.DEPTHS) == 40


@pytest.mark.parametrize("length", [1024, 2048])
@pytest.mark.parametrize("task", SYNTHETIC)
def test_prompt_meets_the_target_length_within_two_percent(tokenizer, task, length):
    for index in range(2):
        sample = ruler.make(task, tokenizer, length, seed=3, index=index)
        tokens = len(encode(tokenizer, sample)) + sample.max_new_tokens
        assert tokens == sample.info["tokens"]
        assert length * 0.98 <= tokens <= length, (task, length, tokens)


@pytest.mark.parametrize("task", SYNTHETIC)
def test_same_seed_same_prompts_other_seed_other_prompts(tokenizer, task):
    a = ruler.samples(task, tokenizer, 1024, 2, seed=7)
    b = ruler.samples(task, tokenizer, 1024, 2, seed=7)
    c = ruler.samples(task, tokenizer, 1024, 2, seed=8)
    assert a == b
    assert a != c
    assert a[0] != a[1]


def test_generation_lengths_and_metrics_are_rulers(tokenizer):
    expected = {"niah_single_1": 128, "vt": 30, "cwe": 120, "fwe": 50}
    for task, new in expected.items():
        sample = ruler.make(task, tokenizer, 1024)
        assert sample.max_new_tokens == new and sample.metric == "string_match_all"


@pytest.mark.parametrize("task", [t for t in SYNTHETIC if t.startswith("niah")])
def test_niah_needles_hold_the_answers(tokenizer, task):
    cfg = ruler.CONFIGS[task]
    sample = ruler.make(task, tokenizer, 2048, seed=1)
    type_v = cfg.value if cfg.queries * cfg.values > 1 else cfg.value[:-1]
    needles = re.findall(r"One of the special magic (\w+) for (\S+) is: (\S+)\.", sample.context)
    queried = re.search(rf"special magic {type_v} for (.+) mentioned", sample.question).group(1)
    keys = queried.replace(", and ", ", ").split(", ")
    assert len(keys) == cfg.queries
    found = [v for _, k, v in needles if k in keys]
    assert sorted(found) == sorted(sample.answers) and len(sample.answers) == cfg.queries * cfg.values
    if cfg.value == "numbers":
        assert all(re.fullmatch(r"\d{7}", v) for v in sample.answers)
    else:
        assert all(re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", v)
                   for v in sample.answers)
    if cfg.haystack == "needle":
        assert len(needles) > 10  # the haystack is other needles
    assert sample.answer_prefix.startswith(" The special magic")
    if cfg.queries * cfg.values == 1:
        assert sample.context.startswith("A special magic")


def test_vt_answer_is_the_whole_chain(tokenizer):
    sample = ruler.make("vt", tokenizer, 2048, seed=2)
    value = re.search(r"assigned the value (\d+)", sample.question).group(1)
    chain = [value]
    # Follow the chain in the question's part of the context (after the worked example).
    context = sample.context.split("Memorize and track")[-1]
    names = []
    while True:
        step = re.search(rf"VAR (\w+) = (?:VAR )?{chain[-1]}\b", context)
        if step is None:
            break
        names.append(step.group(1))
        chain.append(step.group(1))
    assert tuple(names) == sample.answers and len(names) == 5
    assert sample.context.count("Memorize and track") == 2  # RULER's worked example first


def test_cwe_answers_are_the_ten_most_common(tokenizer):
    sample = ruler.make("cwe", tokenizer, 2048, seed=4)
    listed = sample.context.split("Memorize the ones that appear most often.\n")[-1]
    counts = Counter(re.findall(r"\d+\. (\S+)", listed))
    top = {w for w, _ in counts.most_common(10)}
    assert top == set(sample.answers) and len(sample.answers) == 10
    assert min(counts[w] for w in top) > max(c for w, c in counts.items() if w not in top)


def test_fwe_answers_are_the_three_most_frequent_codes(tokenizer):
    sample = ruler.make("fwe", tokenizer, 2048, seed=5)
    counts = Counter(sample.context.split("coded words. ")[-1].split())
    ranked = [w for w, _ in counts.most_common() if w != "..."]
    assert counts.most_common(1)[0][0] == "..."
    assert tuple(ranked[:3]) == sample.answers


def test_qa_is_skipped_without_data_and_built_from_records(tokenizer):
    assert "--dataset" in ruler.skipped("qa_1", Source())
    with pytest.raises(ValueError, match="--dataset"):
        ruler.make("qa_2", tokenizer, 1024)
    records = tuple(QARecord(f"Who wrote book {i}?", (f"Book {i} was written by author number {i}. " * 3,),
                             (f"author number {i}",)) for i in range(60))
    source = Source(qa=(("qa_1", records),))
    assert ruler.skipped("qa_1", source) is None
    sample = ruler.make("qa_1", tokenizer, 1024, seed=0, index=7, source=source)
    assert sample.metric == "string_match_part" and sample.max_new_tokens == 32
    assert "Who wrote book 7?" in sample.question and sample.answers == ("author number 7",)
    assert records[7].documents[0] in sample.context
    assert 1024 * 0.9 <= sample.info["tokens"] <= 1024  # whole documents: a coarser fit


def test_a_length_too_short_is_a_clear_error(tokenizer):
    with pytest.raises(ValueError, match="does not fit 100 tokens"):
        ruler.make("niah_single_2", tokenizer, 100)


def test_unknown_task_is_named(tokenizer):
    with pytest.raises(ValueError, match="unknown RULER task 'niah'"):
        ruler.make("niah", tokenizer, 1024)


def test_chat_template_wraps_the_prompt_and_counts_in_the_length(tokenizer):
    import dataclasses

    template = ("{% for m in messages %}<|user|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
    chat = dataclasses.replace(tokenizer, chat_template=template)
    sample = ruler.make("niah_single_2", chat, 1024, chat=True)
    enc = encode(chat, sample, chat=True)
    assert chat.decode(enc.context).startswith("<|user|>\nA special magic number")
    assert chat.decode(enc.question).endswith("<|end|>\n<|assistant|>\n")
    assert 1024 * 0.98 <= len(enc) + sample.max_new_tokens <= 1024
    plain = encode(chat, sample)
    assert len(enc) > len(plain)
