"""critical: the base policy's best first, then base score times the projected value norm;
checked against a direct computation on a dense cache's keys and values and the model's W_o."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE
from policy_util import kept

import kvcache
from kvcache.cache.policies.critical import projected_value_norms


def test_projected_value_norms_are_the_l1_norms_of_v_times_wo():
    g = torch.Generator().manual_seed(0)
    B, Hkv, N, D, group, hidden = 1, 2, 5, 4, 3, 7
    values = torch.randn(B, Hkv, N, D, generator=g).to(DEVICE)
    wo = torch.randn(hidden, Hkv * group * D, generator=g).to(DEVICE)
    got = projected_value_norms(values, wo)
    for h in range(Hkv):
        per_query_head = [(values[0, h] @ wo[:, q * D : (q + 1) * D].t()).abs().sum(-1)
                          for q in range(h * group, (h + 1) * group)]
        assert torch.allclose(got[0, h], torch.stack(per_query_head).mean(0), atol=1e-5)


@pytest.mark.parametrize("first_stage", [0.0, 0.5])
def test_a_prompt_keeps_the_two_stages(llama, first_stage):
    T, C = 40, 12
    ids = torch.arange(3, 3 + T, device=DEVICE)[None]
    with torch.inference_mode():
        dense = kvcache.make_cache(llama, "dense", cache_length=T)
        llama(ids, dense)
        cache = kvcache.make_cache(llama, "critical", cache_length=C, options={"base": "knorm", "first_stage": first_stage})
        llama(ids, cache)
    for i, (layer, d) in enumerate(zip(cache.layers, dense.layers)):
        k, v = d.storage.k[:, :, :T].float(), d.storage.v[:, :, :T].float()
        base = -k.norm(dim=-1)  # knorm's score
        weighted = (base + 1e-4) * projected_value_norms(v, llama.layers[i].self_attn.o_proj.weight)
        first = int(C * first_stage)
        expected = []
        for h in range(k.shape[1]):
            chosen = base[0, h].topk(first).indices.tolist() if first else []
            rest = [int(p) for p in weighted[0, h].argsort(descending=True) if int(p) not in chosen]
            expected.append(sorted(chosen + rest[: C - first]))
        assert kept(layer, 0) == expected


def test_a_model_without_output_projections_is_refused():
    from kvcache.cache.base import CacheSpec
    from kvcache.cache.policies.critical import CriticalCache, CriticalOptions

    spec = CacheSpec(batch_size=1, num_kv_heads=2, head_dim=8, cache_length=8, dtype=torch.float32,
                     device=DEVICE)
    with pytest.raises(ValueError, match="output projection"):
        CriticalCache(spec, CriticalOptions())
