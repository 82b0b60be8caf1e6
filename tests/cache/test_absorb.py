"""``LayerCache.absorb``: a chunk taken without its attention outputs leaves every cache as
``attend`` does (an evicting cache skips the outputs on its chunk path; the others attend)."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE, random_ids
from policy_util import cache_args

from kvcache import make_cache
from kvcache.eval.shared import record

POLICIES = ["dense", "window", "sink", "h2o", "tova", "snapkv", "knorm", "keydiff", "expected_attention",
            "random", "snapkv:int8", "h2o:kivi4"]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("reserve", [0, 8])
def test_absorb_leaves_the_cache_attend_leaves(llama, policy, reserve):
    ids = random_ids(96)[0].tolist()
    recorded = record(llama, ids)
    length = 96 if policy == "dense" else 48
    options = {"reserve": reserve} if reserve and policy not in ("dense", "window", "sink") else {}
    caches = [make_cache(llama, policy, cache_length=length, **cache_args(options)) for _ in range(2)]
    with torch.inference_mode():
        steps = [c.begin(torch.tensor([ids], device=DEVICE), None) for c in caches]
        for i, call in enumerate(recorded.calls):
            caches[0].layers[i].attend(call.q, call.k, call.v, steps[0])
            caches[1].layers[i].absorb(call.q, call.k, call.v, steps[1])
        for c, step in zip(caches, steps):
            c.commit(step)
    a, b = (c.snapshot().tensors() for c in caches)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
