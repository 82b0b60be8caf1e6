"""What README.md says, checked against what the code does: the set-up order, the first example,
the test command (the same as .ci/run's), the command synopses against the parser, the
exactness figures against the bundled model, the API's return types and the storages' floor."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import torch
from conftest import atol

import kvcache
from kvcache.cli.main import _parser

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()

pytestmark = pytest.mark.cpu_only("reads the README and runs the bundled model on the CPU, as its figures were")


def section(title: str) -> str:
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start : end if end >= 0 else None]


def code_blocks(text: str) -> list[str]:
    return re.findall(r"```sh\n(.*?)```", text, flags=re.S)


def test_setup_installs_torch_from_its_index_first():
    """The warning about the multi-GB CUDA build, and the index that avoids it, come before the
    first install command, which is that of torch from PyTorch's CPU index."""
    setup = section("Set-up")
    first_block = setup.index("```sh")
    assert "multi-GB" in setup[:first_block]
    commands = code_blocks(setup)[0].splitlines()
    assert commands[0].startswith("pip install torch==") and "--index-url https://download.pytorch.org/whl/cpu" in commands[0]


def test_the_first_generate_example_gives_threads():
    first = next(line for block in code_blocks(README) for line in block.splitlines() if "kvcache generate" in line)
    assert "--threads" in first


def _test_command() -> str:
    return next(line for block in code_blocks(README) for line in block.splitlines() if "pytest" in line)


def test_the_test_command_is_the_one_ci_runs():
    pytest_args = _test_command().split("python -m pytest", 1)[1].split()
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"python -m pytest -q \"\$@\"", ci)  # run_pytest passes its arguments on
    assert f"run_pytest {' '.join(a for a in pytest_args if a != '-q')} " in ci


def test_the_suite_time_is_that_of_the_test_command():
    """The README's suite time comes from benchmarks/suite_time.py, which times the README's
    test command, and says the load it was measured under."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("suite_time", ROOT / "benchmarks" / "suite_time.py")
    suite_time = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(suite_time)
    timed = " ".join(["python", *suite_time.COMMANDS["xdist"][1:]])
    assert _test_command().split(" && ", 1)[1] == timed
    tests = section("Set-up")
    sentence = tests[tests.index(timed):]
    assert "benchmarks/suite_time.py`" in sentence and re.search(r"load average\s+(of\s+)?\d", sentence), sentence


def _synopses() -> dict[str, list[str]]:
    block = code_blocks(section("Command line"))[0]
    lines, current = {}, None
    for raw in block.splitlines():
        text = raw.split("#", 1)[0]
        if text.startswith("kvcache "):
            current = text.split()[1]
            lines[current] = []
        if current is not None:
            lines[current].append(text)
    return {command: " ".join(parts) for command, parts in lines.items()}


def test_synopses_mark_exactly_the_required_options():
    """A flag shown outside brackets is one the command requires, and one shown inside brackets
    (or after a bracket opens) one it does not (the finetune synopsis once showed --seq-len N
    as required, whose default is 8192)."""
    commands = _parser().commands
    for command, synopsis in _synopses().items():
        required = {flag for action in commands[command]._actions if action.required for flag in action.option_strings}
        depth, bare = 0, set()
        for token in re.findall(r"\[|\]|--[a-z][a-z-]*", synopsis):
            depth += {"[": 1, "]": -1}.get(token, 0)
            if token.startswith("--") and depth == 0:
                bare.add(token)
        assert bare == required, (command, bare, required)


def test_the_exactness_figures_hold():
    """"fp32: logits within X on the tests' tiny models and Y on the bundled model": X is the
    suite's cached-against-plain tolerance, and the bundled model's cached, chunked and batched
    logits (kvcache drift's comparisons) stay within Y."""
    from kvcache.eval.drift import Setup, kvcache_drift, texts

    found = re.search(r"fp32: logits within (\S+) on the tests' tiny models and (\S+) on the bundled model", README)
    tiny, bundled = float(found.group(1)), float(found.group(2))
    assert tiny == atol("cache", torch.float32)
    model = kvcache.load(dtype=torch.float32)
    setup = Setup(steps=1)  # (steps: the reuse comparisons' decode steps, not checked here)
    cells = kvcache_drift(model, texts(None, setup, model.config.vocab_size), setup)
    measured = {cell.comparison: cell.max_abs for cell in cells}
    exact = ("cached vs uncached", "chunked vs one pass", "batched with padding vs alone")
    assert all(measured[c] <= bundled for c in exact), measured


def test_the_api_lists_are_the_dicts_the_readme_says():
    assert "`kvcache.policies()` and `kvcache.storages()` return dicts" in README
    assert isinstance(kvcache.policies(), dict) and isinstance(kvcache.storages(), dict)
    assert all(isinstance(v, str) for v in {**kvcache.policies(), **kvcache.storages()}.values())
    assert kvcache.policy_options("h2o")["recent"] == 32


def test_the_storage_floor_figure_is_the_bundled_models():
    from kvcache.cache.registry import break_even

    found = re.search(r"below (\d+) slots at int4 for the bundled\s+model", README)
    assert int(found.group(1)) == break_even(kvcache.load(), "dense:int4")


def test_error_form_is_the_documented_one(capsys):
    from kvcache.cli import main

    assert "Errors print `kvcache: error: ...` and exit with status 2" in README
    with pytest.raises(SystemExit) as exit_:
        main(shlex.split("generate x --cache-length -5"))
    assert exit_.value.code == 2 and capsys.readouterr().err.startswith("kvcache: error: argument --cache-length")


def test_the_thread_rule_is_the_codes():
    import kvcache.runtime.threads

    found = re.search(r"Without it a model of up to (\d+)M parameters, such as the bundled one, runs\s+one thread", README)
    assert int(found.group(1)) * 10**6 == kvcache.runtime.threads.SMALL_MODEL
    assert sum(p.numel() for p in kvcache.load().parameters()) <= kvcache.runtime.threads.SMALL_MODEL


def test_every_python_block_of_the_readme_runs_as_written(capsys):
    """A new user copies the README's Python blocks: each runs as it is, in a fresh namespace."""
    blocks = re.findall(r"```python\n(.*?)```", README, flags=re.S)
    assert blocks
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {})
    assert capsys.readouterr().out.startswith("[")
