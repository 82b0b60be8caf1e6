"""kvcache.hf refuses what it cannot do correctly, with an error that names it, and a refused
call leaves the model and the cache as they were."""

from __future__ import annotations

import pytest
import torch
import transformers
from conftest import CACHE_ATOL, DEVICE, max_diff, random_ids
from hf_models import build, greedy, left_pad
from packaging.version import Version

import kvcache
import kvcache.hf
from kvcache.hf import cache_kwargs
from kvcache.hf.compat import CACHE_ARG, check


@pytest.mark.parametrize("version", ["4.57.1", "4.56.0", "6.0.0", "6.1.0.dev0"])
def test_unsupported_transformers_version(version):
    with pytest.raises(ImportError, match=r"transformers>=5\.0\.0,<6.*" + version.replace(".", r"\.")):
        check(version)


@pytest.mark.parametrize("version", ["5.0.0", "5.2.0", "5.23.0", "5.99.1"])
def test_supported_transformers_version(version):
    check(version)


def test_model_whose_attention_bypasses_the_interface():
    model = build("gpt_neox_japanese")
    with pytest.raises(kvcache.hf.UnsupportedModelError, match="does not go through transformers' AttentionInterface"):
        kvcache.hf.make_cache(model, "dense", cache_length=8)
    assert model.config._attn_implementation == "eager"


def test_falcon_is_refused_until_its_attention_goes_through_the_interface():
    """Falcon computed its attention in the module before transformers 5.25 and calls the
    registered function since: the same model is refused on one side and exact on the other."""
    model = build("falcon")
    ids = random_ids(12, seed=3)
    if Version(transformers.__version__) < Version("5.25.0"):
        with pytest.raises(kvcache.hf.UnsupportedModelError, match="does not go through"):
            kvcache.hf.make_cache(model, "dense", cache_length=8)
        assert model.config._attn_implementation == "eager"
        return
    want_ids, want_logits = greedy(build("falcon"), ids, 8)
    cache = kvcache.hf.make_cache(model, "dense", cache_length=20)
    got_ids, got_logits = greedy(model, ids, 8, cache)
    assert torch.equal(got_ids, want_ids)
    assert max_diff(got_logits, want_logits) <= CACHE_ATOL[torch.float32]


def test_a_cache_made_for_other_soft_caps_is_refused():
    """A layer cache applies the soft cap of the model it was made for; a model that caps
    otherwise (here: not at all) is told so, and nothing is stored."""
    capped, plain = build("gemma2_cap"), build("gemma2_nocap")
    cache = kvcache.hf.make_cache(capped, "dense", cache_length=8)
    plain.set_attn_implementation("kvcache")
    with pytest.raises(kvcache.hf.UnsupportedModelError, match="softcap=None .* softcap=50.0"):
        plain(random_ids(4), **cache_kwargs(cache))
    assert cache.get_seq_length() == 0


@pytest.mark.parametrize("policy, options", [("sink", {"positions": "renumbered"}), ("expected_attention", {})])
def test_policies_that_rotate_need_full_half_split_rotary(policy, options):
    model = build("phi3_partial")
    with pytest.raises(kvcache.hf.UnsupportedModelError, match="covers 8 of 16 head dimensions"):
        kvcache.hf.make_cache(model, policy, cache_length=8, options={"sinks": 2, **options})
    assert model.config._attn_implementation == "eager"
    # Policies that never rotate work on it.
    kvcache.hf.make_cache(model, "sink", cache_length=8, options={"sinks": 2, "positions": "absolute"})


def test_call_without_a_kvcache_cache():
    model = build("llama")
    kvcache.hf.make_cache(model, "dense", cache_length=8)
    ids = random_ids(4)
    with pytest.raises(RuntimeError, match=rf"{CACHE_ARG}=kvcache\.hf\.make_cache"):
        model(ids)  # transformers makes a DynamicCache
    with pytest.raises(RuntimeError, match=rf"{CACHE_ARG}=kvcache\.hf\.make_cache"):
        model(ids, use_cache=False)
    model.set_attn_implementation("eager")
    model(ids)


def test_cache_with_attention_switched_back():
    model = build("llama")
    cache = kvcache.hf.make_cache(model, "dense", cache_length=8)
    model.set_attn_implementation("eager")
    with pytest.raises(RuntimeError, match="not set to attn_implementation='kvcache'"):
        model(random_ids(4), **cache_kwargs(cache))
    cache.reset()
    model.set_attn_implementation("kvcache")
    model(random_ids(4), **cache_kwargs(cache))
    assert cache.get_seq_length() == 4


def test_rejected_calls_leave_the_cache_as_it_was():
    model = build("llama")
    ids = random_ids(12, batch=2, seed=30)
    cache = kvcache.hf.make_cache(model, "dense", cache_length=10, batch_size=2)
    with torch.no_grad():
        with pytest.raises(ValueError, match="batch_size=2"):
            model(ids[:1], **cache_kwargs(cache))
        with pytest.raises(kvcache.CapacityError):
            model(ids, **cache_kwargs(cache))  # 12 tokens into 10 slots
        with pytest.raises(ValueError, match="position_ids of row 0"):
            model(ids[:, :4], position_ids=torch.arange(1, 5, device=DEVICE)[None], **cache_kwargs(cache))
        with pytest.raises(ValueError, match="2D padding mask"):
            model(ids[:, :4], attention_mask=torch.ones(2, 1, 4, 4, dtype=torch.bool, device=DEVICE), **cache_kwargs(cache))
        gap = torch.tensor([[1, 1, 1, 1], [1, 0, 1, 1]], device=DEVICE)
        with pytest.raises(ValueError, match="row 1 has padding between real tokens"):
            model(ids[:, :4], attention_mask=gap, **cache_kwargs(cache))
        assert cache.get_seq_length() == 0 and cache.lengths.tolist() == [0, 0]
        got = model(ids[:, :10], **cache_kwargs(cache)).logits
    assert max_diff(got, model(ids[:, :10], **cache_kwargs(kvcache.hf.make_cache(
        model, "dense", cache_length=10, batch_size=2))).logits) <= CACHE_ATOL[torch.float32]


def test_a_forward_stopped_half_way_asks_for_reset():
    model = build("llama")
    cache = kvcache.hf.make_cache(model, "dense", cache_length=16)
    ids = random_ids(4, seed=31)

    def fail(module, args):
        raise KeyboardInterrupt

    hook = model.model.layers[1].register_forward_pre_hook(fail)
    with pytest.raises(KeyboardInterrupt):
        model(ids, **cache_kwargs(cache))
    hook.remove()
    with pytest.raises(RuntimeError, match=r"stopped after layer 0.*reset\(\)"):
        model(ids, **cache_kwargs(cache))
    cache.reset()
    model(ids, **cache_kwargs(cache))
    assert cache.get_seq_length() == 4


def test_row_operations_are_refused():
    model = build("llama")
    ids, mask = left_pad([random_ids(6, seed=32)[0].tolist(), random_ids(4, seed=33)[0].tolist()])
    cache = kvcache.hf.make_cache(model, "h2o", cache_length=8, batch_size=4)
    with pytest.raises(NotImplementedError, match="beam search"):
        model.generate(ids, attention_mask=mask, **cache_kwargs(cache), num_beams=2, max_new_tokens=3,
                       do_sample=False)
    cache = kvcache.hf.make_cache(model, "h2o", cache_length=8)
    cache.crop(0)
    with pytest.raises(NotImplementedError, match="assisted"):
        cache.crop(-1)
    with pytest.raises(NotImplementedError, match="select rows"):
        cache.batch_select_indices(torch.tensor([0], device=DEVICE))


def test_storage_and_options_are_kvcaches():
    model = build("llama")
    with pytest.raises(ValueError, match="unknown storage"):
        kvcache.hf.make_cache(model, "h2o:int6", cache_length=8)
    with pytest.raises(ValueError, match="unknown policy"):
        kvcache.hf.make_cache(model, "lru", cache_length=8)
    cache = kvcache.hf.make_cache(model, "h2o:int4", cache_length=8, options={"recent": 2})
    assert cache.policy == "h2o:int4" and cache.nbytes() == cache.kv.nbytes() > 0
    greedy(model, random_ids(12, seed=34), 4, cache)
    assert cache.get_seq_length() == 15
