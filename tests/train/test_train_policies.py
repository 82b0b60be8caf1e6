"""chunked_loss under every registered evicting policy and storage: the loss and every
parameter's gradient equal those of a full forward in which the positions the policy kept are
applied as an attention mask over the whole sequence (train_util.reference_loss: built from the
real cache's buffers, an explicit float32 softmax, renumbered sinks rotated, quantized keys and
values straight-through, KIVI keys at full precision). fp32, relative error <= 1e-5, over random
chunkings, budgets and batches. New policies and storages join by being registered."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from train_util import gradients, loss_args, policy_heads, record_held, reference_loss, relative_errors, tiny_model, token_ids

import kvcache
from kvcache.cache.registry import budget_options

REL_TOL = 1e-5
EVICTING = sorted(name for name in kvcache.policies() if name != "dense")
STORAGES = sorted(kvcache.storages())


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("tiny_train"), layers=2)


def check(model, policy: str, C: int, ids: torch.Tensor, sizes: list[int], **options) -> tuple[float, float]:
    """Assert chunked_loss matches the masked reference; returns (its loss, the dense loss)."""
    options = {**budget_options(policy.partition(":")[0], C), **options}
    cache, held = record_held(model, ids, policy, C, sizes, **options)
    if not getattr(policy_heads(cache.layers[0])[0].storage, "exact_roundtrip", True):
        return check_full_precision(model, policy, C, ids, sizes, **options)
    want_loss, want = gradients(model, lambda: reference_loss(model, ids, cache, held, sizes))
    got_loss, got = gradients(model, lambda: kvcache.chunked_loss(model, ids, policy=policy, cache_length=C,
                                                                  chunk=sizes, **loss_args(options)))
    assert abs(got_loss - want_loss) <= REL_TOL * abs(want_loss), (got_loss, want_loss)
    errors = relative_errors(got, want)
    assert max(errors.values()) <= REL_TOL, {k: v for k, v in errors.items() if v > REL_TOL}
    with torch.no_grad():
        dense = kvcache.chunked_loss(model, ids).item()
    return got_loss, dense


def check_full_precision(model, policy: str, C: int, ids, sizes, **options) -> tuple[float, float]:
    """A storage whose codes depend on placement (KIVI) trains as the full-precision policy."""
    full = policy.partition(":")[0]
    with pytest.warns(UserWarning, match="full precision"):
        got_loss, got = gradients(model, lambda: kvcache.chunked_loss(model, ids, policy=policy, cache_length=C,
                                                                      chunk=sizes, **loss_args(options)))
    want_loss, want = gradients(model, lambda: kvcache.chunked_loss(model, ids, policy=full, cache_length=C,
                                                                    chunk=sizes, **loss_args(options)))
    assert got_loss == want_loss and all(torch.equal(got[n], want[n]) for n in want)
    return check(model, full, C, ids, sizes, **options)


@pytest.mark.parametrize("policy", EVICTING)
def test_every_policy_matches_the_masked_reference(model, policy):
    ids = token_ids(36, batch=2, seed=1)
    differs = []
    for sizes in ([6] * 6, [13, 1, 1, 21], [1] * 36):
        loss, dense = check(model, policy, 10, ids, sizes)
        differs.append(abs(loss - dense) > 1e-4)
    # The cache dropped tokens that mattered: the reference is not the dense forward in disguise.
    assert any(differs)


@pytest.mark.parametrize("storage", [s for s in STORAGES if s != "full"])
@pytest.mark.parametrize("policy", ["sink", "h2o", "window"])
def test_quantized_storage_is_straight_through(model, policy, storage):
    check(model, f"{policy}:{storage}", 10, token_ids(30, seed=2), [7, 7, 7, 9])


def test_sink_positions_and_reserve(model):
    ids = token_ids(32, seed=4)
    check(model, "sink", 9, ids, [5, 11, 16], positions="absolute", sinks=2)
    check(model, "sink", 9, ids, [5, 11, 16], positions="renumbered", sinks=3)
    check(model, "h2o", 12, ids, [4, 4, 8, 16], reserve=4, recent=4)
    check(model, "tova", 12, ids, [1, 3, 28], reserve=3)


@settings(max_examples=30, deadline=None)
@given(policy=st.sampled_from([f"{p}:{s}" if s != "full" else p for p in EVICTING for s in STORAGES]),
       data=st.data(), batch=st.integers(1, 2), seed=st.integers(0, 1000))
def test_random_chunkings_budgets_and_batches(model, policy, data, batch, seed):
    C = data.draw(st.integers(4, 14), label="C")
    T = data.draw(st.integers(C + 1, 40), label="T")
    cuts = data.draw(st.lists(st.integers(1, T - 1), max_size=7), label="cuts")
    edges = [0, *sorted(set(cuts)), T]
    sizes = [b - a for a, b in zip(edges, edges[1:])]
    check(model, policy, C, token_ids(T, batch=batch, seed=seed), sizes)


def test_budgets_per_layer(model):
    check(model, "h2o", 14, token_ids(40, seed=6), [10, 10, 20], allocation=[20, 8], recent=2)
    check(model, "sink", 14, token_ids(40, seed=7), [6, 17, 17], allocation=[8, 20])


@pytest.mark.parametrize("policy", EVICTING)
def test_head_budgets_match_the_masked_reference(model, policy):
    """One cache per K/V head, of its own size (Ada-KV's layout): each head keeps and attends by
    its own cache's decisions and rules; 2 rows, chunks of 1 to 6 tokens."""
    ids = token_ids(30, batch=2, seed=5)
    budgets = [[6, 11], [12, 5]]
    # The reference renumbers sinks by one cache length, not one per head: true positions here.
    options = {"positions": "absolute"} if "positions" in kvcache.policy_options(policy) else {}
    check(model, policy, 8, ids, [6, 1, 5, 4, 6, 3, 5], head_budgets=budgets, **options)
