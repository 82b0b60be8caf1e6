"""What kvcache.hf.compat says about the installed transformers: the keyword the cache is passed
by, the output field it comes back in, and the warning for a release newer than any tested."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
from conftest import DEVICE, random_ids
from hf_models import build

import kvcache.hf
from kvcache.hf import compat


def test_cache_keyword_is_one_the_model_takes_without_a_deprecation_warning():
    model = build("llama")
    assert compat.CACHE_ARG in inspect.signature(type(model).forward).parameters
    cache = kvcache.hf.make_cache(model, "dense", cache_length=8)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        out = model(random_ids(4), **kvcache.hf.cache_kwargs(cache))
    assert kvcache.hf.output_cache(out) is cache
    assert cache.lengths.tolist() == [4]


def test_get_mask_sizes_takes_a_length_or_cache_positions():
    assert compat.query_length(5) == 5
    assert compat.query_length(torch.arange(3, 8, device=DEVICE)) == 5


@pytest.mark.parametrize("version", ["5.99.0", "5.300.1.dev0"])
def test_newer_release_warns_once(version, monkeypatch):
    monkeypatch.setattr(compat, "_warned", False)
    with pytest.warns(compat.UntestedTransformersWarning, match=rf"up to {compat.NEWEST_TESTED}.*{version}"):
        compat.warn_if_untested(version)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compat.warn_if_untested(version)  # once per process


@pytest.mark.parametrize("version", [compat.MINIMUM, compat.NEWEST_TESTED])
def test_tested_release_does_not_warn(version, monkeypatch):
    monkeypatch.setattr(compat, "_warned", False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compat.warn_if_untested(version)
