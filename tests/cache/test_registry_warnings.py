"""make_cache warns when a share of the prompt leaves an evicting policy a handful of slots."""

from __future__ import annotations

import warnings

import pytest

import kvcache
from kvcache.errors import KVCacheWarning


def test_a_share_of_a_short_prompt_that_leaves_a_handful_of_slots_warns(llama):
    with pytest.warns(KVCacheWarning, match="leaves the h2o policy 2 slots per layer"):
        kvcache.make_cache(llama, "h2o", cache_length=0.25, prompt_length=10)
    with warnings.catch_warnings():
        warnings.simplefilter("error", KVCacheWarning)
        kvcache.make_cache(llama, "h2o", cache_length=0.25, prompt_length=400)  # 100 slots
        kvcache.make_cache(llama, "h2o", cache_length=4)  # a count: what was asked for
        kvcache.make_cache(llama, "dense", cache_length=1.0, prompt_length=10)  # keeps every token
