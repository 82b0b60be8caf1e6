"""A long prompt prefilled in chunks stays within a memory bound that a T x T mask would break.

The measurement runs in a fresh subprocess so that its peak RSS (``ru_maxrss``) reflects only this
workload: the peak is taken after the model is loaded and the kernels warmed up, then again after
16k tokens went through the dense cache 2048 at a time.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

T = 16384
# Two attention query blocks (QUERY_BLOCK = 1024) per call: the bound also covers the block loop.
CHUNK = 2048
MIB = 2**20
# Extra memory allowed beyond the cache's own buffers: per-chunk activations, a (chunk x T) mask
# block and attention scratch. A single fp32 T x T mask is 1 GiB.
SLACK = 256 * MIB

SCRIPT = r"""
import json, resource, sys
import torch
import kvcache

torch.set_num_threads(1)
T, CHUNK = int(sys.argv[2]), int(sys.argv[3])
model = kvcache.load(sys.argv[1])
ids = torch.randint(3, model.config.vocab_size, (1, T), generator=torch.Generator().manual_seed(0))

def rss():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux

with torch.inference_mode():
    # Warm up kernels and the allocator on a short run, so one-off costs are not counted.
    warm = kvcache.make_cache(model, cache_length=2 * CHUNK)
    model(ids[:, :CHUNK], warm)
    model(ids[:, CHUNK : 2 * CHUNK], warm)
    del warm
    before = rss()
    cache = kvcache.make_cache(model, cache_length=T)
    for start in range(0, T, CHUNK):
        last = model(ids[:, start : start + CHUNK], cache, last_only=True)
    after = rss()
    lengths = cache.lengths.tolist()
    cache_bytes = cache.nbytes()
    del cache
    # The plain forward (fused causal kernel, no mask) of the same 16k tokens, for exactness.
    full = model(ids, last_only=True)
print(json.dumps({
    "before": before, "after": after, "cache_bytes": cache_bytes, "lengths": lengths,
    "diff": (last - full).abs().max().item(), "scale": full.abs().max().item(),
}))
"""


@pytest.mark.cpu_only("measures the resident set of a CPU process")
def test_chunked_long_prefill_memory_is_bounded(checkpoint_factory):
    ckpt = checkpoint_factory("llama_long")
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(ckpt.path), str(T), str(CHUNK)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["lengths"] == [T]

    growth = r["after"] - r["before"]
    mask_bytes = T * T * 4  # one fp32 T x T mask
    bound = r["cache_bytes"] + SLACK
    assert bound < mask_bytes / 2
    assert growth < bound, (
        f"peak RSS grew by {growth / MIB:.0f} MiB while prefilling {T} tokens in chunks of {CHUNK}; "
        f"the cache needs {r['cache_bytes'] / MIB:.1f} MiB, the bound is {bound / MIB:.0f} MiB "
        f"and a {T}x{T} fp32 mask alone would take {mask_bytes / MIB:.0f} MiB"
    )
    # The chunked prefill is also exact at this length (last-token logits vs the plain forward).
    assert r["scale"] > 0.5
    assert r["diff"] <= 1e-4, r


def test_cache_bytes_match_geometry(llama):
    import kvcache
    from kvcache.cache.policies.dense import FIRST_SLOTS
    from kvcache.cache.positions import position_dtype

    cfg = llama.config
    cache = kvcache.make_cache(llama, cache_length=T)
    # Keys and values at float32, and each slot's position in the narrowest type holding T positions.
    position = torch.tensor([], dtype=position_dtype(T)).element_size()
    per_slot = 2 * cfg.num_kv_heads * cfg.head_dim * 4 + position
    # A dense cache allocates its first slots when made, the others as it fills (or when asked).
    assert cache.nbytes() == cfg.num_layers * (FIRST_SLOTS + 1) * per_slot
    cache.allocate()
    assert cache.nbytes() == cfg.num_layers * (T + 1) * per_slot
    assert cache.nbytes() < 16 * MIB
    assert cache.layers[0].storage.k.dtype == torch.float32
