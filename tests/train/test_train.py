"""chunked_loss with a dense cache: the loss and every parameter's gradient equal full-sequence
backprop (fp32, relative error <= 1e-5) for any chunking, on every model family; the API's
arguments (labels, weights, ignored targets, chunk lists) and its errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE, FAMILIES, random_ids
from hypothesis import given, settings
from hypothesis import strategies as st
from train_util import gradients, loss_args, plain_loss, relative_errors

import kvcache

REL_TOL = 1e-5


def chunkings(total: int):
    """Random chunk sizes summing to ``total``."""
    return st.lists(st.integers(1, total), min_size=1, max_size=8).map(lambda cuts: _sizes(total, cuts))


def _sizes(total: int, cuts: list[int]) -> list[int]:
    points = sorted({c % total for c in cuts} - {0})
    edges = [0, *points, total]
    return [b - a for a, b in zip(edges, edges[1:])]


@settings(max_examples=25, deadline=None)
@given(family=st.sampled_from(FAMILIES), data=st.data(), batch=st.integers(1, 2), seed=st.integers(0, 1000))
def test_dense_equals_full_backprop(model_factory, family, data, batch, seed):
    model = model_factory(family)
    T = data.draw(st.integers(2, 40), label="T")
    sizes = data.draw(chunkings(T), label="sizes")
    ids = random_ids(T, batch=batch, seed=seed)
    want_loss, want = gradients(model, lambda: plain_loss(model, ids))
    got_loss, got = gradients(model, lambda: kvcache.chunked_loss(model, ids, chunk=sizes))
    assert abs(got_loss - want_loss) <= REL_TOL * abs(want_loss)
    errors = relative_errors(got, want)
    assert max(errors.values()) <= REL_TOL, {k: v for k, v in errors.items() if v > REL_TOL}


@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_every_parameter_gets_its_gradient(model_factory, chunk):
    """Tied and untied heads, biases, q/k norms: nothing is left out (64: one chunk, no cache use)."""
    for family in ("qwen3", "llama_linear", "qwen2"):
        model = model_factory(family)
        ids = random_ids(33, seed=chunk)
        _, want = gradients(model, lambda: plain_loss(model, ids))
        _, got = gradients(model, lambda: kvcache.chunked_loss(model, ids, chunk=chunk))
        assert got.keys() == {n for n, _ in model.named_parameters()}
        assert max(relative_errors(got, want).values()) <= REL_TOL


def test_gradient_reaches_earlier_chunks_through_the_cache(llama):
    """The loss of the last chunk alone changes the embeddings of tokens in the first chunk: its
    gradient flowed back through cached keys and values."""
    ids = random_ids(24, seed=3)
    labels = torch.full_like(ids, -100)
    labels[:, -4:] = ids[:, -4:]  # only the last chunk's targets count
    emb = llama.embed_tokens.weight
    llama.zero_grad(set_to_none=True)
    kvcache.chunked_loss(llama, ids, labels, chunk=8).backward()
    first_chunk_rows = ids[0, :8].unique()
    assert emb.grad[first_chunk_rows].abs().sum() > 0
    want_loss, want = gradients(llama, lambda: F.cross_entropy(llama(ids)[:, :-1].flatten(0, 1), labels[:, 1:].flatten()))
    _, got = gradients(llama, lambda: kvcache.chunked_loss(llama, ids, labels, chunk=8))
    assert max(relative_errors(got, want).values()) <= REL_TOL
    llama.zero_grad(set_to_none=True)


def test_labels_weights_and_ignored_targets(llama):
    ids = random_ids(20, batch=2, seed=5)
    labels = random_ids(20, batch=2, seed=6)
    labels[0, 3:9] = -100
    weights = torch.rand(2, 20, generator=torch.Generator().manual_seed(0)).to(DEVICE) * 3

    def reference():
        logits = llama(ids)[:, :-1].flatten(0, 1)
        target, w = labels[:, 1:].flatten(), weights[:, 1:].flatten()
        losses = F.cross_entropy(logits, target, ignore_index=-100, reduction="none")
        w = w * (target != -100)
        return (losses * w).sum() / w.sum()

    want_loss, want = gradients(llama, reference)
    got_loss, got = gradients(llama, lambda: kvcache.chunked_loss(llama, ids, labels, weights=weights, chunk=[3, 10, 7]))
    assert got_loss == pytest.approx(want_loss, rel=REL_TOL)
    assert max(relative_errors(got, want).values()) <= REL_TOL


def test_autograd_grad_and_no_grad_agree_with_backward(llama):
    ids = random_ids(16, seed=8)
    params = [p for p in llama.parameters()]
    loss = kvcache.chunked_loss(llama, ids, chunk=5)
    grads = torch.autograd.grad(loss, params)
    _, backward = gradients(llama, lambda: kvcache.chunked_loss(llama, ids, chunk=5))
    for (name, _), g in zip(llama.named_parameters(), grads):
        assert torch.equal(g, backward[name]), name
    with torch.no_grad():
        value = kvcache.chunked_loss(llama, ids, chunk=5)
    assert not value.requires_grad and value.item() == pytest.approx(loss.item(), abs=1e-6)


def test_frozen_parameters_get_no_gradient(llama):
    ids = random_ids(12, seed=9)
    for name, p in llama.named_parameters():
        p.requires_grad_(name.startswith("layers.1."))
    try:
        _, got = gradients(llama, lambda: kvcache.chunked_loss(llama, ids, chunk=4))
        _, want = gradients(llama, lambda: plain_loss(llama, ids))
    finally:
        for p in llama.parameters():
            p.requires_grad_(True)
    assert got.keys() == want.keys() == {n for n, _ in llama.named_parameters() if n.startswith("layers.1.")}
    assert max(relative_errors(got, want).values()) <= REL_TOL


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(chunk=0), "chunk must be positive"),
        (dict(chunk=[4, 4]), "must sum to the sequence length 10"),
        (dict(chunk=[4, 0, 6]), "positive ints"),
        (dict(chunk=4, cache_length=6), "cannot hold a sequence of 10 tokens"),
        (dict(chunk=4, policy="nope", cache_length=6), "unknown policy"),
    ],
)
def test_errors(llama, kwargs, message):
    with pytest.raises((ValueError, kvcache.CapacityError), match=message):
        kvcache.chunked_loss(llama, random_ids(10), **loss_args(kwargs))


def test_second_backward_is_refused(llama):
    loss = kvcache.chunked_loss(llama, random_ids(8), chunk=4)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="already backpropagated"):
        loss.backward()
    llama.zero_grad(set_to_none=True)


def test_input_errors(llama):
    with pytest.raises(ValueError, match="at least 2 tokens"):
        kvcache.chunked_loss(llama, random_ids(1))
    with pytest.raises(ValueError, match="integer tensor"):
        kvcache.chunked_loss(llama, torch.zeros(2, 5, device=DEVICE))
    with pytest.raises(ValueError, match="no token to predict"):
        kvcache.chunked_loss(llama, random_ids(6), torch.full((1, 6), -100, device=DEVICE))
    with pytest.raises(ValueError, match="labels must have the shape"):
        kvcache.chunked_loss(llama, random_ids(6), random_ids(5))
