"""A prefix store directory under crashes and concurrent use: a writer killed at any moment of a
save leaves the old store or the new one, loadable, never a mix; two writers take turns (the
directory is locked while written); readers see one whole store; a writer that cannot get the
lock in time says so.

Processes are forked from the test process (torch is already imported, so a child starts in
milliseconds) and killed with SIGKILL, which nothing in the child can intercept.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch
from policy_util import build_tiny  # noqa: E402

import kvcache
from kvcache.generation.prefill import prefill
from kvcache.prefix.store import INDEX, LOCK, PrefixStore, PrefixStoreError, _locked

# A forked child cannot use CUDA once its parent has: the stores' models live on the CPU.
pytestmark = [pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork"),
              pytest.mark.cpu_only("forks writers, and a forked child cannot use CUDA")]

VOCAB = 64
KILLS = 50


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny(tmp_path_factory.mktemp("crash_model"), layers=2, vocab=VOCAB, device="cpu")


def _prompts(seed: int, n: int = 4) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, VOCAB, (24,), generator=g).tolist()
    return [shared + torch.randint(3, VOCAB, (8 + 4 * i,), generator=g).tolist() for i in range(n)]


def _store(model, seed: int) -> PrefixStore:
    store = PrefixStore(model)
    for prompt in _prompts(seed):
        cache = kvcache.make_cache(model, "dense", cache_length=64)
        with torch.inference_mode():
            prefill(model, cache, [prompt], chunk=16, store=store)
    return store


def _entries(path: Path) -> frozenset[str]:
    """What a saved store holds: its entries' content digests (each checked against its file by load)."""
    return frozenset(e["sha256"] for e in json.loads((path / INDEX).read_text())["entries"] if "file" in e)


@pytest.fixture(scope="module")
def stores(model, tmp_path_factory):
    """Two stores with different entries, and the digests each saves."""
    a, b = _store(model, 1), _store(model, 2)
    digests = []
    for store in (a, b):
        path = tmp_path_factory.mktemp("reference")
        store.save(path)
        digests.append(_entries(path))
    assert digests[0] != digests[1]
    return a, b, digests


def _fork(body) -> int:
    pid = os.fork()
    if pid == 0:  # the child: run, and leave without pytest's teardown
        code = 1
        try:
            body()
            code = 0
        finally:
            os._exit(code)
    return pid


def _kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)


def _load_is_one_of(model, path: Path, digests) -> None:
    loaded = PrefixStore.load(path, model)
    held = _entries(path)
    assert held in digests, "the directory holds a mix of two stores"
    assert len(loaded) == len(held)  # every entry the index names was loaded


def test_a_writer_killed_at_random_moments_leaves_a_whole_store(model, stores, tmp_path):
    a, b, digests = stores
    a.save(tmp_path)
    start = time.perf_counter()
    for _ in range(3):
        a.save(tmp_path)
        b.save(tmp_path)
    one_save = (time.perf_counter() - start) / 6
    rng = random.Random(0)
    moments, mid_write = [], 0
    for _ in range(KILLS):

        def save_forever():
            while True:
                a.save(tmp_path)
                b.save(tmp_path)

        pid = _fork(save_forever)
        moment = rng.uniform(0, 4 * one_save)
        time.sleep(moment)
        _kill(pid)
        moments.append(moment)
        mid_write += bool(list(tmp_path.glob(".*.tmp")))
        _load_is_one_of(model, tmp_path, digests)
    # Kills landed in the middle of writing a file (a temporary file was left) as well as between.
    assert mid_write > 0 and max(moments) > 2 * one_save
    # The next save clears what the killed writers left half written.
    b.save(tmp_path)
    assert not list(tmp_path.glob(".*.tmp"))
    assert {p.name for p in tmp_path.iterdir()} == {INDEX, LOCK} | {p.name for p in tmp_path.glob("entry-*")}
    assert _entries(tmp_path) == digests[1]
    assert len(list(tmp_path.glob("entry-*"))) == len(digests[1])


def test_two_writers_take_turns_and_readers_see_whole_stores(model, stores, tmp_path):
    a, b, digests = stores
    a.save(tmp_path)

    def writer(store):
        def body():
            for _ in range(15):
                store.save(tmp_path)
        return body

    running = {_fork(writer(a)), _fork(writer(b))}
    loads = 0
    while running:
        for pid in list(running):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                assert os.waitstatus_to_exitcode(status) == 0
                running.discard(pid)
        _load_is_one_of(model, tmp_path, digests)
        loads += 1
    assert loads > 0
    _load_is_one_of(model, tmp_path, digests)
    assert len(list(tmp_path.glob("entry-*"))) in (len(digests[0]), len(digests[1]))


def test_a_writer_that_cannot_get_the_lock_says_so(model, stores, tmp_path):
    a, b, digests = stores
    a.save(tmp_path)
    ready_r, ready_w = os.pipe()

    def hold_the_lock():
        with _locked(tmp_path, exclusive=True, timeout=1):
            os.write(ready_w, b"x")
            time.sleep(60)

    pid = _fork(hold_the_lock)
    try:
        assert os.read(ready_r, 1) == b"x"
        with pytest.raises(PrefixStoreError, match="another process is using the prefix store in .*waited 0.2 s"):
            b.save(tmp_path, timeout=0.2)
        with pytest.raises(PrefixStoreError, match="another process is writing the prefix store"):
            PrefixStore.load(tmp_path, model, timeout=0.2)
        assert _entries(tmp_path) == digests[0]  # the refused save wrote nothing
    finally:
        _kill(pid)
    # A writer that waits gets the lock once the holder is gone.
    b.save(tmp_path, timeout=5)
    assert _entries(tmp_path) == digests[1]
    _load_is_one_of(model, tmp_path, digests)
