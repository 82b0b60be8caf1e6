"""Every kvcache policy inside a transformers model equals the same policy in kvcache's own model.

The transformers ``LlamaForCausalLM`` and ``kvcache.load`` read the same saved checkpoint. Fed
the same chunks (a prompt in three chunks, then one-token steps), every registered policy (a
new one joins by being registered) must keep the same tokens in the same slots, per layer, row
and head, and give logits within conftest's HF_ATOL (fp32 1e-4: the two models order their
floating-point operations differently). A budget covering the whole sequence must equal dense,
and a left-padded ragged batch must give each row what kvcache's own ragged batch gives it, and
what the row gets alone.
"""

from __future__ import annotations

import pytest
import torch
from conftest import CACHE_ATOL, DEVICE, max_diff, random_ids
from hf_models import feed_both, greedy, left_pad, make

import kvcache
import kvcache.hf

POLICIES = sorted(kvcache.policies())
# Storage composes with every policy; one quantized variant of each kind of eviction.
WITH_STORAGE = ["h2o:kivi4", "sink:int8"]  # KIVI named outright: a cache this small holds "int4" at full precision
BUDGET = 12
SCHEDULE = [12, 9, 9] + [1] * 10  # tokens per call: a 30-token prompt in chunks, then decode steps


@pytest.fixture(scope="module")
def models(checkpoint_factory, model_factory):
    """(transformers model, kvcache model) with the same weights, read from one checkpoint."""
    from transformers import AutoModelForCausalLM

    path = checkpoint_factory("llama").path
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(DEVICE).eval()
    return hf, model_factory("llama")


def _budget(policy: str) -> int:
    # dense keeps every token and must hold them all.
    return sum(SCHEDULE) if policy.startswith("dense") else BUDGET


def _options(policy: str, cache_length: int) -> dict:
    return kvcache.cache.budget_options(policy, cache_length)


@pytest.mark.parametrize("policy", POLICIES + WITH_STORAGE)
def test_policy_equals_kvcache_model(models, policy):
    hf, native = models
    C = _budget(policy)
    ours = make(hf, policy, C)
    theirs = kvcache.make_cache(native, policy, cache_length=C, options=_options(policy, C))
    start = feed_both(hf, native, ours, theirs, random_ids(sum(SCHEDULE), seed=20), SCHEDULE, policy)
    assert ours.get_seq_length() == start == int(ours.lengths[0])


@pytest.mark.parametrize("policy", [p for p in POLICIES if p != "dense"])
def test_budget_covering_the_sequence_equals_dense(models, policy):
    hf, _ = models
    ids = random_ids(24, seed=21)
    want_ids, want_logits = greedy(hf, ids, 16, kvcache.hf.make_cache(hf, "dense", cache_length=40))
    got_ids, got_logits = greedy(hf, ids, 16, make(hf, policy, 40))
    assert torch.equal(got_ids, want_ids)
    assert max_diff(got_logits, want_logits) <= CACHE_ATOL[torch.float32]


@pytest.mark.parametrize("policy", POLICIES)
def test_ragged_batch_equals_kvcache_batch_and_rows_alone(models, policy):
    hf, native = models
    rows = [random_ids(20, seed=22)[0].tolist(), random_ids(13, seed=23)[0].tolist()]
    new = 12
    C = 20 + new if policy == "dense" else BUDGET
    ids, mask = left_pad(rows)
    cache = make(hf, policy, C, batch_size=2)
    got, _ = greedy(hf, ids, new, cache, attention_mask=mask)
    got = got[:, ids.shape[1]:].tolist()
    want = kvcache.generate(native, rows, max_new_tokens=new, stop_tokens=(), prefill_chunk=None,
                            cache=kvcache.make_cache(native, policy, cache_length=C, batch_size=2, options=_options(policy, C)))
    assert got == want
    for b, row in enumerate(rows):
        alone, _ = greedy(hf, torch.tensor([row], device=DEVICE), new, make(hf, policy, C))
        assert alone[0, len(row):].tolist() == got[b]
