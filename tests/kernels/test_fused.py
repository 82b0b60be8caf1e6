"""A chunk over packed slots decoded a block at a time (kvcache/kernels/fused.py) against one fused
call over the slots decoded whole: per-token layouts, windows, per-head slots, padding queries,
gradients, and that no block wider than ``BLOCK_BYTES`` allows is decoded; and a model's chunked
prefill over quantized caches, in small blocks against one block."""

from __future__ import annotations

import pytest
import torch
from conftest import CACHE_ATOL, DEVICE, max_diff, random_ids

import kvcache
from kvcache.cache import CacheSpec
from kvcache.cache.storages import make_storage
from kvcache.kernels import PackedKeys, attend_decoded, attention, fused

CPU_ONLY_FOLD = DEVICE.type != "cpu"  # off the CPU the span is one block: nothing is folded


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of 8 slots and queries in blocks of 5, far smaller than the inputs; leading
    slots that every query sees take a call of their own from 2 on."""
    monkeypatch.setattr(fused, "BLOCK_BYTES", 1)
    monkeypatch.setattr(fused, "MIN_BLOCK", 8)
    monkeypatch.setattr(fused, "QUERY_BLOCK", 5)
    monkeypatch.setattr(fused, "MIN_UNMASKED", 2)


def stored(name: str, dtype: torch.dtype, per_head: bool, B=2, H=2, D=16, S=30, seed=0):
    """A per-token storage holding S tokens, positions a permutation per row (and head), row 0
    with four empty slots."""
    gen = torch.Generator().manual_seed(seed)
    spec = CacheSpec(batch_size=B, num_kv_heads=H, head_dim=D, cache_length=S, dtype=dtype, device=DEVICE,
                     storage=name)
    store = make_storage(spec, per_head=per_head)
    x = (1.5 * torch.randn(B, H, S, D, generator=gen) + torch.randn(B, H, S, 1, generator=gen)).to(DEVICE, dtype)
    store.write_slice(0, x, x.flip(2), torch.arange(S, device=DEVICE).expand(B, S))
    Hp = store.pos.shape[1]
    perm = torch.stack([torch.randperm(S, generator=gen) for _ in range(B * Hp)]).view(B, Hp, S)
    store.pos[:, :, :S] = perm.to(DEVICE)
    store.pos[0, :, 10:14] = -1
    return store


@pytest.mark.parametrize("name", ["token8", "token4/4", "token2", "rtoken3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rule", ["causal", "window", "per_head"])
def test_blocks_fold_to_one_call_over_the_decoded_slots(small_blocks, name, dtype, rule):
    store = stored(name, dtype, per_head=rule == "per_head")
    k, v, k_pos = store.view(30)
    gen = torch.Generator().manual_seed(1)
    B, Hq, T = 2, 4, 12
    q = torch.randn(B, Hq, T, 16, generator=gen).to(DEVICE, dtype)
    assert CPU_ONLY_FOLD or len(fused.slot_blocks(k, k.slots, q)) == 4
    q_pos = torch.arange(18, 30, device=DEVICE).repeat(B, 1)
    q_pos[1, -3:] = -1  # padding: sees no key
    q_pos[1, :3] = torch.tensor([0, 2, 5])  # sees few keys, in one block or none
    window = 7 if rule == "window" else None
    got = attend_decoded(q, k, v, q_pos, k_pos, window=window)
    want = attention.masked(q, k.decoded(), v.decoded(), q_pos, k_pos, window=window)
    assert got.dtype == dtype
    # Padding queries' outputs are kernel-defined in the reference (0 on the CPU, the mean of the
    # values on CUDA) and never read; attend_decoded gives them 0 on every device.
    real = q_pos[:, None, :, None] >= 0
    assert max_diff(got * real, want * real) <= CACHE_ATOL[dtype]
    assert got[1, :, -3:].abs().max() == 0


@pytest.mark.parametrize("block", [8, 30])
def test_a_stored_past_every_query_sees_folds_with_the_masked_rest(small_blocks, monkeypatch, block):
    """Slots in position order, a chunk of queries after 20 of them: each block's leading slots
    that every query sees take a call without a mask, folded with the masked rest (in blocks of
    8 slots, and with the whole span one block)."""
    monkeypatch.setattr(fused, "MIN_BLOCK", block)
    store = stored("token8", torch.float32, per_head=False)
    store.pos[:, :, :30] = torch.arange(30, device=DEVICE)
    k, v, k_pos = store.view(30)
    q = torch.randn(2, 4, 10, 16, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    q_pos = torch.arange(20, 30, device=DEVICE).repeat(2, 1)
    for window in (None, 15):
        got = attend_decoded(q, k, v, q_pos, k_pos, window=window)
        want = attention.masked(q, k.decoded(), v.decoded(), q_pos, k_pos, window=window)
        assert max_diff(got, want) <= CACHE_ATOL[torch.float32]


def test_gradients_reach_the_queries(small_blocks):
    """Queries that carry a gradient (chunked training) read the slots in one block: the same
    gradients as the fused call over the slots decoded."""
    store = stored("token8", torch.float32, per_head=False)
    k, v, k_pos = store.view(30)
    q = torch.randn(2, 4, 12, 16, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    q_pos = torch.arange(18, 30, device=DEVICE).repeat(2, 1)
    w = torch.randn(2, 4, 12, 16, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    grads = []
    for fn in (lambda x: attend_decoded(x, k, v, q_pos, k_pos),
               lambda x: attention.masked(x, k.decoded(), v.decoded(), q_pos, k_pos)):
        x = q.clone().requires_grad_()
        (fn(x) * w).sum().backward()
        grads.append(x.grad)
    assert max_diff(*grads) <= CACHE_ATOL[torch.float32]


def test_no_more_than_a_block_is_decoded_at_once(small_blocks, monkeypatch):
    store = stored("token4/4", torch.float32, per_head=False)
    k, v, k_pos = store.view(30)
    widths = []
    decode = PackedKeys.decode

    def recording(self, s0, s1):
        widths.append(s1 - s0)
        return decode(self, s0, s1)

    monkeypatch.setattr(PackedKeys, "decode", recording)
    q = torch.randn(2, 4, 12, 16).to(DEVICE)
    attend_decoded(q, k, v, torch.arange(18, 30, device=DEVICE).repeat(2, 1), k_pos)
    assert sum(widths) == 30
    assert CPU_ONLY_FOLD or max(widths) == 8


@pytest.mark.parametrize("storage", ["int8", "token4", "int4", "int2"])
def test_chunked_prefill_in_small_blocks_equals_one_block(llama, monkeypatch, storage):
    """A model's prompt in chunks over a quantized dense cache: the same logits whether each
    chunk reads the stored slots in blocks of 64 (KIVI: one key group) or in one block."""
    ids = random_ids(300, batch=2, seed=4)

    def run():
        cache = kvcache.make_cache(llama, f"dense:{storage}", cache_length=320, batch_size=2)
        return torch.cat([llama(ids[:, s : s + 70], cache=cache) for s in range(0, 300, 70)], dim=1)

    one = run()
    monkeypatch.setattr(fused, "BLOCK_BYTES", 1)
    monkeypatch.setattr(fused, "MIN_BLOCK", 64)
    monkeypatch.setattr(fused, "QUERY_BLOCK", 32)
    monkeypatch.setattr(fused, "MIN_UNMASKED", 16)
    assert max_diff(run(), one) <= CACHE_ATOL[torch.float32]


def test_a_fold_goes_on_from_another_folds_queries():
    """Folding a block into one fold, then the next block into a fold made from its acc and lse
    (views of them), gives what one fold of both blocks gives; only folding queries go on."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 4, 6, 16, generator=g)
    k, v = torch.randn(1, 2, 10, 16, generator=g), torch.randn(1, 2, 10, 16, generator=g)
    rows = slice(0, 1)
    whole = fused.Fold(q)
    whole.add(rows, 0, 6, k[:, :, :4], v[:, :, :4], None)
    whole.add(rows, 0, 6, k[:, :, 4:], v[:, :, 4:], None)
    first = fused.Fold(q)
    first.add(rows, 0, 6, k[:, :, :4], v[:, :, :4], None)
    part = fused.Fold(q[:, :, 2:5], acc=first.acc[:, :, 2:5], lse=first.lse[:, :, 2:5])
    part.add(rows, 0, 3, k[:, :, 4:], v[:, :, 4:], None)
    assert max_diff(part.out(), whole.out()[:, :, 2:5]) <= 1e-6
    assert max_diff(first.out()[:, :, 2:5], whole.out()[:, :, 2:5]) <= 1e-6  # the views were updated
    with pytest.raises(ValueError, match="acc and lse"):
        fused.Fold(q, acc=first.acc)


def test_slot_blocks_from_a_start(small_blocks):
    spec = CacheSpec(batch_size=1, num_kv_heads=2, head_dim=16, cache_length=40, dtype=torch.float32,
                     device=torch.device("cpu"), storage="int8")
    keys = make_storage(spec).view(40)[0]
    q = torch.zeros(1, 4, 3, 16)
    blocks = fused.slot_blocks(keys, 40, q, 4, start=12)
    assert blocks[0][0] == 12 and blocks[-1][1] == 40
    assert all(b == c for (_, b), (c, _) in zip(blocks, blocks[1:]))
    assert all((s1 - s0) % 4 == 0 for s0, s1 in blocks[:-1])
    assert fused.slot_blocks(keys, 12, q, 4, start=12) == [(12, 12)]
