"""qh2o (quantization-aware H2O): H2O's score against each token's quantization error."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE
from policy_util import EXACT_ATOL, build_tiny, ids_for, kept, max_diff

import kvcache
from kvcache.cache import CacheSpec, KVCache
from kvcache.cache.policies.qh2o import QH2OCache, QH2OOptions

ATOL = EXACT_ATOL[torch.float32]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny(tmp_path_factory.mktemp("qh2o_tiny"), layers=2, max_positions=4096, seed=5)


@pytest.mark.parametrize("scale", ["minmax", "rank"])
@pytest.mark.parametrize("storage", ["", ":kivi4"])
def test_weight_one_is_h2o(tiny, storage, scale):
    """With all the weight on the H2O score, qh2o keeps what h2o keeps and computes the same
    (either scale is monotone in the score)."""
    ids = ids_for(70, seed=4, vocab=tiny.config.vocab_size)
    schedule = [24] + [1] * 30 + [9] + [1] * 7
    caches = {name: kvcache.make_cache(tiny, name + storage, cache_length=12, options={"recent": 3, **extra})
              for name, extra in (("h2o", {}), ("qh2o", {"weight": 1.0, "scale": scale}))}
    logits = {}
    with torch.inference_mode():
        for name, cache in caches.items():
            done, out = 0, []
            for n in schedule:
                out.append(tiny(ids[:, done : done + n], cache))
                done += n
            logits[name] = torch.cat(out, dim=1)
    for a, b in zip(caches["h2o"].layers, caches["qh2o"].layers):
        assert kept(a, 0) == kept(b, 0)
    assert max_diff(logits["h2o"], logits["qh2o"]) <= ATOL


@pytest.mark.parametrize("scale", ["minmax", "rank"])
def test_weight_zero_keeps_the_tokens_that_quantize_best(scale):
    """Constant vectors quantize without error; with the weight on the error alone, every one
    of them outranks every random one, and the recent tokens stay whatever their error."""
    H, D, C = 2, 16, 8
    spec = CacheSpec(batch_size=1, num_kv_heads=H, head_dim=D, cache_length=C, dtype=torch.float32,
                     device=DEVICE)
    layer = QH2OCache(spec, QH2OOptions(recent=2, weight=0.0, bits=2, scale=scale))
    cache = KVCache([layer], spec, "qh2o")
    gen = torch.Generator().manual_seed(0)
    T = 12
    k = torch.randn(1, H, T, D, generator=gen).to(DEVICE)
    v = torch.randn(1, H, T, D, generator=gen).to(DEVICE)
    easy = [0, 2, 4, 6, 8]
    k[:, :, easy] = torch.randn(1, H, len(easy), 1, generator=gen).to(DEVICE).expand(-1, -1, -1, D)
    v[:, :, easy] = 0.5
    step = cache.begin(torch.zeros(1, T, dtype=torch.long, device=DEVICE), None)
    with torch.inference_mode():
        layer.attend(torch.randn(1, 2 * H, T, D, generator=gen).to(DEVICE), k, v, step)
    cache.commit(step)
    for held in kept(layer, 0):
        assert set(easy) | {10, 11} <= set(held)
        assert len(set(held) - set(easy) - {10, 11}) == 1  # the random token with the smallest error


def test_error_is_measured_before_quantization(tiny):
    """Over a quantized storage the error is the model's keys and values against their codes, not
    the stored codes against themselves (which would be zero)."""
    cache = kvcache.make_cache(tiny, "qh2o:kivi4", cache_length=16, options={"recent": 4})
    with torch.inference_mode():
        tiny(ids_for(40, seed=2, vocab=tiny.config.vocab_size), cache)
    for layer in cache.layers:
        held = layer.storage.pos[:, :, :16] >= 0
        assert bool((layer.stats["error"][..., :16][held] > 0).all())


def test_rank_scale_spreads_a_heavy_tailed_score():
    """Min-max leaves every candidate but the heaviest near 0 when one score dwarfs the rest, so
    the error decides among them; ranks spread them over [0, 1] in the score's order."""
    spec = CacheSpec(batch_size=1, num_kv_heads=1, head_dim=16, cache_length=8, dtype=torch.float32, device=DEVICE)
    score = torch.tensor([[[1000.0, 1.0, 2.0, 3.0, 4.0, 0.5]]], device=DEVICE)
    ranked = torch.tensor([[[True, True, True, True, True, False]]], device=DEVICE)
    from kvcache.cache.policies import qh2o

    mm, rk = qh2o._minmax(score, ranked), qh2o._rank(score, ranked)
    assert float(mm[0, 0, 1:5].max()) < 0.01
    assert torch.allclose(rk[0, 0], torch.tensor([1.0, 0.0, 0.25, 0.5, 0.75, 0.0], device=DEVICE))
    assert QH2OCache(spec, QH2OOptions(recent=2, scale="rank")).options.scale == "rank"


@pytest.mark.parametrize("options,message", [({"weight": 1.5}, "weight must lie in"), ({"bits": 6}, "bits"),
                                             ({"scale": "log"}, "minmax, rank")])
def test_bad_options(tiny, options, message):
    with pytest.raises(ValueError, match=message):
        kvcache.make_cache(tiny, "qh2o", cache_length=16, options=options)
