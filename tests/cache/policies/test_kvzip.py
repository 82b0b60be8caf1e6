"""kvzip keeps, per K/V head, the keys most attended while the model repeats the context: checked
against explicit attention weights of a no-cache forward over context + repeat prompt + context."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import DEVICE, max_diff
from policy_util import EXACT_ATOL

import kvcache
from kvcache.generation import reconstruction as kvzip
from kvcache.model.rope import apply_rope

REPEAT = [5, 9, 17, 33]


def context_ids(n: int, seed: int = 3) -> torch.Tensor:
    from conftest import random_ids

    return random_ids(n, seed=seed)


@torch.inference_mode()
def reference_scores(model, call: torch.Tensor, n: int) -> list[torch.Tensor]:
    """Per layer, (Hkv, n): the largest explicit softmax weight any reconstruction query (the
    tokens of ``call`` after its first ``n``) gives each context key, over the query heads of its
    group, in a no-cache causal forward of ``call`` (1, T)."""
    inputs = {}
    hooks = [layer.self_attn.register_forward_pre_hook(
        lambda mod, args, i=i: inputs.__setitem__(i, args[:3])) for i, layer in enumerate(model.layers)]
    try:
        model(call)
    finally:
        for h in hooks:
            h.remove()
    cfg = model.config
    D, T = cfg.head_dim, call.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=call.device).tril()
    out = []
    for i, layer in enumerate(model.layers):
        x, cos, sin = inputs[i]
        attn = layer.self_attn
        q = apply_rope(attn.q_proj(x).view(1, T, -1, D), cos.unsqueeze(2), sin.unsqueeze(2)).transpose(1, 2)[0]
        k = apply_rope(attn.k_proj(x).view(1, T, -1, D), cos.unsqueeze(2), sin.unsqueeze(2)).transpose(1, 2)[0]
        G = q.shape[0] // k.shape[0]
        k = k.repeat_interleave(G, 0)  # (Hq, T, D)
        w = (q.float() @ k.float().transpose(-1, -2) / D**0.5).masked_fill(~causal, float("-inf")).softmax(-1)
        best = w[:, n:, :n].amax(1)  # (Hq, n): over the reconstruction queries
        out.append(best.view(-1, G, n).amax(1))  # over the group
    return out


def held(layer, b: int = 0) -> list[set[int]]:
    pos = layer.storage.pos[b, :, : layer.spec.cache_length]
    return [set(p[p >= 0].tolist()) for p in pos]


@pytest.mark.parametrize("sinks,reserve", [(0, 0), (2, 3)])
def test_kept_keys_and_scores_match_explicit_reconstruction_attention(llama, sinks, reserve):
    n, C = 30, 12
    ctx = context_ids(n)
    call = torch.cat((ctx, torch.tensor([REPEAT], device=ctx.device), ctx), 1)
    expected = reference_scores(llama, call, n)
    with torch.inference_mode():
        cache = kvcache.make_cache(llama, "kvzip", cache_length=C, reserve=reserve, options={"sinks": sinks})
        logits = kvzip.prefill(llama, cache, ctx, repeat=REPEAT)
        # The context part is attended as any prefill attends it.
        assert max_diff(logits, llama(ctx)[:, -1]) <= EXACT_ATOL[torch.float32]
    assert cache.lengths.tolist() == [n]
    kept = C - reserve
    for layer, ref in zip(cache.layers, expected):
        assert int(layer.held[0]) == kept
        for h, got in enumerate(held(layer)):
            rest = [int(p) for p in ref[h].argsort(descending=True) if p >= sinks]
            assert got == set(range(sinks)) | set(rest[: kept - sinks]), (h, got)
            # The stored scores are the reference's, slot by slot.
            pos = layer.storage.pos[0, h, :kept]
            torch.testing.assert_close(layer.stats["score"][0, h, :kept], ref[h][pos].float(), atol=1e-5, rtol=1e-4)


def test_a_budget_covering_the_sequence_is_the_dense_cache(llama):
    ctx, rest = context_ids(24), context_ids(5, seed=8)
    total = 24 + 5 + 6
    with torch.inference_mode():
        cache = kvcache.make_cache(llama, "kvzip", cache_length=total)
        logits = kvzip.prefill(llama, cache, ctx, repeat=REPEAT)
        dense = kvcache.make_cache(llama, "dense", cache_length=total)
        assert torch.equal(logits, llama(ctx, dense, last_only=True)[:, 0])
        # The next chunk: equal within the cache tolerance, as every policy's covering budget is
        # (bitwise on the CPU; on CUDA a dense chunk and an evicting cache's chunk attend
        # different numbers of slots, which CUDA's kernels sum in different orders).
        assert max_diff(llama(rest, cache), llama(rest, dense)) <= EXACT_ATOL[torch.float32]
        for layer, ref in zip(cache.layers, dense.layers):
            # The context's keys bitwise; the chunk's, past the first layer, come from those outputs.
            assert torch.equal(layer.storage.k[0, :, :24], ref.storage.k[0, :, :24])
            assert max_diff(layer.storage.k[0, :, 24:29], ref.storage.k[0, :, 24:29]) <= EXACT_ATOL[torch.float32]
        cache = kvcache.make_cache(llama, "kvzip", cache_length=total)
        got = kvzip.generate(llama, cache, ctx, rest, repeat=REPEAT, max_new_tokens=6, stop_tokens=())
    want = kvcache.generate(llama, torch.cat((ctx, rest), 1)[0], max_new_tokens=6, prefill_chunk=24, stop_tokens=())
    assert got == [want]


def test_a_chunked_context_keeps_the_best_over_every_pass(llama):
    n, C, chunk = 40, 12, 16
    ctx = context_ids(n, seed=5)
    with torch.inference_mode():
        cache = kvcache.make_cache(llama, "kvzip", cache_length=C, options={"sinks": 1})
        kvzip.prefill(llama, cache, ctx, repeat=REPEAT, chunk=chunk)
        # The first chunk alone overflows too: its pass is the single-pass reference's.
        first = kvcache.make_cache(llama, "kvzip", cache_length=C, options={"sinks": 1})
        kvzip.prefill(llama, first, ctx[:, :chunk], repeat=REPEAT)
    call = torch.cat((ctx[:, :chunk], torch.tensor([REPEAT], device=ctx.device), ctx[:, :chunk]), 1)
    ref = reference_scores(llama, call, chunk)
    assert cache.lengths.tolist() == [n]
    for layer, one, r in zip(cache.layers, first.layers, ref):
        for h in range(layer.spec.num_kv_heads):
            best = [int(p) for p in r[h].argsort(descending=True) if p >= 1][: C - 1]
            assert held(one)[h] == {0} | set(best)
        assert int(layer.held[0]) == C
        for h, got in enumerate(held(layer)):
            assert 0 in got and len(got) == C and max(got) < n
            # Every kept token was scored by a pass, and the scores are attention weights.
            assert bool((layer.stats["scored"][0, h, :C] == 1).all())
            assert bool((layer.stats["score"][0, h, :C] <= 1).all())


def test_tokens_after_the_context_grow_into_the_reserve_then_the_unscored_go_first(llama):
    n, C, R = 30, 10, 4
    ctx, more = context_ids(n), context_ids(8, seed=9)
    with torch.inference_mode():
        cache = kvcache.make_cache(llama, "kvzip", cache_length=C, reserve=R, options={"sinks": 1})
        kvzip.prefill(llama, cache, ctx, repeat=REPEAT)
        chosen = [held(layer) for layer in cache.layers]
        weakest = [[int(layer.storage.pos[0, h, int(layer.stats["score"][0, h, 1 : C - R].argmin()) + 1])
                    for h in range(layer.spec.num_kv_heads)] for layer in cache.layers]
        for t in range(R):
            llama(more[:, t : t + 1], cache)
        grown = [held(layer) for layer in cache.layers]
        for t in range(R, 8):
            llama(more[:, t : t + 1], cache)
    for layer, before, after, weak in zip(cache.layers, chosen, grown, weakest):
        for h, got in enumerate(held(layer)):
            # The reserve takes the next R tokens with nothing evicted.
            assert after[h] == before[h] | set(range(n, n + R))
            # The next token overflows: the row keeps C - R, the unscored tokens go first, then the
            # weakest context token (the newest stays); the rest is appended again.
            assert got == (before[h] - {weak[h]}) | set(range(n + R, n + 8)), (h, got)


def test_plain_generate_keeps_a_window_and_sinks(llama):
    ids = context_ids(20)
    with torch.inference_mode():
        cache = kvcache.make_cache(llama, "kvzip", cache_length=8, options={"sinks": 2})
        with pytest.warns(kvcache.errors.KVCacheWarning, match="outside its reconstruction pass"):
            llama(ids, cache)
    for layer in cache.layers:
        assert all(got == {0, 1} | set(range(14, 20)) for got in held(layer))


def test_the_pass_is_refused_where_it_cannot_run(llama):
    ctx = context_ids(20)
    with torch.inference_mode():
        dense = kvcache.make_cache(llama, "dense", cache_length=40)
        with pytest.raises(ValueError, match="kvzip cache in every layer"):
            kvzip.prefill(llama, dense, ctx, repeat=REPEAT)
        headwise = kvcache.make_cache(llama, "kvzip", cache_length=8,
                                      head_budgets=[[6, 10]] * llama.config.num_layers)
        with pytest.raises(ValueError, match="without head_budgets"):
            kvzip.prefill(llama, headwise, ctx, repeat=REPEAT)
        cache = kvcache.make_cache(llama, "kvzip", cache_length=8, batch_size=2)
        with pytest.raises(ValueError, match="batch_size=2"):
            kvzip.prefill(llama, cache, ctx, repeat=REPEAT)
        with pytest.raises(ValueError, match="chunk"):
            kvzip.prefill(llama, kvcache.make_cache(llama, "kvzip", cache_length=8), ctx, repeat=REPEAT, chunk=0)
        with pytest.raises(ValueError, match="repeat"):
            kvzip.prefill(llama, kvcache.make_cache(llama, "kvzip", cache_length=8), ctx, repeat=[])
    # A refused call left the cache as it was.
    assert cache.lengths.tolist() == [0, 0]
    with pytest.raises(ValueError, match="sinks"):
        kvcache.make_cache(llama, "kvzip", cache_length=8, options={"sinks": -1})


def test_listed_by_the_registry_and_the_command_line(capsys):
    assert "kvzip" in kvcache.policies()
    assert [o.name for o in kvcache.option_info("kvzip")] == ["sinks"]
    from kvcache.cli import main

    main(["policies"])
    assert "kvzip" in capsys.readouterr().out


@pytest.mark.parametrize("policy,block", [("kvzip:int8", 1), ("kvzip:kivi4", 1), ("kvzip", 4)])
def test_the_pass_runs_over_quantized_storages_and_whole_blocks(llama, policy, block):
    n, C, R = 40, 16, 4
    ctx = context_ids(n, seed=11)
    with torch.inference_mode():
        cache = kvcache.make_cache(llama, policy, cache_length=C, reserve=R, block=block, options={"sinks": 0})
        kvzip.prefill(llama, cache, ctx, repeat=REPEAT, chunk=24)
    assert cache.lengths.tolist() == [n]
    for layer in cache.layers:
        for got in held(layer):
            assert 0 < len(got) <= C - R and max(got) < n
            if block > 1:
                # Whole aligned blocks (the newest, partial one may be cut at the context's end).
                assert all({b - b % block + i for i in range(block)} <= got | set(range(n, n + block)) for b in got)


def test_rows_of_a_batch_are_compressed_as_alone(llama):
    from conftest import random_ids

    ctx, rest = random_ids(30, batch=2, seed=21), random_ids(4, batch=2, seed=22)
    with torch.inference_mode():
        both = kvzip.generate(llama, kvcache.make_cache(llama, "kvzip", cache_length=14, reserve=6, batch_size=2),
                              ctx, rest, repeat=REPEAT, max_new_tokens=5, stop_tokens=())
        alone = [kvzip.generate(llama, kvcache.make_cache(llama, "kvzip", cache_length=14, reserve=6),
                                ctx[b], rest[b], repeat=REPEAT, max_new_tokens=5, stop_tokens=())[0] for b in range(2)]
    assert both == alone


def test_the_pass_rejects_ids_outside_the_vocabulary_before_touching_the_cache(llama):
    cache = kvcache.make_cache(llama, "kvzip", cache_length=8)
    ids = torch.full((1, 12), llama.config.vocab_size + 3, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="outside"):
        kvzip.prefill(llama, cache, ids, repeat=[5, 6])
    assert cache.lengths.tolist() == [0] and bool((cache.layers[0].storage.pos == -1).all())


@pytest.mark.parametrize("block", [1, 4])
def test_one_scored_pass_fills_caches_of_every_budget_as_their_own_passes(llama, block):
    """``score`` once, then ``take`` into caches of three budgets (with and without sinks and a
    reserve, two rows): each holds bit for bit what its own ``prefill`` leaves, and a next chunk
    that fits its reserve gives the same logits."""
    from conftest import random_ids

    n = 30
    ctx, rest = random_ids(n, batch=2, seed=31), random_ids(4, batch=2, seed=32)
    with torch.inference_mode():
        scored = kvcache.make_cache(llama, "kvzip", cache_length=n, batch_size=2, block=block)
        logits = kvzip.score(llama, scored, ctx, repeat=REPEAT)
        for C, reserve, sinks in [(8, 0, 0), (16, 4, 2), (29, 0, 4)]:
            def make():
                return kvcache.make_cache(llama, "kvzip", cache_length=C, reserve=reserve, batch_size=2,
                                          block=block, options={"sinks": sinks})

            own, taken = make(), make()
            assert torch.equal(kvzip.prefill(llama, own, ctx, repeat=REPEAT, chunk=None), logits)
            kvzip.take(taken, scored)
            assert taken.lengths.tolist() == own.lengths.tolist() == [n, n]
            for a, b in zip(taken.layers, own.layers):
                assert set(a.state()) == set(b.state())
                assert all(torch.equal(a.state()[name], b.state()[name]) for name in a.state()), C
            if reserve >= rest.shape[1]:
                assert torch.equal(llama(rest, taken), llama(rest, own))
    assert scored.lengths.tolist() == [n, n]  # take read it and left it as it was


def test_score_and_take_refuse_what_they_cannot_do(llama):
    ctx = context_ids(20)
    with torch.inference_mode():
        with pytest.raises(ValueError, match="cache_length=20"):
            kvzip.score(llama, kvcache.make_cache(llama, "kvzip", cache_length=12), ctx, repeat=REPEAT)
        with pytest.raises(ValueError, match="full-precision"):
            kvzip.score(llama, kvcache.make_cache(llama, "kvzip:int8", cache_length=20), ctx, repeat=REPEAT)
        scored = kvcache.make_cache(llama, "kvzip", cache_length=20)
        target = kvcache.make_cache(llama, "kvzip", cache_length=8)
        with pytest.raises(ValueError, match="filled by score"):
            kvzip.take(target, scored)
        kvzip.score(llama, scored, ctx, repeat=REPEAT)
        with pytest.raises(ValueError, match="empty cache"):
            kvzip.score(llama, scored, ctx, repeat=REPEAT)
        with pytest.raises(ValueError, match="nothing to evict"):
            kvzip.take(kvcache.make_cache(llama, "kvzip", cache_length=20), scored)
        with pytest.raises(ValueError, match="full-precision"):
            kvzip.take(kvcache.make_cache(llama, "kvzip:int8", cache_length=8), scored)
        with pytest.raises(ValueError, match="kvzip cache in every layer"):
            kvzip.take(kvcache.make_cache(llama, "dense", cache_length=8), scored)
        half = copy.deepcopy(llama).to(torch.float16)
        with pytest.raises(ValueError, match="dtype"):
            kvzip.take(kvcache.make_cache(half, "kvzip", cache_length=8), scored)
        kvzip.take(target, scored)
        kept = {name: t.clone() for name, t in target.layers[0].state().items()}
        # A refused take leaves the cache it would have filled as it was.
        with pytest.raises(ValueError, match="filled by score"):
            kvzip.take(target, kvcache.make_cache(llama, "kvzip", cache_length=20))
    assert target.lengths.tolist() == [20] and scored.lengths.tolist() == [20]
    assert all(torch.equal(t, kept[name]) for name, t in target.layers[0].state().items())
