"""Storages (full, int8, int4) under policies: bytes, quantization error, logits against full
precision, eviction that depends on positions alone, the scratch slot, and the names."""

from __future__ import annotations

import pytest
import torch

import kvcache
from kvcache.cache import CacheSpec
from kvcache.cache.quantized import QuantizedStorage
from kvcache.cache.storage import FullStorage, make_storage
from kvcache.cli import main
from policy_util import check_storage, feed, feed_alone, ids_for, max_diff

CPU = torch.device("cpu")
STORAGES = ["full", "int8", "int4"]
# (policy, options, per_head, number of float32 statistics per slot)
POLICIES = [("dense", {}, False, 0), ("window", {}, False, 0), ("h2o", dict(recent=4), True, 1),
            ("h2o", dict(recent=4, normalize=True), True, 2)]
# Bytes of one token's key (or value) for one K/V head, at head_dim D with float32 at full
# precision: codes (D bytes at int8, D / 2 at int4) + a float32 scale and offset per head.
TOKEN_BYTES = {"full": lambda D: 4 * D, "int8": lambda D: D + 8, "int4": lambda D: D // 2 + 8}


def spec(D=16, H=2, C=8, B=1, dtype=torch.float32, storage="full"):
    return CacheSpec(batch_size=B, num_kv_heads=H, head_dim=D, cache_length=C, dtype=dtype, device=CPU,
                     storage=storage)


def unpack(store: QuantizedStorage, codes: torch.Tensor) -> torch.Tensor:
    return torch.stack((codes & 15, codes >> 4), -1).flatten(-2) if store.bits == 4 else codes


# ----- bytes ----------------------------------------------------------------------------------


def test_quantized_bytes_at_a_real_head_dim():
    """At head_dim 128, keys and values take 136/512 (int8) and 72/512 (int4) of float32 bytes,
    and 136/256 and 72/256 of float16: the codes plus 8 bytes of scale and offset per token-head."""
    C, H, D = 100, 8, 128
    pos_bytes = (C + 1) * 8
    for dtype, full_token in ((torch.float32, 512), (torch.float16, 256)):
        full = make_storage(spec(D, H, C, dtype=dtype)).nbytes() - pos_bytes
        assert full == 2 * H * (C + 1) * full_token
        int8 = make_storage(spec(D, H, C, dtype=dtype, storage="int8")).nbytes() - pos_bytes
        int4 = make_storage(spec(D, H, C, dtype=dtype, storage="int4")).nbytes() - pos_bytes
        assert int8 / full == pytest.approx(136 / full_token)  # 0.266 of fp32, 0.531 of fp16
        assert int4 / full == pytest.approx(72 / full_token)  # 0.141 of fp32, 0.281 of fp16
    # Groups of 32 along head_dim cost 8 bytes each: int4 at 64 + 4 * 8 = 96 bytes per token-head.
    grouped = QuantizedStorage(spec(D, H, C, storage="int4"), 4, group_size=32)
    assert grouped.nbytes() - pos_bytes == 2 * H * (C + 1) * 96


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("policy,options,per_head,n_stats", POLICIES)
def test_cache_bytes_per_policy(llama, storage, policy, options, per_head, n_stats):
    """The whole cache: K/V at the storage's size, positions and statistics unchanged."""
    cfg, C = llama.config, 16
    cache = kvcache.make_cache(llama, f"{policy}:{storage}", cache_length=C, **options)
    Hp = cfg.num_kv_heads if per_head else 1
    per_slot = 2 * cfg.num_kv_heads * TOKEN_BYTES[storage](cfg.head_dim) + Hp * (8 + 4 * n_stats)
    assert cache.nbytes() == cfg.num_layers * (C + 1) * per_slot
    full = kvcache.make_cache(llama, policy, cache_length=C, **options)
    kv_ratio = {"full": 1.0, "int8": 24 / 64, "int4": 16 / 64}[storage]  # head_dim 16: scales weigh more
    extra = cfg.num_layers * (C + 1) * Hp * (8 + 4 * n_stats)
    assert (cache.nbytes() - extra) / (full.nbytes() - extra) == pytest.approx(kv_ratio)
    assert cache.layers[0].storage.k.shape[2] == C + 1  # capacity plus the scratch slot


# ----- quantization error ---------------------------------------------------------------------


@pytest.mark.parametrize("bits,group", [(8, None), (4, None), (8, 16), (4, 8), (4, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_error_is_within_half_a_step(bits, group, dtype):
    store = QuantizedStorage(spec(D=32, dtype=dtype), bits, group_size=group)
    g = torch.Generator().manual_seed(bits)
    # Per-token offsets and a large channel, as keys have: each group gets its own range.
    x = (torch.randn(2, 2, 50, 32, generator=g) + 3 * torch.randn(2, 2, 50, 1, generator=g)).to(dtype)
    x[..., 5] *= 10
    codes, meta = store.encode(x)
    assert codes.dtype == torch.uint8 and codes.shape[-1] == 32 * bits // 8
    y = store.decode(codes, meta)
    assert y.dtype == dtype and y.shape == x.shape
    G = meta.shape[-1] // 2
    step = meta[..., :G].repeat_interleave(32 // G, dim=-1)  # each element's scale
    # scale / 2 from rounding to a code, plus the rounding of the result to the model's dtype.
    bound = step / 2 * (1 + 1e-5) + x.float().abs() * torch.finfo(dtype).eps
    assert bool(((y.float() - x.float()).abs() <= bound).all())
    # The range of each group is used in full (asymmetric): its min and max are codes 0 and
    # 2^bits - 1, unless the group is constant (scale 0, every code 0).
    q = unpack(store, codes).unflatten(-1, (G, -1))
    assert bool((q.amin(-1) == 0).all())
    assert bool(((q.amax(-1) == 2**bits - 1) | (meta[..., :G] == 0)).all())
    # Quantizing what was read back gives the same codes: a token re-written (a ring cache writes
    # the chunk it attended over) is not degraded twice.
    assert torch.equal(store.encode(y)[0], codes)


@pytest.mark.parametrize("bits", [8, 4])
def test_exact_values_and_constant_groups(bits):
    store = QuantizedStorage(spec(D=16), bits)
    levels = 2**bits - 1
    # Values on a grid that spans codes 0 to 2^bits - 1 come back exactly; so does a constant
    # group (scale 0).
    codes = torch.randint(0, levels + 1, (1, 2, 3, 16), generator=torch.Generator().manual_seed(0))
    codes[..., 0], codes[..., 1] = 0, levels
    x = codes * 0.25 - 1.0
    x[0, 1, 2] = 7.5
    assert torch.equal(store.decode(*store.encode(x)), x)


# ----- logits against full precision ----------------------------------------------------------


def _run(model, name, ids, prefill):
    """Prefill ``prefill`` tokens in one chunk, then decode the rest one token at a time."""
    cache = kvcache.make_cache(model, name, cache_length=ids.shape[1], batch_size=ids.shape[0])
    with torch.inference_mode():
        outs = [model(ids[:, :prefill], cache)]
        outs += [model(ids[:, t : t + 1], cache) for t in range(prefill, ids.shape[1])]
    return torch.cat(outs, dim=1)


# Observed on the conftest llama (2 layers, head_dim 16, logits of standard deviation ~1): int8
# 0.013 max abs with top-1 agreement 1.0; int4 0.23 with 0.96. The bounds: one int8 step is 1/255
# of a group's range, so each key and value is off by at most 0.2% of it; through two layers that
# moves logits of unit scale by ~1e-2, and 0.04 leaves a 3x margin. An int4 step is 255/15 = 17
# times coarser, and its error bound is 17 times the int8 one.
LOGIT_BOUND = {"int8": 0.04, "int4": 0.04 * 17}
TOP1_BOUND = {"int8": 0.95, "int4": 0.9}


@pytest.mark.parametrize("storage", ["int8", "int4"])
def test_quantized_logits_are_close_to_full_precision(llama, storage):
    ids = ids_for(48, batch=2, seed=11, vocab=llama.config.vocab_size)
    ref = _run(llama, "dense", ids, prefill=32)
    got = _run(llama, f"dense:{storage}", ids, prefill=32)
    diff = max_diff(got, ref)
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert diff <= LOGIT_BOUND[storage], f"dense:{storage}: max |logit diff| {diff:.4f}, top-1 {agree:.3f}"
    assert agree >= TOP1_BOUND[storage], f"dense:{storage}: max |logit diff| {diff:.4f}, top-1 {agree:.3f}"
    assert diff > 0  # the storage really quantizes


@pytest.mark.parametrize("storage", ["int8", "int4"])
def test_quantized_dense_does_not_depend_on_chunking(llama, storage):
    """Attention always reads the stored bits, the chunk's own tokens included, so one chunk and
    token-by-token decoding agree as closely as at full precision."""
    ids = ids_for(24, batch=1, seed=12, vocab=llama.config.vocab_size)
    whole = _run(llama, f"dense:{storage}", ids, prefill=24)
    stepped = _run(llama, f"dense:{storage}", ids, prefill=1)
    assert max_diff(whole, stepped) <= 1e-5


# ----- eviction is a policy's business --------------------------------------------------------


@pytest.mark.parametrize("storage", ["int8", "int4"])
@pytest.mark.parametrize("policy,options", [("window", {}), ("sink", dict(sinks=2))])
def test_positional_eviction_is_identical_to_full_precision(llama, storage, policy, options):
    """Window and sink decide by position alone: over the same ragged schedule every layer holds
    the same positions in the same slots as with full precision."""
    rows = [ids_for(30, seed=s, vocab=llama.config.vocab_size)[0] for s in (1, 2)]
    schedule = [[7, 3], [1, 1], [0, 9], [12, 5], [1, 1], [1, 1], [5, 8], [1, 1]]
    caches, logits = {}, {}
    for name in (policy, f"{policy}:{storage}"):
        caches[name] = kvcache.make_cache(llama, name, cache_length=8, batch_size=2, **options)
        with torch.inference_mode():
            logits[name] = feed(llama, caches[name], rows, schedule, after_call=lambda c, n, T: check_storage(c))
    for full, quant in zip(caches[policy].layers, caches[f"{policy}:{storage}"].layers):
        assert torch.equal(full.storage.pos, quant.storage.pos)
    # Like full precision, the quantized cache does not depend on chunking or batching: row 0
    # alone, one token at a time, reads the same bits.
    alone, _ = feed_alone(llama, f"{policy}:{storage}", rows[0][:28], [1] * 28, 8, **options)
    assert max_diff(alone, logits[f"{policy}:{storage}"][0]) <= 1e-5


def test_decode_move_keeps_codes_and_empties_the_scratch_slot():
    """The scoring decode path writes the new token to slot C and moves it over the victim."""
    C = 4
    quant, full = QuantizedStorage(spec(C=C, B=2), 4, per_head=True), FullStorage(spec(C=C, B=2), per_head=True)
    k, v = torch.randn(2, 2, 1, 16), torch.randn(2, 2, 1, 16)
    positions = torch.tensor([[5], [9]])
    dst = torch.tensor([[[1], [3]], [[0], [2]]])  # (B, Hp, 1): each head its own victim
    for store in (quant, full):
        store.write_slice(C, k, v, positions)
        codes = store.k[:, :, C].clone()
        store.settle(dst, k, v, positions)
        assert bool((store.pos[:, :, C] == -1).all())
        for b in range(2):
            for h in range(2):
                d = int(dst[b, h])
                assert int(store.pos[b, h, d]) == int(positions[b, 0])
                assert torch.equal(store.k[b, h, d], codes[b, h])  # moved, not re-quantized
    qk, qv, _ = quant.view(C)
    fk, fv, _ = full.view(C)
    rk, rv = quant.roundtrip(k, v)
    index = dst.unsqueeze(-1).expand(2, 2, 1, 16)
    assert torch.equal(qk.gather(2, index), rk) and torch.equal(qv.gather(2, index), rv)
    assert torch.equal(fk.gather(2, index), k)


def test_scoring_policy_quantizes_a_surviving_token_once(llama):
    """h2o:int8 through chunks (the gather path) and decode steps (the scratch slot and move):
    the invariants of every policy hold, and a token kept across evictions keeps its codes."""
    C = 8
    cache = kvcache.make_cache(llama, "h2o:int8", cache_length=C, recent=2)
    ids = ids_for(40, seed=4, vocab=llama.config.vocab_size)[0]
    codes_of = {}
    schedule = [[10]] + [[1]] * 6 + [[9]] + [[1]] * 5 + [[10]]
    with torch.inference_mode():
        feed(llama, cache, [ids], schedule, after_call=lambda c, n, T: check_storage(c))
        store = cache.layers[0].storage
        for h in range(store.pos.shape[1]):
            for slot in range(C):
                codes_of[h, int(store.pos[0, h, slot])] = store.k[0, h, slot].clone()
        llama(ids[None, :5], cache)  # one more chunk: evicts some tokens, keeps others
    survivors = 0
    for h in range(store.pos.shape[1]):
        for slot in range(C):
            p = int(store.pos[0, h, slot])
            if (h, p) in codes_of:
                survivors += 1
                assert torch.equal(store.k[0, h, slot], codes_of[h, p])
    assert survivors > 0


def test_headwise_budgets_with_quantized_storage(llama):
    budgets = [[6, 10]] * llama.config.num_layers
    cache = kvcache.make_cache(llama, "h2o:int4", cache_length=8, head_budgets=budgets, recent=2)
    full = kvcache.make_cache(llama, "h2o", cache_length=8, head_budgets=budgets, recent=2)
    assert cache.nbytes() < full.nbytes()
    with torch.inference_mode():
        logits = llama(ids_for(20, seed=5, vocab=llama.config.vocab_size), cache)
    assert torch.isfinite(logits).all()


# ----- names ----------------------------------------------------------------------------------


def test_names_pair_a_policy_with_a_storage(llama, capsys):
    assert list(kvcache.storages()) == STORAGES
    assert "dense" in kvcache.policies() and "dense:int8" not in kvcache.policies()
    cache = kvcache.make_cache(llama, "h2o:int8", cache_length=8, recent=2)
    assert cache.policy == "h2o:int8"
    assert isinstance(cache.layers[0].storage, QuantizedStorage) and cache.layers[0].storage.bits == 8
    assert isinstance(kvcache.make_cache(llama, "window", cache_length=8).layers[0].storage, FullStorage)
    assert isinstance(kvcache.make_cache(llama, "dense:full", cache_length=8).layers[0].storage, FullStorage)
    assert kvcache.policy_options("h2o:int4") == kvcache.policy_options("h2o")
    assert main(["policies"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in STORAGES) and "h2o:int4" in out


@pytest.mark.parametrize("name", ["h2o:int3", "dense:", "window:INT8", "dense:int8:int4"])
def test_unknown_storage_names_the_valid_ones(llama, name):
    with pytest.raises(ValueError, match="unknown storage") as err:
        kvcache.make_cache(llama, name, cache_length=8)
    assert all(s in str(err.value) for s in STORAGES)
    with pytest.raises(ValueError, match="unknown storage"):
        make_storage(spec(storage="int3"))


def test_unknown_policy_with_a_storage(llama):
    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        kvcache.make_cache(llama, "nope:int8", cache_length=8)
