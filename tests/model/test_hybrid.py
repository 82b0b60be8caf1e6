"""Models that mix sliding-window and global layers (Gemma 3, Qwen2/Qwen3 with use_sliding_window):
each layer's cache has its own geometry, a sliding layer holds a ring of its window (exact for any
chunking), and a policy acts where the cache grows, on the global layers."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import CACHE_ATOL, DEVICE, HF_ATOL, HYBRID, SCORED, WINDOW, atol, max_diff, random_ids

import kvcache
from kvcache.generation.compiled import CompiledDecode

ATOL = CACHE_ATOL[torch.float32]
T = 80  # past the window many times over: chunks of 1, 7 and 64 tokens all cross it
SCORING = ["h2o", "sink", "snapkv", "tova"]
# (Gemma 2 and gpt-oss are hybrid too; tests/model/test_scored.py runs them through the policies.)


def feed(model, ids, cache, chunk):
    """Logits of ``ids`` (B, T) fed through ``cache`` ``chunk`` tokens at a time."""
    return torch.cat([model(ids[:, i:i + chunk], cache) for i in range(0, ids.shape[1], chunk)], dim=1)


def sliding(model) -> list[bool]:
    return [layer.sliding for layer in model.config.layers]


@pytest.mark.parametrize("family", HYBRID + SCORED)
def test_the_family_has_both_kinds_of_layer(model_factory, family):
    kinds = sliding(model_factory(family))
    assert any(kinds) and not all(kinds)


@pytest.mark.parametrize("chunk", [1, 7, 64])
@pytest.mark.parametrize("family", HYBRID + SCORED)
def test_chunked_prefill_equals_one_pass_and_transformers(checkpoint_factory, model_factory, family, chunk):
    model = model_factory(family)
    ids = random_ids(T, batch=2, seed=5)
    with torch.inference_mode():
        ref = checkpoint_factory(family).hf(ids).logits
        full = model(ids)
        cache = kvcache.make_cache(model, cache_length=T, batch_size=2)
        chunked = feed(model, ids, cache, chunk)
    assert ref.std() > 0.3
    assert max_diff(full, ref) <= HF_ATOL[torch.float32]
    assert max_diff(chunked, full) <= ATOL, f"{family}, chunks of {chunk}"


@pytest.mark.parametrize("family", HYBRID + SCORED)
def test_greedy_tokens_equal_transformers_generate(checkpoint_factory, model_factory, family):
    model = model_factory(family)
    ids = random_ids(12, batch=2, seed=6)
    with torch.no_grad():
        ref = checkpoint_factory(family).hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                                     max_new_tokens=32, eos_token_id=None, pad_token_id=0)
    assert kvcache.generate(model, ids.tolist(), max_new_tokens=32, stop_tokens=()) == ref[:, 12:].tolist()


@pytest.mark.parametrize("family", HYBRID + SCORED)
def test_ragged_rows_equal_each_row_alone(model_factory, family):
    model = model_factory(family)
    rows = [random_ids(n, seed=40 + n)[0] for n in (30, 9, 21)]
    schedule = [[11, 2, 0], [1, 0, 9], [7, 6, 12], [11, 1, 0]]
    cache = kvcache.make_cache(model, cache_length=30, batch_size=3)
    got = [[] for _ in rows]
    done = [0, 0, 0]
    with torch.inference_mode():
        for n in schedule:
            width = max(n)
            ids = torch.zeros(3, width, dtype=torch.long, device=DEVICE)
            for b, row in enumerate(rows):
                ids[b, :n[b]] = row[done[b]:done[b] + n[b]]
            logits = model(ids, cache, n_tokens=n)
            for b in range(3):
                got[b].append(logits[b, :n[b]])
                done[b] += n[b]
        for b, row in enumerate(rows):
            assert max_diff(torch.cat(got[b]), model(row[None])[0]) <= ATOL, f"row {b}"


def test_sliding_layers_hold_a_ring_of_their_window(model_factory):
    model = model_factory("gemma3")
    cache = kvcache.make_cache(model, cache_length=T)
    for layer, is_sliding in zip(cache.layers, sliding(model)):
        if is_sliding:
            assert (layer.name, layer.spec.cache_length, layer.spec.sliding_window) == ("window", WINDOW, WINDOW)
        else:
            assert (layer.name, layer.spec.cache_length, layer.spec.sliding_window) == ("dense", T, None)
    # The dense cache's capacity is its global layers': the rings never fill.
    assert cache.max_tokens == T


def test_sliding_layers_cost_their_window_only(model_factory):
    """At 4096 tokens the tiny Gemma 3 (2 sliding layers of window 8, 1 global) holds a third of
    an all-global cache, plus the rings."""
    model = model_factory("gemma3")
    all_global = kvcache.Transformer(dataclasses.replace(model.config, layer_types=("full_attention",) * 3))
    all_global.to(DEVICE)
    caches = [kvcache.make_cache(m, cache_length=4096) for m in (model, all_global)]
    for cache in caches:
        cache.allocate()  # every slot of the global layers, which allocate as they fill
    hybrid, full = (cache.nbytes() for cache in caches)
    per_layer = full / 3
    assert per_layer < hybrid < per_layer * 1.01


def test_a_dense_cache_rejects_a_row_past_its_global_capacity(model_factory):
    model = model_factory("gemma3")
    ids = random_ids(T + 1, seed=7)
    cache = kvcache.make_cache(model, cache_length=T)
    with torch.inference_mode():
        model(ids[:, :T], cache)
        with pytest.raises(kvcache.CapacityError):
            model(ids[:, T:], cache)
    assert cache.lengths.tolist() == [T]


@pytest.mark.parametrize("policy", SCORING)
def test_policies_act_on_the_global_layers(model_factory, policy):
    model = model_factory("gemma3")
    budget = 16
    cache = kvcache.make_cache(model, policy, cache_length=budget)
    names = [layer.name for layer in cache.layers]
    assert names == ["window" if s else policy for s in sliding(model)]
    assert cache.max_tokens is None  # every layer bounds itself
    ids = random_ids(3 * T, seed=8)
    with torch.inference_mode():
        out = feed(model, ids, cache, 32)
        held = [int((layer.storage.pos[0] >= 0).sum(-1).max()) for layer in cache.layers]
    assert torch.isfinite(out).all()
    assert held == [WINDOW if s else budget for s in sliding(model)]


@pytest.mark.parametrize("policy", ["dense", *SCORING])
def test_a_budget_covering_the_sequence_equals_the_plain_forward(model_factory, policy):
    model = model_factory("gemma3")
    ids = random_ids(T, batch=2, seed=9)
    with torch.inference_mode():
        full = model(ids)
        cache = kvcache.make_cache(model, policy, cache_length=T, batch_size=2)
        assert max_diff(feed(model, ids, cache, 7), full) <= ATOL


def test_a_budget_below_the_window_leaves_sliding_layers_to_the_policy(model_factory):
    """cache_length 4 < window 8: every layer runs the policy at 4 slots, sliding layers with their
    window on top (a dense cache of 4 tokens holds fewer than any window)."""
    model = model_factory("gemma3")
    cache = kvcache.make_cache(model, "tova", cache_length=4)
    assert [layer.name for layer in cache.layers] == ["tova"] * 3
    assert [layer.spec.sliding_window for layer in cache.layers] == [WINDOW, WINDOW, None]
    ids = random_ids(4, seed=10)
    with torch.inference_mode():
        dense = kvcache.make_cache(model, cache_length=4)
        assert max_diff(model(ids, dense), model(ids)) <= ATOL


@pytest.mark.parametrize("policy,options", [("dense", {}), ("h2o", {"recent": 2}), ("sink", {"sinks": 2})])
def test_captured_decode_step_matches_eager(model_factory, policy, options):
    model = model_factory("gemma3")
    ids = random_ids(12 + 10, batch=2, seed=11)
    C = 24 if policy == "dense" else 10
    torch._dynamo.reset()

    def run(capture: bool):
        cache = kvcache.make_cache(model, policy, cache_length=C, batch_size=2, options=options)
        with torch.inference_mode():
            model(ids[:, :12], cache, n_tokens=[12, 9])
            step = CompiledDecode(model, cache, backend="aot_eager") if capture else (lambda t: model(t, cache)[:, -1])
            return torch.stack([step(ids[:, 12 + i:13 + i]) for i in range(10)])

    try:
        assert max_diff(run(True), run(False)) <= atol("compiled")
    finally:
        torch._dynamo.reset()


REPEAT = [5, 9, 17, 33]


def test_kvzip_reconstructs_through_the_rings_of_sliding_layers(model_factory):
    """kvzip's pass scores the global layers; a sliding layer's ring attends the reconstruction
    and ends holding the context's last window, as an ordinary prefill of the context leaves it."""
    from kvcache.generation import reconstruction as kvzip

    model = model_factory("gemma3")
    n = 40
    ctx, rest = random_ids(n, batch=2, seed=12), random_ids(3, batch=2, seed=13)
    rings = [i for i, s in enumerate(sliding(model)) if s]
    with torch.inference_mode():
        compressed = kvcache.make_cache(model, "kvzip", cache_length=20, reserve=4, batch_size=2)
        kvzip.prefill(model, compressed, ctx, repeat=REPEAT, chunk=None)
        dense = kvcache.make_cache(model, cache_length=n + 3, batch_size=2)
        model(ctx, dense)
        for i in rings:
            assert torch.equal(compressed.layers[i].storage.pos, dense.layers[i].storage.pos), f"layer {i}"
            # (The same keys, computed in a longer call: matmul shapes differ.)
            assert max_diff(compressed.layers[i].storage.k, dense.layers[i].storage.k) <= ATOL, f"layer {i}"
        # One scored pass fills a cache of a smaller budget as its own pass would.
        scored = kvcache.make_cache(model, "kvzip", cache_length=n, batch_size=2)
        kvzip.score(model, scored, ctx, repeat=REPEAT)
        taken = kvcache.make_cache(model, "kvzip", cache_length=20, reserve=4, batch_size=2)
        kvzip.take(taken, scored)
        for a, b in zip(taken.layers, compressed.layers):
            assert all(torch.equal(a.state()[name], b.state()[name]) for name in a.state())
        assert torch.equal(model(rest, taken), model(rest, compressed))


@pytest.mark.parametrize("policy", ["dense", "h2o"])
def test_a_stored_prefix_is_reused_bitwise_in_aligned_mode(model_factory, policy):
    """The prefix store keeps whole-row snapshots of a hybrid cache (its rings cannot be cut at
    any boundary): reusing one gives the logits and cache of a run without the store, bit for bit."""
    from kvcache.generation.prefill import prefill
    from kvcache.prefix.store import PrefixStore

    model = model_factory("gemma3")
    prefix = random_ids(40, seed=14)[0].tolist()
    prompts = [prefix + random_ids(n, seed=15 + n)[0].tolist() for n in (5, 11)]

    def run(store):
        cache = kvcache.make_cache(model, policy, cache_length=64 if policy == "dense" else 20, batch_size=2)
        with torch.inference_mode():
            return prefill(model, cache, prompts, chunk=16, store=store, aligned=True), cache

    store = PrefixStore(model)
    with torch.inference_mode():
        prefill(model, kvcache.make_cache(model, policy, cache_length=64 if policy == "dense" else 20),
                [prefix + [7]], chunk=16, store=store, aligned=True)
    assert store.reusable(prompts[0]) == 32
    (want, ref), (got, reused) = run(None), run(store)
    assert torch.equal(want, got)
    a, b = ref.snapshot().tensors(), reused.snapshot().tensors()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("family", HYBRID + SCORED)
def test_chunked_loss_through_the_rings_equals_full_backprop(model_factory, family):
    """Fine-tuning's chunked loss over a dense cache whose sliding layers are rings: the loss and
    every gradient of a full-sequence backward (chunks crossing the window)."""
    from train_util import gradients, plain_loss, relative_errors

    model = model_factory(family)
    ids = random_ids(40, batch=2, seed=16)
    want_loss, want = gradients(model, lambda: plain_loss(model, ids))
    got_loss, got = gradients(model, lambda: kvcache.chunked_loss(model, ids, chunk=[7, 13, 20]))
    assert abs(got_loss - want_loss) <= 1e-5 * abs(want_loss)
    assert max(relative_errors(got, want).values()) <= 1e-5


@pytest.mark.parametrize("policy", ["h2o", "sink", "tova"])
def test_chunked_loss_under_a_policy_matches_the_masked_reference(model_factory, policy):
    """A bounded cache on the global layers and rings on the sliding ones: the gradient of the
    full forward under the masks of what each layer kept (train_util.reference_loss)."""
    from train_util import gradients, loss_args, record_held, reference_loss, relative_errors

    from kvcache.cache.registry import budget_options

    model = model_factory("gemma3")
    ids = random_ids(36, batch=2, seed=17)
    sizes, C = [9, 9, 18], 12
    options = budget_options(policy, C)
    cache, held = record_held(model, ids, policy, C, sizes, **options)
    assert [layer.name for layer in cache.layers] == ["window" if s else policy for s in sliding(model)]
    want_loss, want = gradients(model, lambda: reference_loss(model, ids, cache, held, sizes))
    got_loss, got = gradients(model, lambda: kvcache.chunked_loss(model, ids, policy=policy, cache_length=C,
                                                                  chunk=sizes, **loss_args(options)))
    assert abs(got_loss - want_loss) <= 1e-5 * abs(want_loss)
    assert max(relative_errors(got, want).values()) <= 1e-5


def test_pyramid_budgets_and_head_budgets_leave_the_rings_alone(model_factory):
    model = model_factory("gemma3")
    ids = random_ids(48, seed=18)
    pyramid = kvcache.make_cache(model, "h2o", cache_length=16, allocation="pyramid")
    budgets = kvcache.adaptive_head_budgets(model, ids, cache_length=16)
    headwise = kvcache.make_cache(model, "snapkv", cache_length=16, head_budgets=budgets)
    for cache in (pyramid, headwise):
        assert [layer.spec.cache_length == WINDOW for layer in cache.layers[:2]] == [True, True]
        with torch.inference_mode():
            assert torch.isfinite(feed(model, ids, cache, 16)).all()


def test_the_language_model_of_a_gemma3_image_and_text_checkpoint_loads(tmp_path):
    """Gemma3ForConditionalGeneration: its text model's config and weights (under
    model.language_model), without the image tower, give transformers' logits on text."""
    import transformers

    text = transformers.Gemma3TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"])
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=14)
    torch.manual_seed(19)
    hf = transformers.Gemma3ForConditionalGeneration(transformers.Gemma3Config(
        text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(0.3 * torch.randn(p.shape))
    hf.save_pretrained(tmp_path)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no tensor left over: the image tower is left out by name
        model = kvcache.load(tmp_path, device=DEVICE)
    assert model.config.model_type == "gemma3_text" and sliding(model) == [True, True, False]
    ids = random_ids(20, seed=20)
    with torch.no_grad():
        assert max_diff(model(ids), hf.to(DEVICE)(input_ids=ids).logits) <= HF_ATOL[torch.float32]
