"""The transformer against transformers' implementation of each family, hooks and output options."""

from __future__ import annotations

import dataclasses
import json
import shutil
import warnings

import pytest
import torch
from conftest import DEVICE, FAMILIES, HF_ATOL, HIDDEN, TIED, VOCAB, atol, max_diff, random_ids

import kvcache
from kvcache.model.rope import rope_angles


@pytest.mark.parametrize("family", FAMILIES)
def test_forward_matches_transformers(family, checkpoint_factory, model_factory):
    ckpt = checkpoint_factory(family)
    model = model_factory(family)
    ids = random_ids(24, batch=2, seed=1)
    with torch.no_grad():
        ref = ckpt.hf(ids).logits
        out = model(ids)
    assert out.shape == (2, 24, VOCAB)
    assert out.dtype == torch.float32
    # The comparison is only meaningful if the logits are not vanishingly small.
    assert ref.std() > 0.3
    diff = max_diff(out, ref)
    assert diff <= HF_ATOL[torch.float32], f"{family}: max |logit diff| {diff:.3g}"


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_matches_transformers(family, checkpoint_factory, model_factory):
    ckpt = checkpoint_factory(family)
    model = model_factory(family)
    ids = random_ids(7, batch=2, seed=2)
    new = 14  # 7 + 14 > 8: the mistral_window decode runs past its window
    with torch.no_grad():
        ref = ckpt.hf.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new,
            eos_token_id=None, pad_token_id=0,
        )[:, ids.shape[1]:]
    assert ref.shape == (2, new)  # eos disabled on both sides: exactly `new` tokens
    out = kvcache.generate(model, ids.tolist(), max_new_tokens=new, stop_tokens=())
    assert out == ref.tolist()


def test_tied_embeddings_share_the_head(model_factory):
    for family in FAMILIES:
        model = model_factory(family)
        tied = model.lm_head.weight is model.embed_tokens.weight
        assert tied == (family in TIED), family


def _without_window(src, dst):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["sliding_window"] = None
    (dst / "config.json").write_text(json.dumps(cfg))
    return kvcache.load(dst, device=DEVICE)


def test_model_window_changes_late_positions_only(checkpoint_factory, model_factory, tmp_path):
    """The window-8 model differs from the same weights with full attention exactly from position 8
    on, so the parity tests above exercise the window."""
    windowed = model_factory("mistral_window")
    assert windowed.config.sliding_window == 8
    full = _without_window(checkpoint_factory("mistral_window").path, tmp_path / "full")
    assert full.config.sliding_window is None
    ids = random_ids(24, seed=3)
    with torch.no_grad():
        a, b = windowed(ids), full(ids)
    assert max_diff(a[:, :8], b[:, :8]) <= atol("cache")
    assert max_diff(a[:, 8:], b[:, 8:]) > 1e-2


# --- hooks and output options ------------------------------------------------------------------


def test_layer_hook_sees_every_layer_once(clean_hook):
    model = clean_hook
    calls = []
    model.layer_hook = lambda i, h: calls.append((i, tuple(h.shape), h.dtype))
    ids = random_ids(5, batch=3)
    with torch.no_grad():
        model(ids)
    n = model.config.num_layers
    assert calls == [(i, (3, 5, HIDDEN), torch.float32) for i in range(n)]

    calls.clear()
    cache = kvcache.make_cache(model, cache_length=8, batch_size=3)
    with torch.no_grad():
        model(ids, cache)
        model(ids[:, :1], cache)
    assert calls == [(i, (3, 5, HIDDEN), torch.float32) for i in range(n)] + [
        (i, (3, 1, HIDDEN), torch.float32) for i in range(n)
    ]


def test_layer_hook_sees_the_block_inputs(clean_hook, llama_ckpt):
    """The hidden state handed to hook ``i`` is the input of block ``i`` (transformers' hidden_states[i])."""
    model = clean_hook
    seen = {}
    model.layer_hook = lambda i, h: seen.__setitem__(i, h.clone())
    ids = random_ids(9, batch=2, seed=4)
    with torch.no_grad():
        model(ids)
        ref = llama_ckpt.hf(ids, output_hidden_states=True).hidden_states
    for i in range(model.config.num_layers):
        assert max_diff(seen[i], ref[i]) <= atol("cache")


def test_layer_hook_returning_none_or_input_changes_nothing(clean_hook):
    model = clean_hook
    ids = random_ids(6, batch=2)
    with torch.no_grad():
        ref = model(ids)
        model.layer_hook = lambda i, h: None
        assert torch.equal(model(ids), ref)
        model.layer_hook = lambda i, h: h.clone()
        assert torch.equal(model(ids), ref)


def test_layer_hook_return_replaces_the_input(clean_hook):
    model = clean_hook
    ids = random_ids(6, batch=2)
    with torch.no_grad():
        ref = model(ids)
        # Zeroing the input of the last block changes the output...
        last = model.config.num_layers - 1
        model.layer_hook = lambda i, h: torch.zeros_like(h) if i == last else None
        zeroed = model(ids)
        assert max_diff(zeroed, ref) > 0.1
        # ... to exactly what the last block and the head make of a zero input, whatever the tokens.
        other = model(random_ids(6, batch=2, seed=9))
        assert max_diff(zeroed, other) <= atol("same")

        # Replacing layer 1's input with layer 0's input skips layer 0.
        kept = {}

        def skip_first(i, h):
            if i == 0:
                kept[0] = h
            return kept[0] if i == 1 else None

        model.layer_hook = skip_first
        skipped = model(ids)
        model.layer_hook = None
        x = model.embed_tokens(ids)
        cos, sin = rope_angles(model.inv_freq, torch.arange(6, device=DEVICE)[None], torch.float32)
        for block in model.layers[1:]:
            x = block(x, cos, sin, None, None)
        expected = model.lm_head(model.norm(x))
        assert max_diff(skipped, expected) <= atol("cache")


def test_skip_lm_head_returns_final_hidden(llama, llama_ckpt):
    ids = random_ids(7, batch=2, seed=5)
    with torch.no_grad():
        hidden = llama(ids, skip_lm_head=True)
        logits = llama(ids)
        ref = llama_ckpt.hf.model(ids).last_hidden_state
    assert hidden.shape == (2, 7, llama.config.hidden_size)
    assert torch.allclose(llama.lm_head(hidden), logits, atol=atol("same"))
    assert max_diff(hidden, ref) <= atol("hf")


def test_last_only_without_cache(llama):
    ids = random_ids(7, batch=2, seed=6)
    with torch.no_grad():
        full = llama(ids)
        last = llama(ids, last_only=True)
        hidden = llama(ids, last_only=True, skip_lm_head=True)
    assert last.shape == (2, 1, VOCAB)
    assert hidden.shape == (2, 1, HIDDEN)
    assert torch.allclose(last, full[:, -1:], atol=atol("same"))


def test_last_only_with_ragged_cache(llama):
    ids = random_ids(7, batch=3, seed=7)
    n = [7, 2, 5]
    with torch.no_grad():
        cache = kvcache.make_cache(llama, cache_length=7, batch_size=3)
        last = llama(ids, cache, n_tokens=n, last_only=True)
        assert last.shape == (3, 1, VOCAB)
        for b, k in enumerate(n):
            alone = llama(ids[b : b + 1, :k])[:, -1]
            assert max_diff(last[b], alone) <= atol("cache")


def test_int32_input_ids_accepted(llama):
    ids = random_ids(5, batch=2)
    with torch.no_grad():
        assert torch.equal(llama(ids.to(torch.int32)), llama(ids))


# --- bad inputs --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "ids",
    [
        torch.tensor([3, 4, 5], device=DEVICE),  # 1-D
        torch.tensor([[[3, 4, 5]]], device=DEVICE),  # 3-D
        torch.tensor([[3.0, 4.0, 5.0]], device=DEVICE),  # float
        torch.tensor([[True, False]], device=DEVICE),  # bool
        torch.zeros(2, 0, dtype=torch.long, device=DEVICE),  # no tokens
    ],
    ids=["1d", "3d", "float", "bool", "empty"],
)
def test_bad_input_ids_rejected(llama, ids):
    with pytest.raises(ValueError, match="input_ids"):
        llama(ids)


def test_bad_input_ids_rejected_with_cache_leaves_cache(llama):
    cache = kvcache.make_cache(llama, cache_length=8, batch_size=1)
    with pytest.raises(ValueError):
        llama(torch.tensor([[3.0, 4.0]], device=DEVICE), cache)
    assert cache.lengths.tolist() == [0]


def test_n_tokens_without_cache_rejected(llama):
    with pytest.raises(ValueError, match="n_tokens"):
        llama(random_ids(4, batch=2), n_tokens=[4, 2])


def test_token_ids_outside_vocabulary_name_ids_and_vocab_size(llama):
    with pytest.raises(ValueError, match=r"outside \[0, 128\).*\[8192\]"):
        llama(torch.tensor([[5, 8192]], device=DEVICE))


# --- positions past max_position_embeddings ------------------------------------------------------


@pytest.fixture
def short_context(llama):
    """A model like ``llama`` configured for positions 0..7 only."""
    torch.manual_seed(0)
    return kvcache.Transformer(dataclasses.replace(llama.config, max_position_embeddings=8)).eval().to(DEVICE)


def _position_warnings(record) -> list[str]:
    return [str(w.message) for w in record if "max_position_embeddings" in str(w.message)]


def test_no_warning_up_to_max_positions(short_context):
    cache = kvcache.make_cache(short_context, cache_length=8)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with torch.inference_mode():
            short_context(random_ids(8))
            short_context(random_ids(5), cache)
            short_context(random_ids(3), cache)
    assert _position_warnings(record) == []


def test_warns_once_past_max_positions_without_cache(short_context):
    with torch.inference_mode():
        with pytest.warns(UserWarning, match=r"position 9, beyond the model's max_position_embeddings=8"):
            short_context(random_ids(10))
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            short_context(random_ids(12))
    assert _position_warnings(record) == []


def test_warns_once_past_max_positions_with_cache(short_context):
    cache = kvcache.make_cache(short_context, "window", cache_length=4, batch_size=2)
    with torch.inference_mode():
        short_context(random_ids(6, batch=2), cache, n_tokens=[6, 2])
        # Row 0 reaches position 8 (its 9th token); row 1 only position 4.
        with pytest.warns(UserWarning, match=r"position 8, beyond the model's max_position_embeddings=8"):
            short_context(random_ids(3, batch=2), cache, n_tokens=[3, 3])
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            for _ in range(3):
                short_context(random_ids(1, batch=2), cache)
    assert _position_warnings(record) == []


def test_the_head_layout_changes_no_result(model_factory):
    """kvcache.load keeps the head hidden-major on the CPU (a faster matrix-vector product there);
    laid out row-major the model gives the same logits, within float32's reordering of a sum."""
    model = model_factory("qwen2")  # tied: the embedding moves with the head
    ids = random_ids(9, batch=2, seed=4)
    with torch.no_grad():
        before = model(ids)
        model.lay_out_head(hidden_major=False)
        try:
            assert model.lm_head.weight.is_contiguous() and model.embed_tokens.weight is model.lm_head.weight
            assert max_diff(model(ids), before) <= atol("same")
        finally:
            model.lay_out_head(hidden_major=DEVICE.type == "cpu")
    assert model.lm_head.weight.t().is_contiguous() == (DEVICE.type == "cpu")
