"""The fine-tuning loop, its data, LoRA through peft, the checkpoints it writes (loaded back by
kvcache and by transformers, with the same logits) and ``kvcache finetune``'s errors."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import DEVICE, HF_ATOL, atol, max_diff
from train_util import gradients, plain_loss, relative_errors, token_ids

import kvcache
from kvcache.cli import main
from kvcache.train.data import token_rows
from kvcache.train.loop import FinetuneConfig, finetune
from kvcache.train.lora import add_lora, merge_lora, save_adapter
from kvcache.train.save import read_config, save_checkpoint

peft = pytest.importorskip("peft")


class Chars:
    """A tokenizer of one id per character, enough to build rows from text."""

    bos_token_id, eos_token_id = 1, 2

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([1] if add_special_tokens else []) + [3 + ord(c) % 60 for c in text]


@pytest.fixture
def model(llama_ckpt):
    return kvcache.load(llama_ckpt.path, device=DEVICE)


def test_rows_from_text_and_jsonl(tmp_path):
    (tmp_path / "a.txt").write_text("abcdef" * 5)
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "xyz" * 4, "id": 1}) + "\n\n" + json.dumps({"text": "q"}) + "\n")
    rows = token_rows([tmp_path / "a.txt", tmp_path / "b.jsonl"], Chars(), 8)
    # 32 + 14 + 3 tokens (bos, text, eos each) = 49 -> 6 rows of 8.
    assert rows.shape == (6, 8) and rows[0, 0] == 1 and rows[3, 7] == 2 and rows[4, 0] == 1


@pytest.mark.parametrize("content, message", [
    ('{"prompt": "x"}\n', "has no field 'text' (its fields: prompt)"),
    ("not json\n", "line 1 of .* is not valid JSON"),
    ("[1, 2]\n", "is not a JSON object"),
    ('{"text": 3}\n', "is a int, not text"),
    ("\n\n", "the dataset is empty"),
    ('{"text": "ab"}\n', "too small: 1 documents, 4 tokens"),
])
def test_data_errors(tmp_path, content, message):
    (tmp_path / "d.jsonl").write_text(content)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        token_rows([tmp_path / "d.jsonl"], Chars(), 8)


def test_config_errors():
    with pytest.raises(ValueError, match="larger than the cache"):
        FinetuneConfig(cache_length=64, chunk=128)
    with pytest.raises(ValueError, match="shorter than one chunk"):
        finetune(torch.nn.Linear(2, 2), torch.zeros(1, 8, dtype=torch.long, device=DEVICE),
                 FinetuneConfig(cache_length=16, chunk=16))


def test_warmup_fits_the_run():
    """The default warm-up is 10 steps, or a tenth of a shorter run; one longer than the run is cut
    to it with a warning, so the learning rate reaches ``lr`` (a 3-step run under a 10-step
    warm-up would end at 0.3 lr)."""
    from kvcache.errors import KVCacheWarning
    from kvcache.train.loop import lr_at

    assert FinetuneConfig(steps=100).warmup == 10 and FinetuneConfig(steps=1000).warmup == 10
    assert FinetuneConfig(steps=30).warmup == 3 and FinetuneConfig(steps=3).warmup == 0
    short = FinetuneConfig(steps=3, lr=2e-4)
    assert lr_at(0, short) == pytest.approx(2e-4)
    with pytest.warns(KVCacheWarning, match=r"warmup \(10 steps\) is longer than the run \(3 steps\)"):
        cut = FinetuneConfig(steps=3, warmup=10, lr=2e-4)
    assert cut.warmup == 3 and max(lr_at(s, cut) for s in range(3)) == pytest.approx(2e-4)
    assert FinetuneConfig(steps=3, warmup=3).warmup == 3  # reaches lr at its last step: no warning


def test_loop_trains_and_accumulates(model, tmp_path):
    rows = token_ids(32, batch=4, seed=1, vocab=128)
    before = plain_loss(model, rows).item()
    config = FinetuneConfig(policy="h2o", cache_length=16, chunk=8, policy_options={"recent": 4}, steps=6, lr=3e-3,
                            warmup=1, batch_size=2, grad_accum=2)
    records = finetune(model, rows, config, log=tmp_path / "loss.jsonl", progress=False)
    assert len(records) == 6 and records[-1]["tokens"] == 6 * 4 * 32
    assert [json.loads(line)["step"] for line in (tmp_path / "loss.jsonl").read_text().splitlines()] == list(range(1, 7))
    assert plain_loss(model, rows).item() < before


def test_batch_is_the_mean_of_its_rows(model):
    """Accumulating two rows equals one batch of both: each row has the same number of targets."""
    ids = token_ids(20, batch=2, seed=2, vocab=128)
    _, both = gradients(model, lambda: kvcache.chunked_loss(model, ids, policy="sink", cache_length=8, chunk=4))
    model.zero_grad(set_to_none=True)
    for row in ids:
        (kvcache.chunked_loss(model, row[None], policy="sink", cache_length=8, chunk=4) / 2).backward()
    accumulated = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    assert max(relative_errors(accumulated, both).values()) < 1e-5


def test_lora_gradients_merge_and_checkpoints(model, llama_ckpt, tmp_path):
    from transformers import AutoModelForCausalLM

    ids = token_ids(24, batch=1, seed=3, vocab=128)
    lora = add_lora(model, 4, targets=("q_proj", "v_proj", "down_proj"))
    with torch.no_grad():  # adapters start at B = 0; give them a value so the merge is tested
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    trainable = {n for n, p in lora.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    _, want = gradients(lora, lambda: plain_loss(lora.get_base_model(), ids))
    _, got = gradients(lora, lambda: kvcache.chunked_loss(lora, ids, chunk=5))
    assert got.keys() == want.keys() == trainable
    errors = relative_errors(got, want)
    assert max(errors.values()) < 1e-5, {n: e for n, e in errors.items() if e >= 1e-5}

    with torch.no_grad():
        adapted = lora.get_base_model()(ids)
    save_adapter(lora, tmp_path / "adapter")
    for read in (kvcache.load, kvcache.load_tokenizer):  # an adapter directory points to --merge-lora
        with pytest.raises(kvcache.CheckpointError, match="holds LoRA adapters.*--merge-lora"):
            read(tmp_path / "adapter")
    hf = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(llama_ckpt.path), tmp_path / "adapter")
    hf.to(DEVICE)
    with torch.no_grad():
        assert max_diff(hf(ids).logits, adapted) < HF_ATOL[torch.float32]

    merged = merge_lora(lora)
    assert isinstance(merged, kvcache.Transformer)
    save_checkpoint(merged, tmp_path / "merged", read_config(llama_ckpt.path), source=llama_ckpt.path)
    mine = kvcache.load(tmp_path / "merged", device=DEVICE)
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").to(DEVICE)
    with torch.no_grad():
        assert max_diff(mine(ids), adapted) < atol("cache")
        assert max_diff(theirs(ids).logits, adapted) < HF_ATOL[torch.float32]


def test_lora_errors(model):
    with pytest.raises(ValueError, match="no linear layer of the model is named"):
        add_lora(model, 4, targets=("qkv",))
    lora = add_lora(model, 2)
    with pytest.raises(ValueError, match="merge the LoRA weights"):
        save_checkpoint(lora.get_base_model(), "unused", {})


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text("It is a truth universally acknowledged, that a single man in possession of a good fortune "
                    "must be in want of a wife. " * 12)
    return path


def test_cli_finetune_writes_a_checkpoint(text_file, tmp_path, capsys):
    # No --model: the bundled model (and its tokenizer) is fine-tuned.
    out = tmp_path / "out"
    code = main(["finetune", "--data", str(text_file), "--seq-len", "64", "--chunk", "16", "--cache-length", "32",
                 "--policy", "sink", "--steps", "2", "--out", str(out), "--quiet", "--threads", "1"])
    assert code == 0, capsys.readouterr().err
    tuned = kvcache.load(out, device=DEVICE)
    assert json.loads((out / "training.json").read_text())["config"]["policy"] == "sink"
    assert len((out / "loss.jsonl").read_text().splitlines()) == 2
    assert tuned.config.num_layers == 4  # the bundled model, fine-tuned


def test_cli_finetune_redirected_prints_lines_not_bar_frames(text_file, tmp_path, capsys):
    """stderr redirected (capsys: not a terminal): no progress-bar frames (carriage returns), one
    plain line every tenth of the steps; a warm-up longer than the run is a one-line warning."""
    out = tmp_path / "out"
    code = main(["finetune", "--data", str(text_file), "--seq-len", "64", "--chunk", "16", "--cache-length", "32",
                 "--policy", "window", "--steps", "3", "--warmup", "10", "--out", str(out), "--threads", "1"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "\r" not in err and "it/s" not in err and "step/s" not in err
    assert "kvcache: warning: warmup (10 steps) is longer than the run (3 steps)" in err
    steps = [line for line in err.splitlines() if line.startswith("step ")]
    assert [line.split(":")[0] for line in steps] == ["step 1/3", "step 2/3", "step 3/3"]
    assert "lr 0.0002," in steps[-1]  # the warm-up cut to the run ends at the peak rate
    assert json.loads((out / "training.json").read_text())["config"]["warmup"] == 3


@pytest.mark.parametrize("flags, message", [
    (["--seq-len", "64", "--chunk", "128", "--cache-length", "256"], "shorter than one chunk"),
    (["--seq-len", "512", "--chunk", "128", "--cache-length", "64"], "larger than the cache"),
    (["--seq-len", "64", "--chunk", "16", "--field", "body", "--jsonl"], "has no field 'body'"),
    (["--seq-len", "64", "--chunk", "16", "--empty"], "the dataset is empty"),
    (["--seq-len", "64", "--chunk", "16", "--policy", "h2o", "--recent", "40", "--cache-length", "32"], "recent"),
    (["--seq-len", "64", "--chunk", "16", "--merge-lora"], "--merge-lora needs --lora-rank"),
])
def test_cli_finetune_errors(text_file, tmp_path, capsys, flags, message):
    data = text_file
    if "--jsonl" in flags:
        flags.remove("--jsonl")
        data = tmp_path / "d.jsonl"
        data.write_text(json.dumps({"text": "x"}) + "\n")
    if "--empty" in flags:
        flags.remove("--empty")
        data = tmp_path / "empty.jsonl"
        data.write_text("")
    code = main(["finetune", "--data", str(data), "--steps", "1", "--out", str(tmp_path / "o"), "--quiet", *flags])
    err = capsys.readouterr().err
    assert code == 2 and message in err, err
