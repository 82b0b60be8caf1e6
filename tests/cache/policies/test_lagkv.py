"""lagkv: partitions scored against the next partition's range, checked against a direct
transcription of the rule on the keys and values a dense cache holds."""

from __future__ import annotations

import torch
from conftest import DEVICE
from policy_util import kept

import kvcache
from kvcache.cache.policies.lagkv import lag_scores


def reference(k: torch.Tensor, v: torch.Tensor, sinks: int, lag: int) -> torch.Tensor:
    """(H, n) scores, one partition at a time."""
    H, n, _ = k.shape
    end = sinks + ((n - sinks) // lag) * lag
    out = torch.ones(H, n, device=DEVICE)
    for start in range(sinks, end - lag, lag):
        parts = []
        for x in (k, v):
            own, ref = x[:, start : start + lag], x[:, start + lag : start + 2 * lag]
            low, high = ref.amin(1, keepdim=True), ref.amax(1, keepdim=True)
            parts.append(((own - low) / (high - low)).std(dim=-1).softmax(dim=-1))
        mean = (parts[0] + parts[1]) / 2
        out[:, start : start + lag] = mean.argsort(-1).argsort(-1).float() / lag
    return out


def test_scores_follow_the_rule():
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 3, 77, 8, generator=g).to(DEVICE)
    assert torch.equal(lag_scores(k, v, sinks=4, lag=16), reference(k, v, 4, 16))
    short = lag_scores(k[:, :30], v[:, :30], sinks=4, lag=16)  # fewer than sinks + 2 * lag
    assert torch.equal(short[:, :4], torch.ones(3, 4, device=DEVICE)) and bool((short[:, 5:] > short[:, 4:-1]).all())


def test_a_prompt_keeps_sinks_tail_and_the_top_ranks(llama):
    T, C, sinks, lag = 60, 30, 2, 8
    ids = torch.arange(3, 3 + T, device=DEVICE)[None]
    with torch.inference_mode():
        dense = kvcache.make_cache(llama, "dense", cache_length=T)
        llama(ids, dense)
        cache = kvcache.make_cache(llama, "lagkv", cache_length=C, options={"sinks": sinks, "lag": lag})
        llama(ids, cache)
    end = sinks + ((T - sinks) // lag) * lag
    tail = set(range(end - lag, T))
    for layer, d in zip(cache.layers, dense.layers):
        k, v = d.storage.k[0, :, :T].float(), d.storage.v[0, :, :T].float()
        score = reference(k, v, sinks, lag)
        for h, held in enumerate(kept(layer, 0)):
            assert set(range(sinks)) | tail <= set(held)
            mid = [p for p in held if p not in tail and p >= sinks]
            dropped = [p for p in range(sinks, end - lag) if p not in held]
            assert min(score[h, mid]) >= max(score[h, dropped])  # the kept ranks are the highest
