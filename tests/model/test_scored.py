"""Families whose attention scores are not a plain softmax (model/scores.py): Gemma 2 soft-caps
scores and logits; gpt-oss adds a learned sink logit per query head (and routes its MLP through
experts, with YaRN rotary). Both are hybrid, so tests/model/test_hybrid.py's family tests run them too
(one pass, chunks across the window, ragged rows, greedy decoding, chunked loss); here: the rule
itself matters and reaches every cache path, policies, the captured step, gradients against
transformers', and what is refused."""

from __future__ import annotations

import pytest
import torch
from conftest import CACHE_ATOL, HF_ATOL, SCORED, atol, max_diff, random_ids

import kvcache
from kvcache.generation.compiled import CompiledDecode

ATOL = CACHE_ATOL[torch.float32]
T = 48  # the tiny models' window is 8: six windows
POLICIES = ["h2o", "sink", "snapkv", "tova"]


def feed(model, ids, cache, chunk):
    return torch.cat([model(ids[:, i:i + chunk], cache) for i in range(0, ids.shape[1], chunk)], dim=1)


def test_every_layer_cache_carries_the_family_rule(model_factory):
    gemma2, gpt_oss = model_factory("gemma2"), model_factory("gpt_oss")
    for layer in kvcache.make_cache(gemma2, "h2o", cache_length=16).layers:
        assert layer.spec.scores.softcap == 1.5 and layer.spec.scores.sink_logits is None
    for i, layer in enumerate(kvcache.make_cache(gpt_oss, "h2o", cache_length=16).layers):
        assert layer.spec.scores.softcap is None
        assert layer.spec.scores.sink_logits is gpt_oss.layers[i].self_attn.sinks


@pytest.mark.parametrize("family", SCORED)
def test_without_the_rule_the_logits_leave_transformers(checkpoint_factory, model_factory, family):
    """The rule is what makes the model match: dropping it moves the logits far past the tolerance
    (so the comparisons with transformers elsewhere test it)."""
    model = model_factory(family)
    ids = random_ids(T, seed=1)
    with torch.inference_mode():
        ref = checkpoint_factory(family).hf(ids).logits
        assert max_diff(model(ids), ref) <= HF_ATOL[torch.float32]
        attn = [layer.self_attn for layer in model.layers]
        saved = [(a.softcap, None if a.sinks is None else a.sinks.clone()) for a in attn]
        try:
            for a in attn:
                a.softcap = None
                if a.sinks is not None:
                    a.sinks.fill_(-1e4)  # a sink column of weight 0: plain softmax
            assert max_diff(model(ids), ref) > 100 * HF_ATOL[torch.float32]
        finally:
            for a, (cap, sinks) in zip(attn, saved):
                a.softcap = cap
                if sinks is not None:
                    a.sinks.copy_(sinks)


@pytest.mark.parametrize("policy", ["dense", *POLICIES])
@pytest.mark.parametrize("family", SCORED)
def test_a_budget_covering_the_sequence_equals_the_plain_forward(model_factory, family, policy):
    model = model_factory(family)
    ids = random_ids(T, batch=2, seed=2)
    with torch.inference_mode():
        full = model(ids)
        for chunk in (1, 7):
            cache = kvcache.make_cache(model, policy, cache_length=T, batch_size=2)
            assert max_diff(feed(model, ids, cache, chunk), full) <= ATOL, f"{policy}, chunks of {chunk}"


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("family", SCORED)
def test_policies_bound_the_global_layers(model_factory, family, policy):
    """A 3072-token prompt would take minutes here; 3 x 48 tokens through 16 slots evict as often."""
    model = model_factory(family)
    cache = kvcache.make_cache(model, policy, cache_length=16)
    sliding = [layer.sliding for layer in model.config.layers]
    assert [layer.name for layer in cache.layers] == ["window" if s else policy for s in sliding]
    with torch.inference_mode():
        out = feed(model, random_ids(3 * T, seed=3), cache, 32)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("family", SCORED)
def test_renumbered_sinks_decode_as_the_chunked_path(model_factory, family):
    """The sink policy with renumbered positions, one token at a time (the ring's decode path,
    explicit softmax with sink queries) and in chunks of 7 (the ranked path) agree."""
    model = model_factory(family)
    ids = random_ids(T, seed=4)
    with torch.inference_mode():
        renumbered = {"sinks": 2, "positions": "renumbered"}
        one = feed(model, ids, kvcache.make_cache(model, "sink", cache_length=12, options=renumbered), 1)
        seven = feed(model, ids, kvcache.make_cache(model, "sink", cache_length=12, options=renumbered), 7)
    assert max_diff(one, seven) <= ATOL


@pytest.mark.parametrize("family, policy", [("gemma2", "h2o"), ("gpt_oss", "dense")])
def test_captured_decode_step_matches_eager(model_factory, family, policy):
    model = model_factory(family)
    ids = random_ids(12 + 8, batch=2, seed=5)
    C = 24 if policy == "dense" else 10
    torch._dynamo.reset()

    def run(capture: bool):
        cache = kvcache.make_cache(model, policy, cache_length=C, batch_size=2)
        with torch.inference_mode():
            model(ids[:, :12], cache, n_tokens=[12, 9])
            step = CompiledDecode(model, cache, backend="aot_eager") if capture else (lambda t: model(t, cache)[:, -1])
            return torch.stack([step(ids[:, 12 + i:13 + i]) for i in range(8)])

    try:
        assert max_diff(run(True), run(False)) <= atol("compiled")
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("family", SCORED)
def test_gradients_equal_transformers(checkpoint_factory, model_factory, family):
    """The loss of a plain forward and the gradient of every parameter (sink logits, router and
    experts included) against transformers' eager model on the same weights."""
    from train_util import plain_loss, relative_errors

    hf = checkpoint_factory(family).hf
    model = model_factory(family)
    ids = random_ids(2 * 8 + 5, batch=2, seed=6)

    def grads(module, loss):
        module.zero_grad()
        loss.backward()
        return {name: p.grad.clone() for name, p in module.named_parameters() if p.grad is not None}

    want = grads(hf, torch.nn.functional.cross_entropy(hf(ids).logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()))
    got = grads(model, plain_loss(model, ids))
    want = {name.removeprefix("model."): g for name, g in want.items()}
    assert set(got) == set(want)
    errors = relative_errors(got, want)
    assert max(errors.values()) <= 1e-4, max(errors, key=errors.get)


@pytest.mark.parametrize("storage", ["int4", "kivi2"])
def test_kivi_storages_are_refused_with_the_reason(model_factory, storage):
    """KIVI attends a chunk with its own kernel, which applies no scores rule."""
    model = model_factory("gpt_oss")
    with pytest.raises(ValueError, match="per-token layout"):
        kvcache.make_cache(model, f"h2o:{storage}", cache_length=64)


@pytest.mark.parametrize("family", SCORED)
@pytest.mark.parametrize("policy", ["dense:int8", "h2o:token4"])
def test_per_token_storages_attend_their_codes_with_the_rule(model_factory, family, policy):
    """A per-token quantized storage on these models: its codes read back and attended with the
    family's rule, one token at a time and in chunks of 7, near full precision's logits."""
    model = model_factory(family)
    ids = random_ids(T, batch=2, seed=7)
    C = T if policy.startswith("dense") else 16
    with torch.inference_mode():
        full = model(ids)
        options = {"recent": 4} if "h2o" in policy else None
        one, seven = (feed(model, ids, kvcache.make_cache(model, policy, cache_length=C, batch_size=2, options=options), n)
                      for n in (1, 7))
    assert kvcache.make_cache(model, policy, cache_length=C).spec.storage != "full"
    if policy.startswith("dense"):
        assert max(max_diff(one, full), max_diff(seven, full)) <= 0.05
    assert torch.isfinite(one).all() and torch.isfinite(seven).all()
