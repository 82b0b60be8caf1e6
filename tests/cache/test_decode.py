"""The one decode path: a decode step described by device tensors alone (the captured step's
``Step.captured_decode``, run here without compiling it) computes what the eager step computes,
for every policy and storage. The eager step differs only by the host facts it carries, which
narrow the slots attended; the kept tokens must not depend on them."""

from __future__ import annotations

import pytest
import torch
from conftest import atol, max_diff, random_ids

import kvcache
from kvcache.cache import Step
from kvcache.cache.registry import budget_options

PROMPTS = [10, 7]  # a ragged batch: rows at different positions, the second row not yet full
STEPS = 10
# KIVI named outright at 4 and 2 bits: on caches this small "int4" and "int2" hold full precision.
CASES = [(p, s) for p in kvcache.policies() for s in ("full", "int8", "kivi4", "kivi2")]


def _kept(cache) -> list:
    """Sorted positions each leaf layer cache holds in slots [0, C), per row and slot group."""
    out = []
    for layer in cache.layers:
        for leaf in getattr(layer, "heads", [layer]):
            pos = leaf.storage.pos[:, :, : leaf.spec.cache_length]
            out.append([[sorted(p[p >= 0].tolist()) for p in row] for row in pos])
    return out


def _decode(model, name: str, options: dict, C: int, known: bool):
    """Prefill the ragged batch, then STEPS decode steps, eager (``known``: the step of
    ``KVCache.begin``) or with no host facts: logits (STEPS, B, vocab) and kept positions."""
    ids = random_ids(max(PROMPTS) + STEPS, batch=len(PROMPTS), seed=11)
    cache = kvcache.make_cache(model, name, cache_length=C, batch_size=len(PROMPTS), options=options)
    logits, kept = [], []
    with torch.inference_mode():
        model(ids[:, : max(PROMPTS)], cache, n_tokens=PROMPTS)
        for i in range(STEPS):
            tokens = ids[:, max(PROMPTS) + i :][:, :1]
            if known:
                logits.append(model(tokens, cache)[:, -1])
            else:
                positions = cache.lengths[:, None].to(tokens.device)
                logits.append(model.run(tokens, positions, cache, Step.captured_decode(positions))[:, -1])
                cache.advance_decode()
            kept.append(_kept(cache))
    return torch.stack(logits), kept


@pytest.mark.parametrize("policy,storage", CASES, ids=[f"{p}:{s}" for p, s in CASES])
@pytest.mark.parametrize("C", [9, 16], ids=["full", "filling"])
def test_a_step_without_host_facts_computes_the_eager_step(llama, policy, storage, C):
    """C 9: every step evicts in the first row; C 16: rows fill during the steps, so the eager
    step knows for a while that every row has room (dense always has 24 slots)."""
    name = policy if storage == "full" else f"{policy}:{storage}"
    C = 24 if policy == "dense" else C
    options = {} if policy == "dense" else budget_options(policy, C)
    want, want_kept = _decode(llama, name, options, C, known=True)
    got, got_kept = _decode(llama, name, options, C, known=False)
    assert got_kept == want_kept
    if storage == "full":
        assert max_diff(got, want) <= atol("cache")
    else:
        # Codes are computed from keys that may differ in the last bit between the two steps
        # (different shapes, different reduction orders): bounded by the storage's own error.
        full, _ = _decode(llama, policy, options, C, known=True)
        assert max_diff(got, want) <= max(atol("cache"), max_diff(want, full))
