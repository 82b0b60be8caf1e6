"""Ragged rows (different lengths in one batch) in chunked_loss: the batch's loss and gradient
are those of each row run alone, weighted by its share of the targets (fp32, relative error
<= 1e-5), for the dense cache and evicting policies, with labels and weights; and the errors."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE
from train_util import gradients, loss_args, relative_errors, tiny_model, token_ids

import kvcache

REL_TOL = 1e-5
LENGTHS = (23, 9, 16)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("ragged"), layers=2)


@pytest.mark.parametrize("policy, options", [
    ("dense", {}),
    ("h2o", dict(cache_length=8, recent=3)),
    ("sink", dict(cache_length=8, sinks=2)),
    ("snapkv", dict(cache_length=8, window=3)),
])
def test_ragged_rows_equal_rows_alone(model, policy, options):
    rows = [token_ids(n, seed=i)[0] for i, n in enumerate(LENGTHS)]
    weights = [1.0 + torch.rand(n, generator=torch.Generator().manual_seed(10 + i)).to(DEVICE) for i, n in enumerate(LENGTHS)]
    labels = [r.clone() for r in rows]
    labels[1][2:5] = -100
    kw = dict(policy=policy, chunk=5, **options)
    # Each row's weight in the batch: the sum of the weights of the targets it counts.
    shares = [float((w[1:] * (lab[1:] != -100)).sum()) for w, lab in zip(weights, labels)]
    total = sum(shares)
    want_loss, want = 0.0, {}
    for row, lab, w, share in zip(rows, labels, weights, shares):
        loss, grads = gradients(model, lambda: kvcache.chunked_loss(model, row[None], lab[None], weights=w[None],
                                                                    **loss_args(kw)))
        want_loss += loss * share / total
        for name, g in grads.items():
            want[name] = want.get(name, 0) + g * share / total
    got_loss, got = gradients(model, lambda: kvcache.chunked_loss(model, rows, labels, weights=weights, **loss_args(kw)))
    assert abs(got_loss - want_loss) <= REL_TOL * abs(want_loss)
    errors = relative_errors(got, want)
    assert max(errors.values()) <= REL_TOL, {n: e for n, e in errors.items() if e > REL_TOL}


def test_padding_would_matter_without_the_rule(model):
    """A short row padded by hand with real tokens (counted as targets) has another loss: the
    comparison above can fail."""
    rows = [token_ids(n, seed=i)[0] for i, n in enumerate(LENGTHS)]
    ragged = kvcache.chunked_loss(model, rows, chunk=5).item()
    square = torch.stack([torch.cat([r, token_ids(23 - len(r), seed=99)[0]]) for r in rows])
    assert abs(kvcache.chunked_loss(model, square, chunk=5).item() - ragged) > 1e-3


@pytest.mark.parametrize("rows, kwargs, message", [
    ([], {}, "empty list"),
    ([torch.arange(3, 9, device=DEVICE), torch.arange(3, 4, device=DEVICE)], {}, "row 1 has 1"),
    ([torch.arange(3, 9, device=DEVICE), torch.ones(4, device=DEVICE)], {}, "row 1 must be a 1-D integer tensor"),
    ([torch.arange(3, 9, device=DEVICE)], dict(labels=torch.arange(3, 9, device=DEVICE)[None]), "labels must be a list"),
    ([torch.arange(3, 9, device=DEVICE)], dict(weights=[torch.ones(5, device=DEVICE)]),
     r"weights\[0\] must have the shape of row 0"),
])
def test_ragged_errors(model, rows, kwargs, message):
    labels = kwargs.pop("labels", None)
    with pytest.raises(ValueError, match=message):
        kvcache.chunked_loss(model, rows, labels, chunk=4, **loss_args(kwargs))


def test_finetune_on_ragged_rows(tmp_path):
    from kvcache.train.loop import FinetuneConfig, finetune

    model = tiny_model(tmp_path, layers=2)
    rows = [token_ids(n, seed=i)[0] for i, n in enumerate((20, 12, 17, 9))]
    before = kvcache.chunked_loss(model, rows, chunk=4).item()
    config = FinetuneConfig(policy="h2o", cache_length=8, chunk=4, policy_options={"recent": 3}, steps=4, lr=3e-3,
                            warmup=1, batch_size=2)
    records = finetune(model, rows, config, progress=False)
    assert records[-1]["tokens"] == 2 * (20 + 12 + 17 + 9)  # 4 steps of 2 rows: every row twice
    assert kvcache.chunked_loss(model, rows, chunk=4).item() < before
