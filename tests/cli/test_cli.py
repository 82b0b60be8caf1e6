"""The command line, end to end on a tiny random Llama with a tiny byte-level BPE tokenizer."""

from __future__ import annotations

import inspect
import io
import json
import os
import re
import subprocess
import sys

import pytest
import torch
from text_checkpoint import build_text_checkpoint

import kvcache
from kvcache.cli import main
from kvcache.cli.args import cache_length_arg
from kvcache.cli.generate import TextStream
from kvcache.cli.main import _parser
from kvcache.errors import GenerationError
from kvcache.generation.generate import DEFAULT_PREFILL_CHUNK, truncate_at_stop

pytestmark = pytest.mark.cpu_only("the command line loads its models on the CPU by default, in this process and in subprocesses")

transformers = pytest.importorskip("transformers")

PROMPT = "the cat sat on the mat"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_text_checkpoint(tmp_path_factory.mktemp("tiny_llama") / "model")


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
    assert str(missing) in err and "does not exist" in err


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


# --- flags of `kvcache generate` ---------------------------------------------------------------


def _api(model_dir, prompt=PROMPT, **kwargs):
    """What the Python API makes of ``prompt`` (the reference for the CLI's output)."""
    tokenizer = kvcache.load_tokenizer(model_dir)
    return tokenizer, kvcache.generate(kvcache.load(model_dir), tokenizer.encode(prompt), **kwargs)


def test_summary_on_stderr_text_on_stdout_and_quiet(model_dir, capsys):
    assert main(["generate", PROMPT, "--model", str(model_dir), "--max-new-tokens", "4", "--quiet"]) == 0
    out, err = capsys.readouterr()
    tokenizer, expected = _api(model_dir, max_new_tokens=4)
    assert out == tokenizer.decode(expected) + "\n"
    assert err == ""


@pytest.mark.parametrize(
    "value,expected",
    [("300", 300), ("1", 1), ("1.0", 1.0), ("0.25", 0.25), (".5", 0.5), ("1e-2", 0.01), ("1e3", 1000), ("4E3", 4000)],
)
def test_cache_length_parses_counts_and_fractions(value, expected):
    got = cache_length_arg(value)
    assert got == expected and type(got) is type(expected)


@pytest.mark.parametrize("value", ["abc", "0", "-3", "300.0", "1.5", "0.0", "nan", "", "1.5e3", "2.5e0"])
def test_bad_cache_length_names_the_flag_and_the_forms(value, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["generate", PROMPT, "--cache-length", value])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "argument --cache-length" in err
    assert "token count" in err and "fraction" in err
    assert "_arg" not in err and "_budget" not in err


def test_cache_length_one_point_zero_is_the_whole_prompt(model_dir, capsys):
    args = ["generate", PROMPT * 2, "--model", str(model_dir), "--max-new-tokens", "2",
            "--policy", "window", "--cache-length", "1.0"]
    assert main(args) == 0
    n_prompt = len(kvcache.load_tokenizer(model_dir).encode(PROMPT * 2))
    assert f"(window, {n_prompt} slots)" in capsys.readouterr().err


def test_dense_too_small_fails_before_printing(model_dir, capsys):
    n_prompt = len(kvcache.load_tokenizer(model_dir).encode(PROMPT))
    args = ["generate", PROMPT, "--model", str(model_dir), "--max-new-tokens", "8",
            "--cache-length", str(n_prompt + 3)]
    assert main(args) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert "at most" in err and "max_new_tokens" in err


def test_threads_are_chosen_for_the_model_unless_given(model_dir, monkeypatch, capsys):
    """--threads N wins; without it a small CPU model runs one thread (kvcache/runtime/threads.py), a larger
    one torch's choice, capped at the cores other processes leave idle by the load average, and
    any model keeps torch's choice when OMP_NUM_THREADS is set."""
    import kvcache.runtime.threads

    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)  # torch's choice on a 4-core machine
    monkeypatch.setattr(kvcache.runtime.threads, "_AT_IMPORT", 4)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(4)), raising=False)
    monkeypatch.setattr(os, "getloadavg", lambda: (0.1, 0.0, 0.0), raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    run = ["generate", PROMPT, "--model", str(model_dir), "--max-new-tokens", "1", "--json"]
    assert main(run + ["--threads", "3"]) == 0
    assert calls == [3]
    assert main(run) == 0
    assert calls == [3, 1]  # a small model: one thread
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["threads"] == 4
    monkeypatch.setattr(kvcache.runtime.threads, "SMALL_MODEL", 1000)
    assert main(run) == 0
    assert calls == [3, 1]  # a larger one on an idle machine: torch's own choice
    monkeypatch.setattr(os, "getloadavg", lambda: (2.6, 0.0, 0.0), raising=False)
    assert main(run) == 0
    assert calls == [3, 1, 1]  # three of the four cores busy: one thread
    assert main(run + ["--threads", "2"]) == 0
    assert calls == [3, 1, 1, 2]  # --threads wins over the load
    monkeypatch.setattr(kvcache.runtime.threads, "SMALL_MODEL", 10**9)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert main(run) == 0
    assert calls == [3, 1, 1, 2]  # the environment said
    with pytest.raises(SystemExit):
        main(["generate", PROMPT, "--threads", "0"])
    assert "--threads" in capsys.readouterr().err


def test_the_summary_names_the_threads_on_the_cpu(model_dir, capsys):
    assert main(["generate", PROMPT, "--model", str(model_dir), "--max-new-tokens", "3", "--threads", "1"]) == 0
    assert re.search(r"decode: (n/a|[0-9.]+ tok/s) \(1 thread\) \| cache memory", capsys.readouterr().err)


def test_top_p_without_temperature_is_an_error(model_dir, capsys):
    assert main(["generate", PROMPT, "--model", str(model_dir), "--top-p", "0.5"]) == 2
    err = capsys.readouterr().err
    assert "--top-p" in err and "--temperature" in err


def test_json_gives_one_object_per_prompt(model_dir, capsys):
    args = ["generate", PROMPT, "--model", str(model_dir), "--max-new-tokens", "5", "--json"]
    assert main(args) == 0
    out, err = capsys.readouterr()
    tokenizer, expected = _api(model_dir, max_new_tokens=5)
    [record] = [json.loads(line) for line in out.splitlines()]
    assert record["prompt"] == PROMPT
    assert record["prompt_tokens"] == len(tokenizer.encode(PROMPT))
    assert record["tokens"] == expected
    assert record["text"] == tokenizer.decode(expected)
    assert record["prefill_s"] > 0 and record["decode_s"] >= 0 and record["prefill_tok_s"] > 0
    assert record["cache_bytes"] > 0 and record["compile_s"] is None
    assert "tok/s" in err  # the summary still goes to stderr


@pytest.mark.cpu_only("int4 weights run on the CPU only")
def test_weights_int4_generates_what_the_api_does_with_them(model_dir, capsys):
    args = ["generate", PROMPT, "--model", str(model_dir), "--max-new-tokens", "5", "--json", "--quiet",
            "--weights", "int4"]
    assert main(args) == 0
    [record] = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    tokenizer = kvcache.load_tokenizer(model_dir)
    model = kvcache.load(model_dir, weights="int4")
    assert record["weights"] == "int4"
    assert record["tokens"] == kvcache.generate(model, tokenizer.encode(PROMPT), max_new_tokens=5)
    with pytest.raises(SystemExit):
        main(["generate", PROMPT, "--model", str(model_dir), "--weights", "int3"])
    assert "--weights" in capsys.readouterr().err


def test_prompts_file_runs_one_ragged_batch(model_dir, tmp_path, capsys):
    prompts = ["the cat sat", "", "a dog ran in the park and the cat sat on the mat"]
    file = tmp_path / "prompts.txt"
    file.write_text("\n".join(prompts) + "\n")
    tokenizer = kvcache.load_tokenizer(model_dir)
    kept = [p for p in prompts if p]
    expected = kvcache.generate(kvcache.load(model_dir), [tokenizer.encode(p) for p in kept], max_new_tokens=4)

    assert main(["generate", "--prompts-file", str(file), "--model", str(model_dir), "--max-new-tokens", "4"]) == 0
    out, err = capsys.readouterr()
    assert out == "\n".join(f"==> prompt {i + 1} of 2 <==\n{tokenizer.decode(e)}\n" for i, e in enumerate(expected))
    assert "prompts: 2" in err

    assert main(["generate", "--prompts-file", str(file), "--model", str(model_dir), "--max-new-tokens", "4",
                 "--json", "--quiet"]) == 0
    out, err = capsys.readouterr()
    records = [json.loads(line) for line in out.splitlines()]
    assert [r["prompt"] for r in records] == kept
    assert [r["tokens"] for r in records] == expected
    assert err == ""


def test_prompt_and_prompts_file_are_exclusive(model_dir, tmp_path, capsys):
    file = tmp_path / "p.txt"
    file.write_text("x\n")
    assert main(["generate", PROMPT, "--prompts-file", str(file), "--model", str(model_dir)]) == 2
    assert "not both" in capsys.readouterr().err
    assert main(["generate", "--model", str(model_dir)]) == 2
    assert "PROMPT" in capsys.readouterr().err
    assert main(["generate", "--prompts-file", str(tmp_path / "missing.txt")]) == 2
    assert "cannot read" in capsys.readouterr().err


def _stop_string(text: str) -> str:
    """Two printable characters that first occur a few characters into ``text``."""
    return next(
        text[i : i + 2] for i in range(3, len(text) - 2)
        if text.find(text[i : i + 2]) == i and text[i : i + 2].isprintable() and "\ufffd" not in text[i : i + 2]
    )


def test_stop_strings_in_the_api(model_dir):
    tokenizer, free = _api(model_dir, max_new_tokens=16, stop_tokens=())
    text = tokenizer.decode(free)
    stop = _stop_string(text)
    # The row ends with the token that completes the stop string.
    n = next(k for k in range(1, len(free) + 1) if stop in tokenizer.decode(free[:k]))
    _, got = _api(model_dir, max_new_tokens=16, stop_tokens=(), stop_strings=[stop], tokenizer=tokenizer)
    assert got == free[:n] and n < len(free)
    assert truncate_at_stop(tokenizer.decode(got), [stop]) == text[: text.find(stop)]
    with pytest.raises(ValueError, match="tokenizer"):
        _api(model_dir, max_new_tokens=2, stop_strings=[stop])


def test_stop_string_ends_generation_and_is_not_printed(model_dir, capsys):
    tokenizer, free = _api(model_dir, max_new_tokens=16, stop_tokens=())
    text = tokenizer.decode(free)
    stop = _stop_string(text)
    args = ["generate", PROMPT, "--model", str(model_dir), "--max-new-tokens", "16", "--stop", stop, "--stop", "\u2603\u2603"]
    assert main(args) == 0
    out, err = capsys.readouterr()
    assert out == text[: text.find(stop)] + "\n"
    new_tokens = int(err.split("new tokens: ")[1].split()[0])
    assert new_tokens < len(free)  # generation stopped, not just the printing
    ttft = err.split("first token after ")[1].split()  # the time to the first token
    assert float(ttft[0]) > 0 and ttft[1] in ("ms", "s")


def test_text_stream_holds_back_a_possible_stop_string():
    class Letters:
        def decode(self, ids):
            return "".join(chr(i) for i in ids)

    chunks: list[str] = []

    class Out:
        def write(self, s: str) -> None:
            chunks.append(s)

        def flush(self) -> None:
            pass

    stream = TextStream(Letters(), Out(), stop_strings=("END",))
    for c in "abEN":
        stream.push(ord(c))
    assert "".join(chunks) == "ab"  # "EN" may begin END
    stream.push(ord("x"))
    assert "".join(chunks) == "abENx"
    for c in "yENDzz":
        stream.push(ord(c))
    stream.finish()
    assert "".join(chunks) == "abENxy"


def test_repetition_penalty_breaks_a_greedy_loop(model_dir, capsys):
    _, free = _api(model_dir, max_new_tokens=16, stop_tokens=())
    assert len(set(free[-8:])) <= 2  # this random model falls into a loop
    tokenizer, penalized = _api(model_dir, max_new_tokens=16, stop_tokens=(), repetition_penalty=1.5)
    assert penalized != free and len(set(penalized)) > len(set(free))
    args = ["generate", PROMPT, "--model", str(model_dir), "--max-new-tokens", "16", "--repetition-penalty", "1.5"]
    assert main(args) == 0
    _, expected = _api(model_dir, max_new_tokens=16, repetition_penalty=1.5)
    assert capsys.readouterr().out == tokenizer.decode(expected) + "\n"


def _captured_generate(monkeypatch):
    """Replace the CLI's generate with one that records its keyword arguments."""
    seen: dict = {}

    def fake(model, prompts, **kwargs):
        seen.update(kwargs)
        return [[] for _ in prompts]

    monkeypatch.setattr("kvcache.cli.generate.generate", fake)
    return seen


def test_generation_config_supplies_defaults_and_flags_win(tmp_path, monkeypatch, capsys):
    config = {"do_sample": True, "temperature": 0.7, "top_k": 20, "top_p": 0.8, "repetition_penalty": 1.05,
              "max_new_tokens": 7, "eos_token_id": [5, 6]}
    path = build_text_checkpoint(tmp_path / "m", generation_config=config)
    seen = _captured_generate(monkeypatch)
    assert main(["generate", PROMPT, "--model", str(path)]) == 0
    assert (seen["temperature"], seen["top_k"], seen["top_p"]) == (0.7, 20, 0.8)
    assert seen["repetition_penalty"] == 1.05 and seen["max_new_tokens"] == 7
    assert {5, 6} <= set(seen["stop_tokens"])

    assert main(["generate", PROMPT, "--model", str(path), "--temperature", "1.2", "--top-k", "3",
                 "--max-new-tokens", "2", "--repetition-penalty", "1.0"]) == 0
    assert (seen["temperature"], seen["top_k"], seen["top_p"]) == (1.2, 3, 0.8)
    assert seen["repetition_penalty"] == 1.0 and seen["max_new_tokens"] == 2

    # An explicit --temperature 0 is greedy: the checkpoint's filters go with its sampling.
    assert main(["generate", PROMPT, "--model", str(path), "--temperature", "0"]) == 0
    assert (seen["temperature"], seen["top_k"], seen["top_p"]) == (0, None, None)


def test_generation_config_without_do_sample_stays_greedy(tmp_path, monkeypatch):
    path = build_text_checkpoint(tmp_path / "m", generation_config={"temperature": 0.6, "top_p": 0.9})
    seen = _captured_generate(monkeypatch)
    assert main(["generate", PROMPT, "--model", str(path)]) == 0
    assert (seen["temperature"], seen["top_k"], seen["top_p"]) == (0.0, None, None)
    assert seen["max_new_tokens"] == 128


def test_error_after_tokens_prints_them_then_fails(model_dir, monkeypatch, capsys):
    def failing(model, prompts, **kwargs):
        raise GenerationError("generation failed after 2 new tokens (RuntimeError: boom)", [[100, 101], [102]])

    monkeypatch.setattr("kvcache.cli.generate.generate", failing)
    tokenizer = kvcache.load_tokenizer(model_dir)
    with_file = ["--prompts-file", "-", "--model", str(model_dir), "--json"]
    monkeypatch.setattr("sys.stdin", io.StringIO("a\nb\n"))
    assert main(["generate", *with_file]) == 2
    out, err = capsys.readouterr()
    records = [json.loads(line) for line in out.splitlines()]
    assert [r["tokens"] for r in records] == [[100, 101], [102]]
    assert records[0]["text"] == tokenizer.decode([100, 101]) and "boom" in records[0]["error"]
    assert "kvcache: error: generation failed" in err


# --- the program -------------------------------------------------------------------------------


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"kvcache {kvcache.__version__}"


def test_python_dash_m_kvcache():
    run = subprocess.run([sys.executable, "-m", "kvcache", "--version"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == f"kvcache {kvcache.__version__}"


def test_help_lists_the_valid_values(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for flag in ("--positions {absolute,renumbered}", "--fallback {window,tova}", "--pooling {avg,max}",
                 "--normalize, --no-normalize", "--allocation {uniform,pyramid}"):
        assert flag in out
    assert f"(default: {DEFAULT_PREFILL_CHUNK})" in out


def test_policies_show_the_real_flags(capsys):
    assert main(["policies"]) == 0
    out = capsys.readouterr().out
    assert "--normalize/--no-normalize (default: off)" in out
    assert "--positions {absolute,renumbered}" in out
    assert "--normalize False" not in out


def test_prefill_chunk_has_one_default():
    assert inspect.signature(kvcache.generate).parameters["prefill_chunk"].default == DEFAULT_PREFILL_CHUNK
    assert _parser().parse_args(["generate", "x"]).prefill_chunk == DEFAULT_PREFILL_CHUNK


# --- kvcache eval ------------------------------------------------------------------------------

TINY_GRID = ["--policies", "dense,window", "--budgets", "0.5", "--lengths", "48", "--depths", "0",
             "--trials", "1", "--stream-tokens", "48"]


def test_eval_runs_from_any_directory_with_the_packaged_texts(model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # no evaluation texts here: they come with the package
    assert main(["eval", "--model", str(model_dir), "--no-plots", "--threads", "1", *TINY_GRID]) == 0
    out, err = capsys.readouterr()
    assert "| dense | 1 |" in out
    assert err.startswith("kvcache eval: writing the report to kvcache-eval/")
    report = json.loads((tmp_path / "kvcache-eval" / "report.json").read_text())
    assert {s["policy"] for s in report["streaming"]} == {"dense", "window"}
    assert not (tmp_path / "kvcache-eval" / "quality_vs_budget.png").exists()


def test_eval_without_matplotlib_fails_before_the_grid(model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError

    def must_not_run(*args, **kwargs):
        raise AssertionError("the grid ran although the plots could not be drawn")

    monkeypatch.setattr("kvcache.eval.quality.evaluate", must_not_run)
    assert main(["eval", "--model", str(model_dir), "--out", str(tmp_path / "out"), *TINY_GRID]) == 2
    err = capsys.readouterr().err
    assert "pip install 'kvcache[eval]'" in err and "--no-plots" in err


@pytest.mark.parametrize("args,suggestion", [
    (["--recnt", "3"], "--recent"),       # a typo
    (["--policy", "sink", "--sink", "8"], "--sinks"),  # an abbreviation is not taken for the option
])
def test_unknown_option_names_the_closest_option(args, suggestion, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["generate", PROMPT, *args])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("kvcache: error: unrecognized arguments: ") and f"did you mean {suggestion}?" in err
    assert "usage:" not in err


@pytest.mark.parametrize("args, message", [
    (["generate", PROMPT, "--cache-length", "-5"], "argument --cache-length: .* got '-5' \\(negative: "),
    (["generate", PROMPT, "--cache-length", "0"], "argument --cache-length: .* got '0' \\(a cache holds at least 1"),
    (["generate", PROMPT, "--temperature", "warm"], "argument --temperature: expected a number, got 'warm'"),
    (["generate", PROMPT, "--dtype", "f16"], "argument --dtype: invalid choice: 'f16'"),
    (["generate", PROMPT, "--policy"], "argument --policy: expected one argument"),
    (["eval", "--lengths", "a,b"], "argument --lengths: expected a comma-separated list"),
    (["eval", "--benchmrk", "ruler"], "unrecognized arguments: --benchmrk ruler \\(did you mean --benchmark\\?\\)"),
    (["finetune", "--data", "x.txt"], "the following arguments are required: --out"),
    (["finetune", "--data", "x.txt", "--out", "o", "--warmup", "-1"], "argument --warmup: expected an integer >= 0"),
    (["drift", "--tokens", "3"], "argument --tokens: expected an integer >= 8, got '3'"),
    (["policies", "--all"], "unrecognized arguments: --all"),
    ([], "name a command: generate, eval, finetune, drift, policies"),
    (["genrate", PROMPT], "unknown command 'genrate'; did you mean generate\\?"),
])
def test_every_argument_error_is_one_line_in_the_documented_form(args, message, capsys):
    """README and docs/cli.md: errors print `kvcache: error: ...` and exit with status 2; an
    argument error is no exception (one line, no usage block, whichever command)."""
    import re

    with pytest.raises(SystemExit) as exit_:
        main(args)
    assert exit_.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("kvcache: error: "), err
    assert re.search(message, err), err
    assert "usage:" not in err


def test_a_cache_too_large_for_memory_is_refused_before_allocation(capsys):
    """--compile allocates the whole dense cache up front (a captured step's buffers keep their
    size): one the machine cannot hold is refused before anything runs, saying what to lower."""
    assert main(["generate", PROMPT, "--max-new-tokens", "1000000000", "--compile", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvcache: error: growing the dense cache from") and "available on cpu" in err
    assert "compile=True" in err and "max_new_tokens" in err
    assert "Traceback" not in err


def test_a_large_max_new_tokens_costs_what_the_run_reaches(model_dir, capsys):
    """Without --compile the dense cache allocates as it fills: a run that stops early holds the
    tokens it reached, not the billion it was allowed, and reaches no position to warn about."""
    tokenizer, free = _api(model_dir, max_new_tokens=16, stop_tokens=())
    stop = _stop_string(tokenizer.decode(free))
    args = ["generate", PROMPT, "--model", str(model_dir), "--max-new-tokens", "1000000000", "--stop", stop]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "warning" not in err
    assert re.search(r"cache memory: [0-9.]+ KiB \(dense, \d+ of 10000000\d\d slots allocated\)", err), err


def test_chat_without_a_chat_template_says_to_drop_it(capsys):
    assert main(["generate", PROMPT, "--chat"]) == 2
    err = capsys.readouterr().err
    assert "has no chat template" in err and "drop --chat" in err


def test_kvcache_warnings_read_as_kvcache_messages(capsys):
    long = " ".join(["word"] * 5000)
    assert main(["generate", long, "--max-new-tokens", "1", "--quiet"]) == 0
    err = capsys.readouterr().err
    assert err.startswith("kvcache: warning: a sequence reached position") and "warnings.warn" not in err


def test_a_warning_is_printed_on_its_own_line_under_a_progress_bar(monkeypatch):
    """A kvcache warning raised while the prefill bar is drawn (the max-position warning of a
    long prompt) clears the bar's line first, rather than continuing it."""
    from tqdm import tqdm

    from kvcache.cli.main import _warn
    from kvcache.errors import KVCacheWarning

    stream = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stream)
    bar = tqdm(total=10, file=stream, desc="prefill")
    bar.update(3)
    message = "a sequence reached position 9000, beyond the model's max_position_embeddings=4096"
    _warn(KVCacheWarning(message), KVCacheWarning, "model.py", 1)
    bar.close()
    lines = re.split(r"[\r\n]", stream.getvalue())
    assert f"kvcache: warning: {message}" in lines
    assert any(line.startswith("prefill:") for line in lines)


@pytest.mark.parametrize("prompt, whitespace", [("", False), ("  ", True)])
def test_an_empty_prompt_is_said_to_be_one(model_dir, capsys, prompt, whitespace):
    # The bundled tokenizer adds a beginning-of-text token, from which the model continues.
    assert main(["generate", prompt, "--max-new-tokens", "2", "--quiet"]) == 0
    err = capsys.readouterr().err
    assert err.startswith("kvcache: warning: the prompt is empty") and ("whitespace" in err) == whitespace
    assert "the beginning-of-text token" in err
    assert main(["generate", "x", "--max-new-tokens", "2", "--quiet"]) == 0
    assert capsys.readouterr().err == ""
    if not prompt:  # a tokenizer that adds none leaves nothing to continue: an error
        assert main(["generate", prompt, "--model", str(model_dir), "--max-new-tokens", "2", "--quiet"]) == 2
        assert capsys.readouterr().err.startswith("kvcache: error: prompt 0 is empty")


def test_compile_says_it_compiles_then_reports_its_time_apart(model_dir, monkeypatch, capsys):
    """--compile: a line on stderr before the first token says the pause after it is a
    compilation; the summary gives the compile time apart from the decode speed, which leaves
    the compiling step out. (generate is stubbed: the capture itself is tests/generation/test_compiled.py's.)"""
    import types

    import kvcache.cli.generate as cli

    def fake_generate(model, ids, *, cache, on_token, on_prefill, compile, max_new_tokens, **kwargs):
        assert compile
        on_prefill(len(ids[0]), len(ids[0]))
        order.append("first token")
        on_token(0, 5)
        cache.captured = types.SimpleNamespace(compile_s=2.5)
        for token in (6, 7, 8):
            on_token(0, token)
        return [[5, 6, 7, 8]]

    order = []
    monkeypatch.setattr(cli, "generate", fake_generate)
    monkeypatch.setattr(sys, "stderr", types.SimpleNamespace(
        write=lambda s: order.append(s), flush=lambda: None, isatty=lambda: False))
    assert main(["generate", PROMPT, "--model", str(model_dir), "--compile", "--max-new-tokens", "4"]) == 0
    notice = next(i for i, s in enumerate(order) if s.startswith("kvcache: compiling the decode step"))
    assert notice < order.index("first token")
    summary = "".join(order[order.index("first token") :])
    assert "compile: 2.5 s | decode: " in summary
    assert main(["generate", PROMPT, "--model", str(model_dir), "--compile", "--max-new-tokens", "4", "--quiet"]) == 0
    assert not any("compiling" in s for s in order[order.index("first token") + 1 :])


def test_ctrl_c_prints_what_was_made_and_the_summary(model_dir, monkeypatch, capsys):
    """An interrupted generate prints the text made so far, the summary and what happened, and ends
    with status 130. (generate is stubbed to be interrupted after three tokens.)"""
    import kvcache.cli.generate as cli

    def interrupted_generate(model, ids, *, on_token, on_prefill, **kwargs):
        on_prefill(len(ids[0]), len(ids[0]))
        for token in (5, 6, 7):
            on_token(0, token)
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "generate", interrupted_generate)
    assert main(["generate", PROMPT, "--model", str(model_dir), "--max-new-tokens", "8"]) == 130
    out, err = capsys.readouterr()
    tokenizer = kvcache.load_tokenizer(model_dir)
    assert out.strip() == tokenizer.decode([5, 6, 7]).strip()
    assert "new tokens: 3" in err and "kvcache: interrupted after 3 new tokens" in err


@pytest.mark.parametrize("env", [None, "2"])
def test_the_api_loads_a_model_with_the_command_lines_thread_rule(env):
    """kvcache.load sets the command line's thread count for the model (one thread for a small CPU
    model), unless the program (torch.set_num_threads) or the environment (OMP_NUM_THREADS) chose
    one first. (A fresh process: the count is process-wide.)"""
    import subprocess

    code = ("import torch, kvcache\nbefore = torch.get_num_threads()\nkvcache.load()\nprint(before, torch.get_num_threads())\n"
            "torch.set_num_threads(3)\nkvcache.load()\nprint(torch.get_num_threads())")
    environ = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if env is not None:
        environ["OMP_NUM_THREADS"] = env
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environ, check=True)
    before, after, chosen = map(int, out.stdout.split()[-3:])
    assert after == (1 if env is None else before)  # the rule, or the environment's count kept
    assert chosen == 3  # the program's count kept
