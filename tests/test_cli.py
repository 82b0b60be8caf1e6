"""The command line, end to end on a tiny random Llama with a tiny byte-level BPE tokenizer."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import kvcache
from kvcache.cli import TextStream, main

transformers = pytest.importorskip("transformers")

PROMPT = "the cat sat on the mat"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    sentences = ["the cat sat on the mat", "a dog ran in the park", "caf\u00e9 cr\u00e8me br\u00fbl\u00e9e \u2603"]
    tok.train_from_iterator(sentences * 10, trainer=trainer)
    tok.save(str(path / "tokenizer.json"))

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


def test_generate_streams_the_greedy_continuation(model_dir, capsys):
    assert main(["generate", PROMPT, "--model", str(model_dir), "--max-new-tokens", "5"]) == 0
    out, err = capsys.readouterr()

    tokenizer = kvcache.load_tokenizer(model_dir)
    model = kvcache.load(model_dir)
    expected = kvcache.generate(model, tokenizer.encode(PROMPT), max_new_tokens=5)
    assert out == tokenizer.decode(expected) + "\n"
    assert "tok/s" in err
    assert "cache memory:" in err and "iB" in err


def test_text_stream_holds_back_partial_utf8(model_dir):
    tokenizer = kvcache.load_tokenizer(model_dir)
    # One token per byte, so the snowman and accented letters arrive split across tokens.
    vocab = tokenizer.backend.get_vocab()
    text = "br\u00fbl\u00e9e \u2603!"
    byte_chars = [c for word, _ in tokenizer.backend.pre_tokenizer.pre_tokenize_str(text) for c in word]
    ids = [vocab[c] for c in byte_chars]

    chunks: list[str] = []

    class Out:
        def write(self, s: str) -> None:
            chunks.append(s)

        def flush(self) -> None:
            pass

    stream = TextStream(tokenizer, Out())
    for token in ids:
        stream.push(token)
    stream.finish()
    assert "".join(chunks) == text
    assert not any("\ufffd" in c for c in chunks)
    assert len(chunks) > 1  # it streamed rather than printing everything at the end


def test_unknown_policy_names_the_available_ones(model_dir, capsys):
    code = main(["generate", PROMPT, "--model", str(model_dir), "--policy", "nope"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("kvcache: error:")
    assert "nope" in err and "dense" in err
    assert "Traceback" not in err


def test_missing_model_dir(tmp_path, capsys):
    missing = tmp_path / "no_such_model"
    assert main(["generate", PROMPT, "--model", str(missing)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvcache: error:")
    assert str(missing) in err and "not a directory" in err


def test_cache_too_small_for_dense(model_dir, capsys):
    code = main(["generate", PROMPT, "--model", str(model_dir), "--cache-length", "2"])
    assert code == 2
    assert "cache_length" in capsys.readouterr().err


def test_policies_lists_dense(capsys):
    assert main(["policies"]) == 0
    out = capsys.readouterr().out
    assert any(line.split()[0] == "dense" and len(line.split()) > 1 for line in out.splitlines())


def test_policy_options_reach_the_policy(model_dir, capsys):
    """`--policy h2o --recent 4` generates what the Python API does with the same options."""
    args = ["generate", PROMPT * 3, "--model", str(model_dir), "--max-new-tokens", "6",
            "--policy", "h2o", "--cache-length", "8", "--recent", "4", "--normalize"]
    assert main(args) == 0
    out, err = capsys.readouterr()
    tokenizer = kvcache.load_tokenizer(model_dir)
    model = kvcache.load(model_dir)
    ids = tokenizer.encode(PROMPT * 3)
    # The CLI prefills in chunks of 512, i.e. this whole prompt in one chunk.
    expected = kvcache.generate(model, ids, max_new_tokens=6, policy="h2o", cache_length=8,
                                policy_options={"recent": 4, "normalize": True})
    assert out == tokenizer.decode(expected) + "\n"
    assert "(h2o, 8 slots)" in err


def test_option_of_another_policy_is_rejected(model_dir, capsys):
    code = main(["generate", PROMPT, "--model", str(model_dir), "--policy", "window", "--recent", "4"])
    err = capsys.readouterr().err
    assert code == 2
    assert "has no option 'recent'" in err


def test_fractional_cache_length_and_pyramid(model_dir, capsys):
    args = ["generate", PROMPT * 4, "--model", str(model_dir), "--max-new-tokens", "3",
            "--policy", "window", "--cache-length", "0.5", "--allocation", "pyramid"]
    assert main(args) == 0
    n_prompt = len(kvcache.load_tokenizer(model_dir).encode(PROMPT * 4))
    assert f"(window, {round(0.5 * n_prompt)} slots)" in capsys.readouterr().err


def test_reserve_reaches_the_cache(model_dir, capsys):
    """`--reserve 4` generates what a cache made with reserve=4 does."""
    args = ["generate", PROMPT * 3, "--model", str(model_dir), "--max-new-tokens", "6",
            "--policy", "tova", "--cache-length", "8", "--reserve", "4"]
    assert main(args) == 0
    out = capsys.readouterr().out
    tokenizer = kvcache.load_tokenizer(model_dir)
    model = kvcache.load(model_dir)
    ids = tokenizer.encode(PROMPT * 3)
    cache = kvcache.make_cache(model, "tova", cache_length=8, reserve=4)
    expected = kvcache.generate(model, ids, max_new_tokens=6, cache=cache)
    assert out == tokenizer.decode(expected) + "\n"


def test_reserve_on_a_ring_policy_is_rejected(model_dir, capsys):
    code = main(["generate", PROMPT, "--model", str(model_dir), "--policy", "window",
                 "--cache-length", "8", "--reserve", "2"])
    assert code == 2
    assert "reserve does not apply to the window policy" in capsys.readouterr().err
