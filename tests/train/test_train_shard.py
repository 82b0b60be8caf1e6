"""Data-parallel chunked_loss on gloo, one process per rank: DDP and FSDP2 gradients equal the
single-process gradient of the same global batch (fp32, relative error <= 1e-5), LoRA and full
fine-tuning, dense and evicting caches, ranks holding different numbers of rows and of targets;
the gathered FSDP2 state equals the model's; a failing rank ends the run with its error."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest
import shard_util
import torch
import torch.multiprocessing as mp
from conftest import HF_ATOL, max_diff
from train_util import gradients, loss_args, relative_errors, tiny_model, token_ids

import kvcache
from kvcache.cli import main

REL_TOL = 1e-5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("shard_model")
    tiny_model(path, layers=2)
    return str(path)


H2O = ("h2o", {"cache_length": 12, "recent": 4})


def check(results: list[dict], count: int) -> None:
    assert len(results) == count
    for r in results:
        assert r["loss_error"] <= REL_TOL and r["grad_error"] <= REL_TOL, r
        assert r["state_equal"], r


# gloo process groups and torchrun in CPU processes, and the CLI's CPU checkpoints: on the CPU
# whatever KVCACHE_TEST_DEVICE says.
GLOO = pytest.mark.cpu_only("gloo process groups and torchrun on the CPU")
SLOW = pytest.mark.skipif(not os.environ.get("KVCACHE_SLOW_TESTS"), reason="slow (more processes); set KVCACHE_SLOW_TESTS=1")
# Every pair of (DDP or FSDP2, full or LoRA, dense or h2o) in 4 runs; all 8 with KVCACHE_SLOW_TESTS.
PAIRS = [("ddp", False, H2O), ("ddp", True, ("dense", {})), ("fsdp", False, ("dense", {})), ("fsdp", True, H2O)]
ALL = [(how, lora, p) for how in ("ddp", "fsdp") for lora in (False, True) for p in (("dense", {}), H2O)]


@GLOO
@pytest.mark.parametrize("combos", [PAIRS, pytest.param(ALL, marks=SLOW)], ids=["pairs", "all"])
def test_two_ranks_equal_one_process(ckpt, tmp_path, combos):
    """3 rows over 2 ranks (2 + 1), one row with ignored targets and every target weighted: the
    ranks' target counts differ, so each rank's share must be taken over the global weight."""
    cases = [dict(how=how, lora=lora, policy=policy, options=options) for how, lora, (policy, options) in combos]
    cases.append(dict(how="fsdp", lora=False, policy=H2O[0], options=H2O[1], ragged=True))  # rows of 24, 17, 10
    out = tmp_path / "results.json"
    mp.spawn(shard_util.equivalence, args=(2, free_port(), ckpt, cases, str(out)), nprocs=2)
    check(json.loads(out.read_text()), len(cases))


@GLOO
@SLOW
def test_three_ranks_equal_one_process(ckpt, tmp_path):
    cases = [dict(how="fsdp", lora=False, policy=H2O[0], options=H2O[1], rows=4),
             dict(how="ddp", lora=True, policy="dense", options={}, rows=4)]
    out = tmp_path / "results.json"
    mp.spawn(shard_util.equivalence, args=(3, free_port(), ckpt, cases, str(out)), nprocs=3)
    check(json.loads(out.read_text()), len(cases))


@GLOO
@pytest.mark.parametrize("mode, message", [("raise", "ids needs at least 2 tokens per row"),
                                           pytest.param("vanish", "", marks=SLOW)])
def test_a_failing_rank_ends_the_run(ckpt, mode, message):
    """Rank 1 raises (the run ends with its error) or vanishes (rank 0's collective fails rather
    than waiting forever)."""
    start = time.time()
    with pytest.raises(Exception) as failure:
        mp.spawn(shard_util.failing_rank, args=(2, free_port(), ckpt, mode), nprocs=2)
    assert time.time() - start < 60
    if mode == "raise":
        assert message in str(failure.value) and "Process 1 terminated" in str(failure.value), failure.value
    else:
        assert "Process 0 terminated" in str(failure.value), failure.value


def test_offload_kv_gives_the_same_gradients(tmp_path):
    model = tiny_model(tmp_path, layers=2)
    ids = token_ids(30, batch=2, seed=4)
    kw = dict(policy="h2o", cache_length=12, chunk=7, recent=4)
    want_loss, want = gradients(model, lambda: kvcache.chunked_loss(model, ids, **loss_args(kw)))
    got_loss, got = gradients(model, lambda: kvcache.chunked_loss(model, ids, offload_kv=True, **loss_args(kw)))
    assert got_loss == want_loss
    assert all(torch.equal(got[n], want[n]) for n in want)
    assert max(relative_errors(got, want).values()) == 0.0


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text("It is a truth universally acknowledged, that a single man in possession of a good fortune "
                    "must be in want of a wife. " * 12)
    return path


FLAGS = ["--seq-len", "64", "--chunk", "16", "--cache-length", "32", "--policy", "sink", "--steps", "2",
         "--batch-size", "3", "--threads", "1"]


@GLOO
@pytest.mark.parametrize("how, both, sharded_only", [
    ("fsdp", [], ["--offload-kv"]),
    pytest.param("ddp", ["--lora-rank", "2", "--merge-lora"], [], marks=SLOW),
])
def test_torchrun_checkpoint_equals_one_process(text_file, tmp_path, capsys, how, both, sharded_only):
    """torchrun -m kvcache finetune --shard on 2 ranks (3 rows a step: 2 + 1) writes what one
    process writes: the same losses, a checkpoint with the same logits in kvcache and in
    transformers; only rank 0 speaks."""
    from transformers import AutoModelForCausalLM

    assert main(["finetune", "--data", str(text_file), *FLAGS, *both, "--out", str(tmp_path / "one"), "--quiet"]) == 0
    capsys.readouterr()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-port", str(free_port()), "-m", "kvcache", "finetune", "--data", str(text_file),
                           *FLAGS, *both, *sharded_only, "--out", str(tmp_path / "two"), "--shard", how,
                           "--dist-timeout", "60"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.count("wrote the checkpoint") == 1 and done.stderr.count("rows of 64 tokens") == 1
    losses = [[json.loads(line)["loss"] for line in (tmp_path / d / "loss.jsonl").read_text().splitlines()]
              for d in ("one", "two")]
    assert len(losses[0]) == 2 and losses[0] == pytest.approx(losses[1], rel=REL_TOL)
    assert json.loads((tmp_path / "two" / "training.json").read_text())["ranks"] == 2
    one, two = kvcache.load(tmp_path / "one"), kvcache.load(tmp_path / "two")
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "two")
    ids = token_ids(40, vocab=one.config.vocab_size).cpu()
    with torch.no_grad():
        # Two implementations of one computation (the ranks' gradients are summed in another
        # order, and AdamW divides each by its own magnitude): the tolerance between kvcache and
        # transformers, not the tighter one between a cached and a plain kvcache forward.
        assert max_diff(two(ids), one(ids)) < HF_ATOL[torch.float32]
        assert max_diff(theirs(ids).logits, two(ids)) < HF_ATOL[torch.float32]


@GLOO
def test_shard_needs_torchrun(text_file, tmp_path, capsys, monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    code = main(["finetune", "--data", str(text_file), *FLAGS, "--out", str(tmp_path / "o"), "--shard", "ddp"])
    err = capsys.readouterr().err
    assert code == 2 and "launch with torchrun --nproc-per-node N" in err, err
    assert not (tmp_path / "o").exists()


@GLOO
def test_a_missing_rank_times_out(text_file, tmp_path):
    """Rank 0 of 2 started alone: the group never forms, and the run fails after --dist-timeout
    with a message naming the rank and the address, not a hang."""
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    start = time.time()
    done = subprocess.run([sys.executable, "-m", "kvcache", "finetune", "--data", str(text_file), *FLAGS,
                           "--out", str(tmp_path / "o"), "--shard", "ddp", "--dist-timeout", "2"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert time.time() - start < 60
    assert done.returncode == 2 and "rank 0 of 2 could not join the process group" in done.stderr, done.stderr
