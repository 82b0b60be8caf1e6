"""Policy options and layer budgets: typed options with clear errors, the registry's listing, and
PyramidKV-style allocations whose layers really are allocated at their own sizes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from policy_util import build_tiny, ids_for, kept

import kvcache
from kvcache.cache import layer_budgets

POLICY_NAMES = {"dense", "window", "sink", "h2o", "tova", "snapkv"}
DEFAULTS = {
    "dense": {},
    "window": {},
    "tova": {},
    "sink": {"sinks": 4, "positions": "renumbered"},
    "h2o": {"recent": 32, "sinks": 0, "normalize": False, "value_norm": False},
    "snapkv": {"window": 32, "kernel": 7, "pooling": "avg", "fallback": "window"},
}


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory):
    return build_tiny(tmp_path_factory.mktemp("four_layers"), layers=4, seed=3)


# --- the registry -------------------------------------------------------------------------------


def test_policies_lists_the_built_in_ones_with_descriptions():
    listed = kvcache.policies()
    assert POLICY_NAMES | {"knorm", "expected_attention"} <= set(listed)
    for name, description in listed.items():
        assert isinstance(description, str) and len(description) > 10, name


@pytest.mark.parametrize("policy", sorted(POLICY_NAMES))
def test_policy_options_gives_defaults(policy):
    assert kvcache.policy_options(policy) == DEFAULTS[policy]


def test_unknown_policy_lists_available(llama):
    with pytest.raises(ValueError, match="unknown policy 'lru'.*h2o.*snapkv.*tova.*window"):
        kvcache.make_cache(llama, "lru", cache_length=8)
    with pytest.raises(ValueError, match="available"):
        kvcache.policy_options("lru")


@pytest.mark.parametrize("policy", sorted(POLICY_NAMES))
def test_unknown_option_lists_valid_ones(llama, policy):
    valid = list(DEFAULTS[policy])
    with pytest.raises(ValueError) as err:
        kvcache.make_cache(llama, policy, cache_length=64, options={"recnet": 3})
    message = str(err.value)
    assert "'recnet'" in message and "valid options" in message
    for name in valid:
        assert name in message
    if not valid:
        assert "none" in message


def test_unknown_option_through_generate(llama):
    with pytest.raises(ValueError, match="valid options: sinks, positions"):
        kvcache.generate(llama, [5, 6, 7], max_new_tokens=2, policy="sink", cache_length=8,
                         policy_options={"sink": 2})


BAD_VALUES = [
    ("sink", 8, dict(sinks=8), "sinks"),
    ("sink", 8, dict(sinks=9), "sinks"),
    ("sink", 8, dict(sinks=-1), "sinks"),
    ("sink", 8, dict(positions="relative"), "positions"),
    ("h2o", 8, dict(recent=8), "recent"),
    ("h2o", 8, dict(recent=5, sinks=3), "recent"),
    ("h2o", 8, dict(recent=-1, sinks=2), "recent"),
    ("snapkv", 16, dict(window=4, kernel=4), "kernel"),
    ("snapkv", 16, dict(window=4, kernel=0), "kernel"),
    ("snapkv", 16, dict(window=16), "window"),
    ("snapkv", 16, dict(window=0), "window"),
    ("snapkv", 16, dict(window=4, pooling="min"), "pooling"),
    ("snapkv", 16, dict(window=4, fallback="h2o"), "fallback"),
]


@pytest.mark.parametrize("policy,C,options,word", BAD_VALUES, ids=lambda x: str(x))
def test_bad_option_values_raise(llama, policy, C, options, word):
    with pytest.raises(ValueError, match=word):
        kvcache.make_cache(llama, policy, cache_length=C, options=options)


def test_boundary_option_values_are_accepted(llama):
    kvcache.make_cache(llama, "sink", cache_length=8, options={"sinks": 7})
    kvcache.make_cache(llama, "sink", cache_length=8, options={"sinks": 0, "positions": "absolute"})
    kvcache.make_cache(llama, "h2o", cache_length=8, options={"recent": 5, "sinks": 2, "normalize": True, "value_norm": True})
    kvcache.make_cache(llama, "snapkv", cache_length=8, options={"window": 7, "kernel": 1, "pooling": "max", "fallback": "tova"})


@pytest.mark.parametrize("policy,options", [
    ("sink", dict(sinks=2.5)),
    ("snapkv", dict(window=4, kernel=3.0)),
    ("h2o", dict(recent=3.5)),
], ids=str)
def test_non_integer_counts_are_rejected_by_make_cache(llama, policy, options):
    with pytest.raises((ValueError, TypeError)):
        kvcache.make_cache(llama, policy, cache_length=8, options=options)


def test_fractional_cache_length(llama):
    cache = kvcache.make_cache(llama, "h2o", cache_length=0.5, prompt_length=40, options={"recent": 4})
    assert cache.cache_length == 20
    assert all(layer.spec.cache_length == 20 for layer in cache.layers)
    with pytest.raises(ValueError, match="prompt_length"):
        kvcache.make_cache(llama, "h2o", cache_length=0.5, options={"recent": 4})
    # 1.0 is the whole prompt (a float is always a fraction; an int a token count).
    assert kvcache.make_cache(llama, "window", cache_length=1.0, prompt_length=40).cache_length == 40
    for bad in (1.5, 0.0, -0.25):
        with pytest.raises(ValueError, match="fractional"):
            kvcache.make_cache(llama, "window", cache_length=bad, prompt_length=40)
    for bad in (0, -3, "8", True):
        with pytest.raises(ValueError, match="cache_length"):
            kvcache.make_cache(llama, "window", cache_length=bad, prompt_length=40)
    # through generate: a fraction of the longest prompt
    out = kvcache.generate(llama, [ids_for(30, seed=1)[0].tolist(), [4, 5]], max_new_tokens=3,
                           policy="window", cache_length=0.25, stop_tokens=())
    assert [len(o) for o in out] == [3, 3]


# --- layer budgets --------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None, derandomize=True)
@given(st.integers(1, 2000), st.integers(2, 48))
def test_pyramid_budgets(cache_length, num_layers):
    budgets = layer_budgets(cache_length, num_layers, "pyramid")
    assert len(budgets) == num_layers and min(budgets) >= 1
    assert all(a >= b for a, b in zip(budgets, budgets[1:])), budgets
    assert abs(sum(budgets) / num_layers - cache_length) <= 0.5, budgets
    if cache_length >= 20:
        assert budgets[0] > budgets[-1]


def test_pyramid_layers_are_allocated_at_their_own_size(four_layers):
    C = 40
    pyramid = kvcache.make_cache(four_layers, "window", cache_length=C, allocation="pyramid")
    budgets = [layer.spec.cache_length for layer in pyramid.layers]
    assert budgets == sorted(budgets, reverse=True) and len(set(budgets)) == 4
    assert abs(sum(budgets) / 4 - C) <= 0.5
    sizes = [layer.storage.k.shape[2] for layer in pyramid.layers]
    assert sizes == [b + 1 for b in budgets]  # plus the scratch slot
    widest = kvcache.make_cache(four_layers, "window", cache_length=max(budgets))
    uniform = kvcache.make_cache(four_layers, "window", cache_length=C)
    assert pyramid.nbytes() < widest.nbytes()
    assert pyramid.nbytes() == pytest.approx(uniform.nbytes(), rel=0.02)
    # and each layer really holds its own budget
    with torch.inference_mode():
        four_layers(ids_for(100, seed=2), pyramid)
    for layer, b in zip(pyramid.layers, budgets):
        assert kept(layer, 0) == [list(range(100 - b, 100))]


@pytest.mark.parametrize("policy,options", [("h2o", dict(recent=4)), ("tova", {}), ("snapkv", dict(window=4)),
                                            ("sink", dict(sinks=2))])
def test_explicit_budget_list(four_layers, policy, options):
    budgets = [30, 20, 12, 8]
    cache = kvcache.make_cache(four_layers, policy, cache_length=16, allocation=budgets, options=options)
    assert [layer.storage.k.shape[2] - 1 for layer in cache.layers] == budgets
    with torch.inference_mode():
        logits = four_layers(ids_for(50, seed=3), cache)
        logits = four_layers(ids_for(1, seed=4), cache)
    assert torch.isfinite(logits).all()
    for layer, b in zip(cache.layers, budgets):
        assert all(len(held) == b for held in kept(layer, 0))


@pytest.mark.parametrize("allocation", [[16, 16, 16], [16] * 5, [16, 16, 0, 16], [16, -1, 16, 16], "linear"])
def test_bad_allocation_raises(four_layers, allocation):
    with pytest.raises(ValueError, match="budgets|allocation"):
        kvcache.make_cache(four_layers, "window", cache_length=16, allocation=allocation)


# --- options in a cache's name: policy(option=value,...)[:storage] --------------------------------


def _positions(cache) -> list[torch.Tensor]:
    return [layer.storage.pos.clone() for layer in cache.layers]


def test_options_in_the_name_are_the_keyword_options(llama):
    ids = torch.randint(3, 100, (1, 40), generator=torch.Generator().manual_seed(0)).to(llama.embed_tokens.weight.device)
    caches = {}
    for key, name, options in [("name", "snapkv(window=2,kernel=3)", {}), ("keywords", "snapkv", {"window": 2, "kernel": 3}),
                               ("default", "snapkv", {})]:
        caches[key] = kvcache.make_cache(llama, name, cache_length=16, options=options)
        llama(ids, caches[key], last_only=True)
    assert caches["name"].layers[0].options == caches["keywords"].layers[0].options
    assert caches["name"].layers[0].options.window == 2 and caches["default"].layers[0].options.window != 2
    assert all(torch.equal(a, b) for a, b in zip(_positions(caches["name"]), _positions(caches["keywords"])))
    assert not all(torch.equal(a, b) for a, b in zip(_positions(caches["name"]), _positions(caches["default"])))
    assert caches["name"].policy == "snapkv(kernel=3,window=2)"  # written one way (CacheName)
    quantized = kvcache.make_cache(llama, "h2o(recent=4):token8", cache_length=16)
    assert quantized.layers[0].options.recent == 4 and quantized.layers[0].spec.storage == "token8"


def test_an_option_set_twice_or_misnamed_in_a_name_is_refused(llama):
    from kvcache.cache.registry import check_names

    with pytest.raises(ValueError, match="sets window in its name.*set each option once"):
        kvcache.make_cache(llama, "snapkv(window=4)", cache_length=16, options={"window": 8})
    for name, message in [("snapkv(windw=4)", "has no option 'windw'"), ("snapkv(window=4.5)", "must be int"),
                          ("snapkv(window)", "is not option=value"), ("snapkv(window=4", "is not a cache name"),
                          ("snapkv(window=1,window=2)", "given twice"), ("snapkv(pooling=mean)", "must be one of")]:
        with pytest.raises(ValueError, match=message):
            kvcache.make_cache(llama, name, cache_length=16)
        with pytest.raises(ValueError, match=message):
            check_names([name])


def test_budget_options_leave_what_the_name_sets():
    from kvcache.cache import budget_options

    assert budget_options("snapkv", 1000) == {"window": 32}
    assert budget_options("snapkv(window=64)", 1000) == {}
    assert budget_options("h2o(sinks=2)", 100) == {"recent": 50}
