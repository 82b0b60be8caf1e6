"""The Triton decode kernel (kvcache/kernels/triton_decode.py) against the blocked path: every
layout and key mode, masks shared by heads and per head, attention mass, several splits of the
slots, and h2o decode steps through a model. On the test device: with KVCACHE_TEST_DEVICE=cuda
the compiled kernel runs on CUDA tensors; on the CPU, Triton's interpreter runs it on CPU tensors.
Skipped where Triton is not installed (it is not a dependency; kvcache uses it on CUDA when
present)."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE, atol

# On the CPU, tests/conftest.py has set TRITON_INTERPRET before anything imported triton.
pytest.importorskip("triton")

from test_blocked import filled  # noqa: E402

import kvcache  # noqa: E402
from kvcache import kernels  # noqa: E402
from kvcache.kernels import blocked, triton_decode  # noqa: E402

ATOL = 1e-5


@pytest.fixture(autouse=True)
def small_splits(monkeypatch):
    """Blocks of 16 slots and splits of 16, so that 25 slots take two splits of one or two blocks."""
    monkeypatch.setattr(triton_decode, "BLOCK_S", 16)
    monkeypatch.setattr(triton_decode, "SLOTS_PER_SPLIT", 16)


# KIVI groups of 4 and 8 slots span several groups a block; of 16, one group a block (its channel
# scales loaded once), the block past the last complete group holding no CHANNEL key.
@pytest.mark.parametrize("name", ["token8", "token4/4", "token2", "kivi4/4", "kivi2/8", "kivi8/4", "kivi4/16", "kivi2/16"])
@pytest.mark.parametrize("per_head", [False, True])
def test_triton_decode_matches_the_blocked_path(name, per_head):
    store = filled(name, per_head=per_head, device=DEVICE)
    k, v, pos = store.view(25)
    q = torch.randn(2, 4, 1, 16, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    assert triton_decode.supported(q, k, v)
    for visible in (None, pos >= 0):
        for mass in (False, True):
            want = blocked.decode(q, k, v, visible, want_mass=mass)
            got = triton_decode.decode(q, k, v, visible, want_mass=mass)
            assert (got[0] - want[0]).abs().max() <= ATOL
            if mass:
                assert (got[1] - want[1]).abs().max() <= ATOL


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_query_takes_tf32_dots_within_its_own_rounding(dtype):
    """A bfloat16 or float16 query's dots run in tf32 on CUDA: the output and the mass stay within
    the dtype's own precision of the float32 blocked path. (Triton's interpreter computes the
    dots in float32 whatever the precision, so on the CPU this checks the half-precision
    query's way through the kernel, not tf32's rounding.)"""
    store = filled("token8", device=DEVICE)
    k, v, pos = store.view(25)
    q = torch.randn(2, 4, 1, 16, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    want = blocked.decode(q.to(dtype).float(), k, v, pos >= 0, want_mass=True)
    got = triton_decode.decode(q.to(dtype), k, v, pos >= 0, want_mass=True)
    assert got[0].dtype == dtype
    assert (got[0].float() - want[0]).abs().max() <= atol("precision", dtype)
    assert (got[1] - want[1]).abs().max() <= atol("precision", dtype)


@pytest.mark.parametrize("name", ["token8", "token4/4", "kivi4/4", "kivi2/16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_default_blocks_of_each_dot_precision(name, dtype, monkeypatch):
    """Slots a block as each precision's default sets them (BY_PRECISION, 32 or 64) where splits
    of 16 slots are asked for: each split rounds up to whole blocks, and the splits that then
    start past the last slot add nothing."""
    monkeypatch.setattr(triton_decode, "BLOCK_S", None)
    store = filled(name, device=DEVICE)
    k, v, pos = store.view(25)
    q = torch.randn(2, 4, 1, 16, generator=torch.Generator().manual_seed(3)).to(DEVICE).to(dtype)
    want = blocked.decode(q.float(), k, v, pos >= 0, want_mass=True)
    got = triton_decode.decode(q, k, v, pos >= 0, want_mass=True)
    tol = ATOL if dtype == torch.float32 else atol("precision", dtype)
    assert (got[0].float() - want[0]).abs().max() <= tol
    assert (got[1] - want[1]).abs().max() <= tol


def test_h2o_decode_steps_through_the_kernel(llama, monkeypatch):
    """h2o:int4 ranks by the mass the kernel returns: the same kept tokens and logits as the
    blocked path, step after step."""
    calls = []

    def through_triton(q, k, v, visible, *, q_sink=None, sink_slots=0, want_mass=False):
        assert q_sink is None and triton_decode.supported(q, k, v)
        calls.append(want_mass)
        return triton_decode.decode(q, k, v, visible, want_mass=want_mass)

    ids = torch.randint(3, 128, (2, 30), generator=torch.Generator().manual_seed(6)).to(DEVICE)

    def run():
        cache = kvcache.make_cache(llama, "h2o:int4/4", cache_length=12, batch_size=2, options={"recent": 3})
        with torch.inference_mode():
            logits = [llama(ids[:, :16], cache)] + [llama(ids[:, t : t + 1], cache) for t in range(16, 30)]
        return torch.cat(logits, 1), [layer.storage.pos.clone() for layer in cache.layers]

    want, want_pos = run()
    monkeypatch.setattr(kernels, "decode", through_triton)
    got, got_pos = run()
    assert calls and all(calls)
    assert (got - want).abs().max() <= 1e-4
    assert all(torch.equal(a, b) for a, b in zip(got_pos, want_pos))


def test_the_blocked_path_takes_what_the_kernel_does_not():
    store = filled("kivi4/4")
    k, v, _ = store.view(25)
    zeros = lambda *shape: torch.zeros(*shape, device=DEVICE)  # noqa: E731
    assert not triton_decode.supported(zeros(2, 4, 1, 16), k.with_tail(zeros(2, 2, 3, 16)), v)
    store12 = filled("token4", D=12)
    k12, v12, _ = store12.view(25)
    assert not triton_decode.supported(zeros(2, 4, 1, 12), k12, v12)


@pytest.mark.parametrize("name", [s for s in kvcache.storages() if s != "full"])
def test_a_storage_says_when_cuda_decode_takes_the_blocked_kernel(name):
    """The listing of storages names the blocked kernel exactly where the Triton kernel refuses
    the storage's views (the split widths, sinks, rotated codes)."""
    from kvcache.cache.storages import STORAGES, parse_storage

    kind = parse_storage(name)
    store = filled(f"{kind.layout}{kind.bits}")
    k, v, _ = store.view(25)
    q = torch.zeros(2, 4, 1, 16, device=DEVICE)
    assert ("takes the blocked kernel" in STORAGES[name]) == (not triton_decode.supported(q, k, v))
