"""Helpers shared by the eviction-policy tests: tiny models, ragged feeding, invariant checks and
a recorder of the attention calls the layer caches make.

Not a conftest (``tests/conftest.py`` is imported as the module ``conftest`` by other tests, and a
second conftest.py would shadow it).
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import os
from pathlib import Path

import torch
from conftest import CACHE_ATOL, DEVICE

import kvcache
from kvcache.cache.evicting import EvictingCache
from kvcache.cache.ring import RingCache
from kvcache.kernels import attention

# Largest max-abs logit difference accepted where a policy claims to be exact, per dtype (only the
# shapes of the matmuls differ from the reference): conftest's "cache" tolerances.
EXACT_ATOL = CACHE_ATOL


def build_tiny(path: Path, *, layers: int, hidden: int = 32, heads: int = 4, kv_heads: int = 2,
               vocab: int = 64, seed: int = 0, max_positions: int = 4096,
               device: torch.device | str = DEVICE) -> kvcache.Transformer:
    """A tiny random Llama saved with ``save_pretrained`` into ``path`` and loaded by kvcache (fp32) on
    ``device`` (the test device)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
        rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    hf = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                # Queries and keys larger than variance-preserving, so attention is peaked rather
                # than uniform and eviction decisions (and renumbering mistakes) show in the logits.
                scale = 2.0 if name.endswith(("q_proj.weight", "k_proj.weight")) else 1.0
                p.copy_(scale * torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    hf.save_pretrained(path)
    return kvcache.load(path, dtype=torch.float32, device=device)


def ids_for(n: int, batch: int = 1, seed: int = 0, vocab: int = 64) -> torch.Tensor:
    """(batch, n) random ids on the test device (drawn on the CPU: the same ids on every device)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, n), generator=g).to(DEVICE)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


# ----- feeding --------------------------------------------------------------------------------


def nudged(model: kvcache.Transformer, seed: int) -> kvcache.Transformer:
    """A copy of ``model`` with every weight moved one unit in the last place, up or down at
    random: its activations differ from the model's by float rounding, as two kernels' do."""
    out = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for w in out.parameters():
            up = torch.randint(0, 2, w.shape, generator=g).to(w.device, torch.bool)
            w.copy_(torch.nextafter(w, torch.where(up, torch.inf, -torch.inf)))
    return out


def feed(model, cache, rows, schedule, *, pad_seed=0, after_call=None):
    """Feed ``rows`` (list of 1-D id tensors) through ``cache``; ``schedule`` lists per-call
    n_tokens. Padding is random. Returns each row's real logits (n_b, vocab).

    ``after_call(cache, n, chunk_width)`` runs after every call.
    """
    B = len(rows)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(pad_seed)
    done = [0] * B
    got = [[] for _ in range(B)]
    for n in schedule:
        T = max(max(n), 1)
        chunk = torch.randint(0, vocab, (B, T), generator=g).to(model.embed_tokens.weight.device)
        for b in range(B):
            chunk[b, : n[b]] = rows[b][done[b] : done[b] + n[b]]
        logits = model(chunk, cache, n_tokens=n)
        for b in range(B):
            got[b].append(logits[b, : n[b]])
            done[b] += n[b]
        assert cache.lengths.tolist() == done
        if after_call is not None:
            after_call(cache, n, T)
    return [torch.cat(x, dim=0) for x in got]


def feed_alone(model, policy, row, row_schedule, cache_length, **options):
    """Row ``row`` alone (batch 1), with its own chunk sizes (zeros skipped). Returns (logits, cache)."""
    cache = kvcache.make_cache(model, policy, cache_length=cache_length, batch_size=1, options=options)
    logits = feed(model, cache, [row], [[k] for k in row_schedule if k])[0]
    return logits, cache


def kept(layer, b: int) -> list[list[int]]:
    """Sorted positions held in slots [0, C) of row ``b``, one list per slot group (Hp)."""
    C = layer.spec.cache_length
    pos = layer.storage.pos[b, :, :C]
    return [sorted(p[p >= 0].tolist()) for p in pos]


# ----- invariants -----------------------------------------------------------------------------


def check_storage(cache) -> None:
    """Capacity, scratch slot, uniqueness, and nothing but real past tokens, in every layer.

    A layer with ``reserve`` R holds between C - R and C tokens once a row has seen more than C.
    """
    lengths = cache.lengths.tolist()
    for i, layer in enumerate(cache.layers):
        C, R = layer.spec.cache_length, layer.spec.reserve
        pos = layer.storage.pos
        assert pos.shape[-1] == C + 1
        assert bool((pos[..., C] == -1).all()), f"layer {i}: scratch slot not empty: {pos[..., C].tolist()}"
        for b, L in enumerate(lengths):
            for h, held in enumerate(kept(layer, b)):
                where = f"layer {i} row {b} head {h} (length {L}, C {C}): {held}"
                assert len(held) <= C, where
                # Nothing is dropped while there is room, and nothing is held twice.
                if R and L > C:
                    assert C - R <= len(held) <= C, where
                else:
                    assert len(held) == min(C, L), where
                # Held slots are the first ones, as many as the layer counts (a ring places
                # tokens by position instead).
                if isinstance(layer, EvictingCache) and not isinstance(layer, RingCache):
                    assert len(held) == int(layer.held[b]), where
                    assert bool((pos[b, :, : len(held)] >= 0).all()), where
                assert len(set(held)) == len(held), where
                # Only real tokens already seen: no padding, nothing from the future.
                assert all(0 <= p < L for p in held), where


def expected_sink_positions(L: int, C: int, sinks: int) -> list[int]:
    if L <= C:
        return list(range(L))
    return list(range(sinks)) + list(range(L - (C - sinks), L))


class AttentionRecorder:
    """Records, for every attention call the layer caches of ``cache`` make (in order), the query
    positions ``q_pos`` (B, T), the key positions ``k_pos`` (B, Hp, S) and which keys each query
    may see ``vis`` (B, Hp, T, S), whichever kernel the layer uses; ``scores_only`` is True for a
    call that computes attention weights and no outputs (a policy scoring what it attended)."""

    def __init__(self, cache) -> None:
        self.cache = cache
        self.calls: list[dict] = []

    def clear(self) -> None:
        self.calls.clear()

    def _layer_of(self, k):
        for layer in self.cache.layers:
            if k.data_ptr() == layer.storage.k.data_ptr():
                return layer
        raise AssertionError("decode kernel called on keys that are not a layer's storage")

    @contextlib.contextmanager
    def patch(self):
        orig = (attention.masked, attention.masked_with_weights, attention.decode, attention.causal,
                attention.after_prefix, attention.after_prefix_with_weights)

        def record(q_pos, k_pos, window, sinks, limit):
            vis = attention.visibility(q_pos, k_pos, window, sinks, limit)
            self.calls.append(dict(q_pos=q_pos.clone(), k_pos=k_pos.clone(), vis=vis))

        def masked(q, k, v, q_pos, k_pos, *, window=None, sinks=0, limit=None, all_visible=False, scores=None):
            record(q_pos, k_pos, window, sinks, limit)
            if all_visible:
                self.calls[-1]["vis"] = torch.ones_like(self.calls[-1]["vis"])
            return orig[0](q, k, v, q_pos, k_pos, window=window, sinks=sinks, limit=limit, all_visible=all_visible,
                           scores=scores)

        def masked_with_weights(q, k, v, q_pos, k_pos, q_weight, *, window=None, sinks=0, limit=None,
                                q_sink=None, outputs=True, in_order=False, scores=None):
            # (``in_order`` skips only slots no query of a block sees: the visibility is k_pos's.)
            record(q_pos, k_pos, window, sinks, limit)
            self.calls[-1]["scores_only"] = not outputs
            return orig[1](q, k, v, q_pos, k_pos, q_weight, window=window, sinks=sinks, limit=limit,
                           q_sink=q_sink, outputs=outputs, in_order=in_order, scores=scores)

        def decode(q, k, v, visible, **kwargs):
            # One query per row, at the row's current length; keys are the first S storage slots.
            S = k.shape[2]
            k_pos = self._layer_of(k).storage.pos[:, :, :S].clone()
            vis = torch.ones_like(k_pos, dtype=torch.bool) if visible is None else visible.clone()
            q_pos = self.cache.lengths[:, None].clone().to(k_pos.device)
            self.calls.append(dict(q_pos=q_pos, k_pos=k_pos, vis=vis.unsqueeze(2)))
            return orig[2](q, k, v, visible, **kwargs)

        def causal(q, k, v, window=None, sinks=0, limit=None, q_sink=None, scores=None):
            # A prompt alone in empty caches: positions 0..T-1 in every row, keys at the same.
            B, T = q.shape[0], q.shape[2]
            pos = torch.arange(T, device=q.device).expand(B, T)
            record(pos, pos.unsqueeze(1), window, sinks, limit)
            return orig[3](q, k, v, window=window, sinks=sinks, limit=limit, q_sink=q_sink, scores=scores)

        def after_prefix(q, k, v, q_pos, k_pos, prefix):
            # Sees what ``masked`` would without the rule's windows: the caller guarantees it has none.
            record(q_pos, k_pos, None, 0, None)
            return orig[4](q, k, v, q_pos, k_pos, prefix)

        def after_prefix_with_weights(q, k, v, q_pos, k_pos, prefix, q_weight):
            record(q_pos, k_pos, None, 0, None)
            self.calls[-1]["scores_only"] = False
            return orig[5](q, k, v, q_pos, k_pos, prefix, q_weight)

        names = ("masked", "masked_with_weights", "decode", "causal", "after_prefix", "after_prefix_with_weights")
        patched = (masked, masked_with_weights, decode, causal, after_prefix, after_prefix_with_weights)
        for name, fn in zip(names, patched):
            setattr(attention, name, fn)
        try:
            yield self
        finally:
            for name, fn in zip(names, orig):
                setattr(attention, name, fn)


def visible_sets(call, b: int, t: int) -> list[list[int]]:
    """Sorted key positions visible to query ``t`` of row ``b`` in a recorded call, per slot group."""
    vis, kp = call["vis"], call["k_pos"][b]
    return [sorted(kp[h][vis[b, h, t]].tolist()) for h in range(kp.shape[0])]


# ----- memory ---------------------------------------------------------------------------------


def current_rss() -> int:
    """Resident set size of this process now, in bytes, after returning freed heap to the OS."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@contextlib.contextmanager
def torch_threads(n: int):
    """Run with ``n`` intra-op threads (the CI box has 2 shared cores: one thread per test process
    avoids oversubscription, which makes small ops 10x slower under load)."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def stream(model, cache, ids: torch.Tensor, *, chunk: int = 512, decode_every: int = 3,
           checkpoint_at: int = 10_000, on_step=None):
    """Feed ``ids`` (B, N) through ``cache`` in ``chunk``-token calls, each followed by
    ``decode_every`` one-token calls. Returns a dict with the process RSS after ``checkpoint_at``
    tokens and at the end, the last call's logits, and whether every logit was finite."""
    total = ids.shape[1]
    fed, rss_checkpoint, finite = 0, None, True
    logits = None
    while fed < total:
        n = min(chunk, total - fed)
        logits = model(ids[:, fed : fed + n], cache)
        finite &= bool(torch.isfinite(logits).all())
        fed += n
        for _ in range(min(decode_every, total - fed)):
            logits = model(ids[:, fed : fed + 1], cache)
            finite &= bool(torch.isfinite(logits).all())
            fed += 1
        if on_step is not None:
            on_step(cache, fed)
        if rss_checkpoint is None and fed >= checkpoint_at:
            rss_checkpoint = current_rss()
    return dict(fed=fed, rss_checkpoint=rss_checkpoint, rss_end=current_rss(), logits=logits, finite=finite)


# ----- one layer cache driven directly, against a plain-Python reference ---------------------


class LayerHarness:
    """One layer cache of ``cls`` (batch 1, ``Hkv`` K/V heads of ``G`` query heads each) fed
    random queries, keys and values; ``tokens[h]`` maps each position to its (k, v) for head h so
    a reference can recompute attention over any set of positions."""

    def __init__(self, cls, cache_length: int, options, *, Hkv: int = 2, G: int = 2, D: int = 8,
                 seed: int = 0, scale: float = 1.5) -> None:
        from kvcache.cache import CacheSpec, KVCache

        spec = CacheSpec(batch_size=1, num_kv_heads=Hkv, head_dim=D, cache_length=cache_length,
                         dtype=torch.float32, device=DEVICE)
        self.layer = cls(spec, options)
        self.cache = KVCache([self.layer], spec, cls.name)
        self.Hkv, self.G, self.D, self.scale = Hkv, G, D, scale
        self.gen = torch.Generator().manual_seed(seed)
        self.tokens = [dict() for _ in range(Hkv)]
        self.length = 0

    def chunk(self, T: int):
        """Feed T new tokens; returns (positions, q (Hq, T, D), out (Hq, T, D)) of row 0."""
        Hq, D = self.Hkv * self.G, self.D
        q = self.scale * torch.randn(1, Hq, T, D, generator=self.gen).to(DEVICE)
        k = self.scale * torch.randn(1, self.Hkv, T, D, generator=self.gen).to(DEVICE)
        v = torch.randn(1, self.Hkv, T, D, generator=self.gen).to(DEVICE)
        positions = list(range(self.length, self.length + T))
        for h in range(self.Hkv):
            for t, p in enumerate(positions):
                self.tokens[h][p] = (k[0, h, t], v[0, h, t])
        step = self.cache.begin(torch.zeros(1, T, dtype=torch.long, device=DEVICE), None)
        with torch.inference_mode():
            out = self.layer.attend(q, k, v, step)
        self.cache.commit(step)
        self.length += T
        return positions, q[0], out[0]

    def attention(self, h: int, qvec: torch.Tensor, positions: list[int]):
        """Softmax weights (N,) of query ``qvec`` over head h's keys at ``positions``, and the output."""
        keys = torch.stack([self.tokens[h][p][0] for p in positions])
        vals = torch.stack([self.tokens[h][p][1] for p in positions])
        w = (keys @ qvec / self.D**0.5).softmax(-1)
        return w, w @ vals

    def kept(self) -> list[list[int]]:
        return kept(self.layer, 0)


# make_cache's own keywords; everything else in a test's settings is the policy's option.
CACHE_KEYWORDS = frozenset({"cache_length", "batch_size", "prompt_length", "allocation", "head_budgets", "reserve", "block"})


def cache_args(settings: dict, keywords: frozenset = CACHE_KEYWORDS) -> dict:
    """A test's settings as make_cache takes them: its own ``keywords`` as they are, the policy's
    options gathered in ``options``."""
    options = {k: v for k, v in settings.items() if k not in keywords}
    return {**{k: v for k, v in settings.items() if k in keywords}, "options": options}
