"""Chat templates (Tokenizer.apply_chat_template, `kvcache generate --chat`) and generation_config.json."""

from __future__ import annotations

import json

import pytest
from conftest import DEVICE
from text_checkpoint import build_text_checkpoint

import kvcache
from kvcache.checkpoints.load import generation_config
from kvcache.cli import main

transformers = pytest.importorskip("transformers")

# ChatML, as Qwen writes it, with a check that raises from inside the template.
CHATML = (
    "{% if messages[0]['role'] == 'assistant' %}{{ raise_exception('a conversation starts with the user') }}{% endif %}"
    "{{ bos_token }}{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL = ("<s>", "<|im_start|>", "<|im_end|>")
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the caf\u00e9 cat"}]


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    config = {"bos_token": "<s>", "eos_token": "<|im_end|>", "chat_template": CHATML}
    return build_text_checkpoint(tmp_path_factory.mktemp("chat") / "model", special_tokens=SPECIAL,
                                 tokenizer_config=config)


@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_chat_template_renders_as_transformers_does(chat_dir, add_generation_prompt):
    reference = transformers.PreTrainedTokenizerFast.from_pretrained(str(chat_dir))
    expected = reference.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt, tokenize=False)
    tokenizer = kvcache.load_tokenizer(chat_dir)
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt, tokenize=False)
    assert text == expected
    assert text.startswith("<s><|im_start|>system\n")
    # Token ids by default; the template wrote the special tokens, so none are added.
    ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt)
    assert ids == tokenizer.encode(text, add_special_tokens=False)
    assert ids[:2] == [tokenizer.backend.token_to_id("<s>"), tokenizer.backend.token_to_id("<|im_start|>")]
    assert tokenizer.eos_token_id == tokenizer.backend.token_to_id("<|im_end|>")


def test_chat_template_file_and_named_templates(tmp_path):
    path = build_text_checkpoint(tmp_path / "m", tokenizer_config={
        "chat_template": [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": "{{ 'D' }}"}]})
    assert kvcache.load_tokenizer(path).apply_chat_template(MESSAGES, tokenize=False) == "D"
    # chat_template.jinja, where newer transformers save the template, comes first.
    (path / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    assert kvcache.load_tokenizer(path).apply_chat_template(MESSAGES, tokenize=False) == "[be brief][the caf\u00e9 cat]"


def test_chat_errors(chat_dir, tmp_path):
    plain = kvcache.load_tokenizer(build_text_checkpoint(tmp_path / "plain"))
    with pytest.raises(ValueError, match="no chat template"):
        plain.apply_chat_template(MESSAGES)
    tokenizer = kvcache.load_tokenizer(chat_dir)
    with pytest.raises(ValueError, match="rejected the messages: a conversation starts with the user"):
        tokenizer.apply_chat_template([{"role": "assistant", "content": "hi"}])
    with pytest.raises(ValueError, match="messages must be a list"):
        tokenizer.apply_chat_template("hello")
    with pytest.raises(ValueError, match="message 0"):
        tokenizer.apply_chat_template([{"content": "no role"}])


def test_cli_chat_and_system(chat_dir, capsys):
    tokenizer = kvcache.load_tokenizer(chat_dir)
    model = kvcache.load(chat_dir, device=DEVICE)
    ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    expected = kvcache.generate(model, ids, max_new_tokens=5, stop_tokens=[tokenizer.eos_token_id])
    args = ["generate", MESSAGES[1]["content"], "--model", str(chat_dir), "--max-new-tokens", "5", "--json"]
    assert main([*args, "--system", MESSAGES[0]["content"]]) == 0  # --system implies --chat
    record = json.loads(capsys.readouterr().out)
    assert record["tokens"] == expected and record["prompt_tokens"] == len(ids)

    user_only = tokenizer.apply_chat_template(MESSAGES[1:], add_generation_prompt=True)
    assert main([*args, "--chat"]) == 0
    assert json.loads(capsys.readouterr().out)["prompt_tokens"] == len(user_only)


def test_cli_chat_without_a_template(tmp_path, capsys):
    path = build_text_checkpoint(tmp_path / "plain")
    assert main(["generate", "hi", "--model", str(path), "--chat"]) == 2
    assert "no chat template" in capsys.readouterr().err


def test_generation_config_reads_what_applies(tmp_path):
    path = build_text_checkpoint(tmp_path / "m")
    assert generation_config(path) == {}
    file = path / "generation_config.json"
    file.write_text(json.dumps({"do_sample": True, "temperature": 0.6, "top_k": 0, "top_p": 0.9,
                                "repetition_penalty": 1.0, "max_new_tokens": 64, "eos_token_id": [1, 2],
                                "bos_token_id": 0}))
    # top_k 0 and repetition_penalty 1.0 mean "off" in transformers.
    assert generation_config(path) == {"temperature": 0.6, "top_p": 0.9, "max_new_tokens": 64, "eos_token_id": [1, 2]}
    file.write_text(json.dumps({"temperature": 0.6, "top_p": 0.9, "repetition_penalty": 1.1}))
    assert generation_config(path) == {"repetition_penalty": 1.1}  # no do_sample: greedy, as in transformers
    file.write_text(json.dumps({"do_sample": True, "top_k": 5}))
    assert generation_config(path) == {"temperature": 1.0, "top_k": 5}
    file.write_text(json.dumps({"max_new_tokens": "64"}))
    with pytest.raises(kvcache.CheckpointError, match="max_new_tokens must be int"):
        generation_config(path)
    file.write_text("{")
    with pytest.raises(kvcache.CheckpointError, match="not valid JSON"):
        generation_config(path)
