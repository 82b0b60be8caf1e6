"""The test device: ``KVCACHE_TEST_DEVICE`` naming a device that is not there stops the run before
anything is collected, with a message saying why, instead of running the suite on the CPU."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import DEVICE, DEVICE_VARIABLE, random_ids

SUBPROCESS = pytest.mark.cpu_only("runs pytest in a subprocess with CUDA hidden")

PROBE = '''
from pathlib import Path


def test_probe(device):
    Path(__file__).with_name("ran").write_text(str(device))
'''


def _run(tmp_path: Path, value: str) -> subprocess.CompletedProcess:
    """pytest in a subprocess over one probe test, with the suite's conftest and CUDA hidden."""
    shutil.copy(Path(__file__).with_name("conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_probe.py").write_text(PROBE)
    env = {**os.environ, DEVICE_VARIABLE: value, "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


@SUBPROCESS
@pytest.mark.parametrize("value, message", [("cuda", "sees no CUDA device"), ("tpu", "cpu or cuda")])
def test_a_device_that_is_not_there_fails_the_run_before_collection(tmp_path, value, message):
    proc = _run(tmp_path, value)
    assert proc.returncode == pytest.ExitCode.USAGE_ERROR, proc.stdout + proc.stderr
    assert f"{DEVICE_VARIABLE}={value!r}" in proc.stderr and message in proc.stderr, proc.stderr
    assert not (tmp_path / "ran").exists()  # nothing ran, on the CPU or elsewhere


@SUBPROCESS
def test_cpu_runs_the_probe_on_the_cpu(tmp_path):
    proc = _run(tmp_path, "cpu")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "ran").read_text() == "cpu"


def test_ids_and_models_are_built_on_the_test_device(device, llama):
    assert device == DEVICE
    assert random_ids(4).device.type == device.type
    assert random_ids(4, device="cpu").device.type == "cpu"
    assert torch.equal(random_ids(6, seed=3).cpu(), random_ids(6, seed=3, device="cpu"))
    assert {p.device.type for p in llama.parameters()} == {device.type}


def test_the_longest_modules_named_first_are_there():
    """conftest's LONGEST_FIRST names modules of the suite: one moved or renamed would silently
    lose its place at the front of the run."""
    from conftest import LONGEST_FIRST

    root = Path(__file__).parent
    assert [name for name in LONGEST_FIRST if not (root / name).is_file()] == []
