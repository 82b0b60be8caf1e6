"""kvcache's policies inside transformers' own hybrid models (Gemma 3, sliding-window Qwen2, Gemma 2
with its soft caps, gpt-oss with its sink logits):
the sliding layers hold a ring of their window, the policy bounds the global layers, and every
step equals kvcache's own model with the same policy (the same kept positions in every layer)."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE, WINDOW, random_ids
from hf_models import feed_both, make

import kvcache
import kvcache.hf

SCHEDULE = [12, 9, 9] + [1] * 10  # a 30-token prompt in chunks, then decode steps
BUDGET = 12


@pytest.fixture(scope="module", params=["gemma3", "qwen2_window", "gemma2", "gpt_oss"])
def models(request, checkpoint_factory, model_factory):
    from transformers import AutoModelForCausalLM

    path = checkpoint_factory(request.param).path
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(DEVICE).eval()
    return hf, model_factory(request.param)


@pytest.mark.parametrize("policy", ["dense", "h2o", "tova", "snapkv", "sink", "window"])
def test_policy_on_the_global_layers_equals_kvcache_model(models, policy):
    hf, native = models
    C = sum(SCHEDULE) if policy == "dense" else BUDGET
    ours = make(hf, policy, C)
    theirs = kvcache.make_cache(native, policy, cache_length=C, options=kvcache.cache.budget_options(policy, C))
    sliding = [layer.sliding for layer in native.config.layers]
    assert [layer.spec.cache_length for layer in ours.kv.layers] == [WINDOW if s else C for s in sliding]
    feed_both(hf, native, ours, theirs, random_ids(sum(SCHEDULE), seed=22), SCHEDULE, policy)


def test_each_kind_of_layer_rotates_with_its_own_frequencies(models):
    """Gemma 3's rotary module keeps one set of frequencies per kind of layer: a policy that
    rotates (renumbered sinks) gets each layer's own."""
    hf, native = models
    cache = kvcache.hf.make_cache(hf, "sink", cache_length=BUDGET, options={"sinks": 2, "positions": "renumbered"})
    for i, layer in enumerate(cache.kv.layers):
        assert torch.allclose(layer.spec.inv_freq, native.rotary(i)), f"layer {i}"
