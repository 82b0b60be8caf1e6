"""Cache names parsed once (kvcache/cache/names.py): ``policy[(options)][:storage]`` -> a frozen
CacheName, written back one way; policy options reach make_cache as a mapping, apart from its
own keywords."""

from __future__ import annotations

import pytest

import kvcache
from kvcache.cache.names import CacheName


@pytest.mark.parametrize("name, policy, storage, options", [
    ("h2o", "h2o", "full", {}),
    ("h2o:int4", "h2o", "int4", {}),
    ("snapkv(window=64,kernel=5,fallback=tova)", "snapkv", "full", {"window": 64, "kernel": 5, "fallback": "tova"}),
    ("h2o( recent=0 , normalize=True ):int8", "h2o", "int8", {"recent": 0, "normalize": True}),
    ("expected_attention(epsilon=0.5,covariance=false)", "expected_attention", "full",
     {"epsilon": 0.5, "covariance": False}),
    ("sink()", "sink", "full", {}),
])
def test_a_name_carries_options_and_a_storage(name, policy, storage, options):
    parsed = CacheName.parse(name)
    assert (parsed.policy, parsed.storage) == (policy, storage)
    assert parsed.options == options and all(type(parsed.options[k]) is type(v) for k, v in options.items())
    assert CacheName.parse(parsed) is parsed  # a parsed name passes through


def test_a_name_is_written_one_way_and_reads_back_equal():
    assert str(CacheName.parse("snapkv( window=64 ,kernel=5)")) == str(CacheName.parse("snapkv(kernel=5,window=64)")) \
        == "snapkv(kernel=5,window=64)"
    assert str(CacheName.parse("h2o(normalize=True,recent=0):int4")) == "h2o(normalize=true,recent=0):int4"
    assert str(CacheName.parse("h2o:int4")) == "h2o:int4" and str(CacheName.parse("h2o")) == "h2o"
    for text in ("h2o(normalize=True,recent=0):int4", "snapkv(fallback=tova)", "dense:int8"):
        name = CacheName.parse(text)
        assert CacheName.parse(str(name)) == name


def test_a_name_is_a_frozen_value():
    a, b = CacheName.parse("h2o(recent=8):int4"), CacheName.parse("h2o( recent=8 ):int4")
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    with pytest.raises(AttributeError):
        a.policy = "tova"
    with pytest.raises(TypeError):
        a.options["recent"] = 9
    assert a != CacheName.parse("h2o(recent=9):int4")


def test_options_given_apart_join_the_name_once():
    name = CacheName.parse("snapkv(window=64)")
    assert name.with_options({"kernel": 5}).options == {"window": 64, "kernel": 5}
    assert name.with_options(None) is name
    with pytest.raises(ValueError, match="window in its name"):
        name.with_options({"window": 32})
    with pytest.raises(ValueError, match="a mapping"):
        name.with_options([("kernel", 5)])


@pytest.mark.parametrize("text, message", [
    ("h2o(recent=8", "not a cache name"),
    ("h2o(recent)", "not option=value"),
    ("h2o(recent=1,recent=2)", "given twice"),
    ("h2o:int6", "h2o:int6"),
    (3, "a string"),
])
def test_a_bad_name_says_what_is_wrong(text, message):
    with pytest.raises(ValueError, match=message):
        CacheName.parse(text)


def test_policy_options_are_a_mapping_apart_from_make_caches_keywords(llama):
    """An option travels in ``options``; make_cache's own keywords (block, reserve) are never
    read as a policy's option, nor a policy's option as one of them."""
    model = llama
    cache = kvcache.make_cache(model, "h2o", cache_length=16, options={"recent": 4})
    assert cache.layers[0].options.recent == 4
    named = kvcache.make_cache(model, CacheName.parse("h2o(recent=4)"), cache_length=16)
    assert named.layers[0].options == cache.layers[0].options
    with pytest.raises(ValueError, match="block"):  # not the block rule: h2o has no option of that name
        kvcache.make_cache(model, "h2o", cache_length=16, options={"block": 4})
    with pytest.raises(TypeError):
        kvcache.make_cache(model, "h2o", cache_length=16, recent=4)
