"""A quantized cache never holds more bytes than full precision at the same cache_length: the
``int<bits>`` storages hold full precision where their codes (with scales, and KIVI's
full-precision residual) would take more, and say so (``stored_as``, the generate summary,
``kvcache policies``). Compared with every slot allocated (``allocated``): a dense cache
allocates its slots as it fills."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import DEVICE, random_ids

import kvcache
from kvcache.cache.registry import break_even, stored_as
from kvcache.cli import main
from kvcache.runtime.memory import human

LENGTHS = (8, 32, 128, 512, 4096)
FLOORS = ("h2o:int4", "dense:int4", "h2o:int2", "dense:int8")


def allocated(cache: kvcache.KVCache) -> kvcache.KVCache:
    """``cache`` with every slot allocated (a dense cache's, which it would allocate as it fills)."""
    cache.allocate()
    return cache


@pytest.fixture(scope="module")
def bundled():
    # float32 on every device: the bounds below are against float32's bytes (on CUDA load's
    # default is bfloat16, against which int8 codes with their scales are 0.57x, not under 0.4x).
    return kvcache.load(device=DEVICE, dtype=torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("batch", [1, 3])
def test_quantized_bytes_never_exceed_full_precision(bundled, llama, dtype, batch):
    for model in (bundled, llama):
        # A copy: the session's models must keep their float32 weights.
        model = copy.deepcopy(model).to(dtype) if dtype != torch.float32 else model
        for name in FLOORS:
            policy, _, _ = name.partition(":")
            for length in LENGTHS:
                full = allocated(kvcache.make_cache(model, policy, cache_length=length, batch_size=batch)).nbytes()
                quantized = allocated(kvcache.make_cache(model, name, cache_length=length, batch_size=batch))
                assert quantized.nbytes() <= full, (model.config.head_dim, dtype, batch, name, length)


@pytest.mark.parametrize("name", FLOORS)
def test_a_large_cache_holds_codes(bundled, name):
    """The fallback is for small caches only: at 4096 slots the codes are held, at well under
    full precision's bytes."""
    policy = name.partition(":")[0]
    cache = allocated(kvcache.make_cache(bundled, name, cache_length=4096))
    assert stored_as(cache) is None and cache.spec.storage == name.partition(":")[2]
    assert cache.nbytes() < 0.4 * allocated(kvcache.make_cache(bundled, policy, cache_length=4096)).nbytes()


@pytest.mark.parametrize("name", ["h2o:int4", "dense:int2", "sink:int4"])
def test_the_switch_is_at_the_break_even_length(bundled, name):
    """``break_even`` is the smallest length that holds codes: one slot fewer holds full precision
    (and says so), and there the codes would have taken more bytes than it."""
    n = break_even(bundled, name)
    assert n is not None and n > 8
    below = allocated(kvcache.make_cache(bundled, name, cache_length=n - 1))
    at = kvcache.make_cache(bundled, name, cache_length=n)
    assert stored_as(below) == "full" and below.spec.storage == "full"
    assert stored_as(at) is None
    named_layout = name.replace(":int", ":kivi")  # a layout named outright is built as named
    assert allocated(kvcache.make_cache(bundled, named_layout, cache_length=n - 1)).nbytes() > below.nbytes()
    assert break_even(bundled, "h2o:int8") == 1 and break_even(bundled, "h2o:kivi4") is None


def test_a_cache_held_at_full_precision_computes_what_full_precision_does(llama):
    ids = random_ids(20, seed=5)
    logits = {}
    for name in ("h2o", "h2o:int4"):
        cache = kvcache.make_cache(llama, name, cache_length=12, options={"recent": 4})
        with torch.inference_mode():
            logits[name] = torch.cat([llama(ids[:, i : i + 5], cache) for i in range(0, 20, 5)], dim=1)
        if name == "h2o:int4":
            assert stored_as(cache) == "full"
    assert torch.equal(logits["h2o"], logits["h2o:int4"])


@pytest.mark.cpu_only("the command line loads its model on the CPU by default")
def test_generate_summary_and_policies_say_so(capsys):
    assert main(["generate", "It is a truth", "--policy", "h2o:int4", "--cache-length", "32",
                 "--max-new-tokens", "4"]) == 0
    err = capsys.readouterr().err
    assert "(h2o:int4 held at full precision: fewer bytes than its codes at 32 slots" in err
    cpu = kvcache.load()  # what the command line loads: the bundled model on the CPU, float32
    full = kvcache.make_cache(cpu, "h2o", cache_length=32, options={"recent": 16})
    assert f"cache memory: {human(full.nbytes())} (h2o:int4 held" in err
    assert main(["generate", "It is a truth", "--policy", "h2o:int4", "--cache-length", "256",
                 "--max-new-tokens", "4"]) == 0
    assert "(h2o:int4, 256 slots)" in capsys.readouterr().err
    assert main(["policies"]) == 0
    out = capsys.readouterr().out
    assert "never hold more bytes than full precision" in out
    assert f"below {break_even(cpu, 'dense:int4')} slots at int4" in out
    assert "never at int8" in out
