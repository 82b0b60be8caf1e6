"""The evaluation harness and its task builders, on a tiny random model and tokenizer."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import kvcache
from kvcache.cli import main
from kvcache.eval.quality import Grid, evaluate, markdown, streaming
from kvcache.eval.sample import chat_parts
from kvcache.eval.tasks import (
    ANSWER_WEIGHT,
    PASSKEY_ANSWER_PREFIX,
    PASSKEY_ASK,
    PASSKEY_INSTRUCTION,
    PASSKEY_QUESTION,
    TaskMaker,
    read_texts,
)

transformers = pytest.importorskip("transformers")

TEXT = (
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, "
    "must be in want of a wife. However little known the feelings or views of such a man may be "
    "on his first entering a neighbourhood, this truth is so well fixed in the minds of the "
    "surrounding families. The pass key is 12345. What is the code for Emma? 0123456789. "
)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    texts = root / "texts"
    texts.mkdir()
    (texts / "a.txt").write_text(TEXT * 20)
    (texts / "b.txt").write_text(TEXT[::-1] * 20)
    model_dir = root / "model"
    model_dir.mkdir()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|bos|>", "<|eos|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT] * 10, trainer=trainer)
    tok.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|bos|>", "eos_token": "<|eos|>"}))
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(model_dir)
    tokenizer = kvcache.load_tokenizer(model_dir)
    return model_dir, texts, kvcache.load(model_dir, device=DEVICE), tokenizer, read_texts(texts, tokenizer)


def test_passkey_prompt_hides_the_key_at_the_requested_depth(setup):
    *_, tokenizer, stream = setup
    tasks = TaskMaker(stream, tokenizer, seed=1)
    needle = "The pass key is 54321. Remember it. 54321 is the pass key."
    question = "What is the pass key? The pass key is"
    for depth in (0.0, 0.5, 1.0):
        prompt, answer = tasks.passkey(400, depth=depth, key=54321)
        assert prompt[0] == tokenizer.bos_token_id
        assert tokenizer.decode(answer).strip() == "54321."
        assert abs(len(prompt) + len(answer) - 400) <= 2
        text = tokenizer.decode(prompt)
        assert text.endswith(question)
        before, after = text.split(needle)
        after = after[: -len(question)]
        # The filler splits around the needle in the proportion depth : 1 - depth.
        share = len(before) / (len(before) + len(after))
        assert abs(share - depth) < 0.05, (depth, share)


CHAT_TEMPLATE = ("{% for m in messages %}<|bos|>user\n{{ m['content'] }}<|eos|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|bos|>assistant\n{% endif %}")


def test_chat_passkey_prompt_is_a_conversation(setup):
    *_, tokenizer, stream = setup
    chat = chat_parts(dataclasses.replace(tokenizer, chat_template=CHAT_TEMPLATE))
    tasks = TaskMaker(stream, tokenizer, seed=1)
    prompt, answer = tasks.passkey(400, depth=0.5, key=54321, chat=chat)
    assert abs(len(prompt) + len(answer) - 400) <= 2 and tokenizer.decode(answer).strip() == "54321."
    # The template writes the beginning-of-text token itself: it is not doubled.
    assert prompt[0] == tokenizer.bos_token_id and prompt[1] != tokenizer.bos_token_id
    text = tokenizer.decode(prompt, skip_special_tokens=False)
    assert text.startswith("<|bos|>user\n" + PASSKEY_INSTRUCTION)
    assert text.endswith(PASSKEY_ASK + "<|eos|>\n<|bos|>assistant\n" + PASSKEY_ANSWER_PREFIX)
    assert "The pass key is 54321. Remember it." in text
    # The question is where evaluate splits the context from what follows it.
    question = tasks.passkey_question(chat)
    assert prompt[-len(question):] == question and tokenizer.decode(question).startswith(PASSKEY_ASK)
    # The same seed and key without chat: the prompt the bundled model was trained on.
    plain, _ = TaskMaker(stream, tokenizer, seed=1).passkey(400, depth=0.5, key=54321)
    assert tokenizer.decode(plain).endswith(PASSKEY_QUESTION) and PASSKEY_INSTRUCTION not in tokenizer.decode(plain)


def test_lookup_answer_is_the_code_of_the_named_person(setup):
    *_, tokenizer, stream = setup
    prompt, answer = TaskMaker(stream, tokenizer, seed=2).lookup(300, needles=3)
    text = tokenizer.decode(prompt)
    name = text.rsplit("What is the code for ", 1)[1].split("?")[0]
    code = tokenizer.decode(answer).strip().rstrip(".")
    assert f"The code for {name} is {code}." in text
    assert text.count("The code for ") == 4  # three needles and the question


def test_batches_weight_the_answers(setup):
    *_, tokenizer, stream = setup
    ids, weights = TaskMaker(stream, tokenizer, seed=3).batch(8, 128, retrieval_share=1.0)
    assert ids.shape == weights.shape == (8, 129)
    assert ((weights == ANSWER_WEIGHT).sum(1) > 0).all()  # every row is a task with its answer marked
    ids, weights = TaskMaker(stream, tokenizer, seed=3).batch(4, 128, retrieval_share=0.0)
    assert (weights == 1).all()


@pytest.mark.parametrize("random_span", [False, True])
def test_repeat_copies_an_earlier_span(setup, random_span):
    *_, tokenizer, stream = setup
    tasks = TaskMaker(stream, tokenizer, seed=3)
    for length in (64, 200):
        seq, start, end = tasks.repeat(length, random_span=random_span)
        assert len(seq) == length and seq[0] == tokenizer.bos_token_id
        copy = seq[start:end]
        assert end - start >= 8
        assert any(seq[i : i + len(copy)] == copy for i in range(1, start - len(copy) + 1))


def test_batches_weight_the_copies_of_repeats(setup):
    *_, tokenizer, stream = setup
    ids, weights = TaskMaker(stream, tokenizer, seed=4).batch(4, 128, retrieval_share=0.0, repeat_share=1.0)
    for row, w in zip(ids.tolist(), weights):
        marked = (w == ANSWER_WEIGHT).nonzero().flatten().tolist()
        assert marked == list(range(marked[0], marked[-1] + 1))  # one contiguous copy
        span = row[marked[0] - 1 : marked[-1] + 1]  # its first token is not weighted: unpredictable
        assert any(row[i : i + len(span)] == span for i in range(marked[0] - len(span)))


def test_bad_task_arguments_are_rejected(setup):
    *_, tokenizer, stream = setup
    tasks = TaskMaker(stream, tokenizer, seed=0)
    with pytest.raises(ValueError, match="length >= 32"):
        tasks.repeat(16)
    with pytest.raises(ValueError, match="sum to at most 1"):
        tasks.batch(2, 64, retrieval_share=0.7, repeat_share=0.5)
    with pytest.raises(ValueError, match="non-negative"):
        tasks.batch(2, 64, retrieval_share=-0.1)


def test_streaming_dense_is_the_plain_forward(setup):
    _, _, model, _, stream = setup
    ids = stream[None, :96].to(DEVICE)
    with torch.inference_mode():
        reference = F.log_softmax(model(ids)[0, :-1].float(), dim=-1)
        dense = streaming(model, ids, "dense", 96, 16, reference)
        covering = streaming(model, ids, "window", 96, 16, reference)
    nll = -reference.gather(1, ids[0, 1:, None]).mean().item()
    assert dense["perplexity"] == pytest.approx(math.exp(nll), rel=1e-4)
    for result in (dense, covering):
        assert result["top1_agreement"] == 1.0
        assert abs(result["kl"]) < 1e-5
    with torch.inference_mode():
        small = streaming(model, ids, "window", 8, 16, reference)
    assert small["kl"] > 1e-4  # a window of 8 changes the distributions


def test_grid_report_table_and_plots(setup, tmp_path):
    _, _, model, tokenizer, stream = setup
    grid = Grid(policies=["dense", "window", "h2o"], budgets=[0.25, 0.5], lengths=[64], depths=[0.0, 1.0],
                trials=1, stream_tokens=64, chunk=8)
    report = evaluate(model, tokenizer, stream, stream, grid, progress=False)
    assert [(s["policy"], s["budget"]) for s in report["streaming"]] == [
        ("dense", 1.0), ("window", 0.25), ("window", 0.5), ("h2o", 0.25), ("h2o", 0.5)]
    assert len(report["passkey"]) == 5 * 2 * 1 * 2
    assert all(0.0 <= r["accuracy"] <= 1.0 for r in report["passkey"])
    table = markdown(report)
    assert table.count("\n") == 2 + 5 and "| window | 0.25 |" in table
    from kvcache.eval import plots

    plots.quality_vs_budget(report, tmp_path / "q.png")
    plots.passkey_heatmaps(report, tmp_path / "h.png", budget=0.25)
    assert (tmp_path / "q.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "h.png").stat().st_size > 1000


def test_the_default_grid_runs_every_policy_it_can():
    from kvcache.cache.registry import policies, reconstructs

    grid = Grid()
    assert grid.policies[0] == "dense" and "kvzip" not in grid.policies
    assert set(grid.policies) == {p for p in policies() if not reconstructs(p)}


def test_bad_grids_are_rejected():
    with pytest.raises(ValueError, match="budgets"):
        Grid(budgets=[0.0])
    with pytest.raises(ValueError, match="depths"):
        Grid(depths=[1.5])


def test_cli_eval_quick(setup, tmp_path, capsys):
    model_dir, texts, *_ = setup
    out = tmp_path / "out"
    code = main(["eval", "--model", str(model_dir), "--texts", str(texts), "--quick", "--lengths", "64",
                 "--stream-tokens", "64", "--out", str(out)])
    assert code == 0
    assert "| dense | 1 |" in capsys.readouterr().out
    report = json.loads((out / "report.json").read_text())
    assert {s["policy"] for s in report["streaming"]} == {"dense", "window", "sink", "h2o"}
    assert (out / "quality_vs_budget.png").exists() and (out / "passkey_heatmap_budget-0.25.png").exists()


def test_cli_eval_passkey_as_a_conversation(setup, tmp_path, capsys):
    model_dir, texts, *_ = setup
    chatty = tmp_path / "chatty"
    shutil.copytree(model_dir, chatty)
    config = json.loads((chatty / "tokenizer_config.json").read_text())
    (chatty / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    args = ["eval", "--texts", str(texts), "--quick", "--lengths", "64", "--stream-tokens", "64",
            "--policies", "dense,window"]
    out = tmp_path / "out"
    assert main(args + ["--model", str(chatty), "--out", str(out), "--chat"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["header"]["chat template"] == "yes"
    # Without --chat the same grid is other cells: nothing is taken from the conversation's.
    capsys.readouterr()
    assert main(args + ["--model", str(chatty), "--out", str(out)]) == 0
    assert ", 0 already" in capsys.readouterr().err
    # A checkpoint without a chat template is refused before anything is written.
    assert main(args + ["--model", str(model_dir), "--out", str(tmp_path / "none"), "--chat"]) == 2
    assert "has no chat template" in capsys.readouterr().err and not (tmp_path / "none").exists()
