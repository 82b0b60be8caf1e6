"""expected_attention against an independent float64 computation of its scores on the first
layer, whose queries, keys and values follow from the weights and the tokens alone."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE, atol
from policy_util import ids_for, kept

import kvcache

VOCAB = 128


def rotation(inv_freq: torch.Tensor, p: int) -> torch.Tensor:
    """(D, D) float64 RoPE matrix at position p, pairing element i with i + D/2."""
    half = inv_freq.numel()
    R = torch.zeros(2 * half, 2 * half, dtype=torch.float64, device=DEVICE)
    for i, f in enumerate(inv_freq.double().tolist()):
        c, s = torch.cos(torch.tensor(f * p, device=DEVICE)), torch.sin(torch.tensor(f * p, device=DEVICE))
        R[i, i], R[i, i + half], R[i + half, i], R[i + half, i + half] = c, -s, s, c
    return R


def reference_keep(model, ids: torch.Tensor, C: int, sinks: int, future: int, covariance: bool,
                   value_norm: bool) -> list[list[int]]:
    """Positions the first layer keeps, per K/V head, for a prompt ``ids`` (1, T) fed at once."""
    cfg, attn = model.config, model.layers[0].self_attn
    T, D, Hq, Hkv = ids.shape[1], cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    with torch.no_grad():
        h = model.layers[0].input_layernorm(model.embed_tokens(ids))[0].double()
        q = (h @ attn.q_proj.weight.double().T).view(T, Hq, D)  # before RoPE
        k = (h @ attn.k_proj.weight.double().T).view(T, Hkv, D)
        v = (h @ attn.v_proj.weight.double().T).view(T, Hkv, D)
    k = torch.stack([rotation(model.inv_freq, p) @ k[p].T for p in range(T)]).transpose(1, 2)  # (T, Hkv, D)
    R = sum(rotation(model.inv_freq, p) for p in range(T, T + future)) / future
    G = Hq // Hkv
    keep = []
    for kv in range(Hkv):
        scores = torch.zeros(T - sinks, dtype=torch.float64, device=DEVICE)
        for g in range(G):
            qs = q[sinks:, kv * G + g]  # (n, D)
            mu = qs.mean(0)
            cov = (qs - mu).T @ (qs - mu) / qs.shape[0]
            mu, cov = R @ mu, R @ cov @ R.T
            keys = k[sinks:, kv]
            logits = keys @ mu / D**0.5
            if covariance:
                logits = logits + torch.einsum("nd,de,ne->n", keys, cov, keys) / (2 * D)
            scores += logits.softmax(0) / G
        if value_norm:
            scores = scores * v[sinks:, kv].norm(dim=-1)
        top = (scores.topk(C - sinks).indices + sinks).tolist()
        keep.append(sorted(list(range(sinks)) + top))
    return keep


@pytest.mark.parametrize("covariance,value_norm,sinks", [(True, True, 4), (False, True, 2), (True, False, 0)])
def test_a_prompt_keeps_what_future_queries_are_expected_to_attend(llama, covariance, value_norm, sinks):
    T, C, future = 40, 14, 16
    ids = ids_for(T, seed=21, vocab=VOCAB)
    cache = kvcache.make_cache(llama, "expected_attention", cache_length=C, options={"future": future, "sinks": sinks,
                                                                                  "covariance": covariance,
                                                                                  "value_norm": value_norm})
    with torch.inference_mode():
        llama(ids, cache)
    want = reference_keep(llama, ids, C, sinks, future, covariance, value_norm)
    assert kept(cache.layers[0], 0) == want


def test_statistics_do_not_depend_on_the_chunking(llama):
    """Query statistics are sums over every query seen: a prompt fed in chunks that fit the
    cache, then one that overflows it, keeps what the prompt fed at once keeps."""
    T, C = 40, 30
    ids = ids_for(T, seed=22, vocab=VOCAB)
    with torch.inference_mode():
        whole = kvcache.make_cache(llama, "expected_attention", cache_length=C, options={"future": 8})
        llama(ids, whole)
        chunked = kvcache.make_cache(llama, "expected_attention", cache_length=C, options={"future": 8})
        for lo, hi in ((0, 10), (10, 25), (25, 40)):
            llama(ids[:, lo:hi], chunked)
    assert kept(chunked.layers[0], 0) == kept(whole.layers[0], 0)


def test_reset_forgets_the_statistics(llama):
    ids = ids_for(30, seed=23, vocab=VOCAB)
    other = ids_for(30, seed=24, vocab=VOCAB)
    with torch.inference_mode():
        fresh = kvcache.make_cache(llama, "expected_attention", cache_length=12)
        llama(ids, fresh)
        reused = kvcache.make_cache(llama, "expected_attention", cache_length=12)
        llama(other, reused)
        reused.reset()
        llama(ids, reused)
    for a, b in zip(reused.layers, fresh.layers):
        assert kept(a, 0) == kept(b, 0)


def test_budget_covering_the_sequence_equals_the_forward(llama):
    ids = ids_for(24, batch=2, seed=25, vocab=VOCAB)
    with torch.inference_mode():
        cache = kvcache.make_cache(llama, "expected_attention", cache_length=24, batch_size=2)
        got = torch.cat([llama(ids[:, i : i + 7], cache) for i in range(0, 24, 7)], dim=1)
        assert (got - llama(ids)).abs().max().item() <= atol("cache")


def test_bad_options(llama):
    with pytest.raises(ValueError, match="future must be positive"):
        kvcache.make_cache(llama, "expected_attention", cache_length=8, options={"future": 0})
    with pytest.raises(ValueError, match=r"recent \+ sinks \(8\) must be smaller than cache_length \(8\)"):
        kvcache.make_cache(llama, "expected_attention", cache_length=8, options={"sinks": 4, "recent": 4})
    with pytest.raises(ValueError, match="option 'covariance' of policy 'expected_attention' must be bool"):
        kvcache.make_cache(llama, "expected_attention", cache_length=8, options={"covariance": 1})
