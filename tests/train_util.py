"""Helpers for the fine-tuning tests: an independent reference for ``chunked_loss`` under an
evicting policy, and gradient comparison.

The reference runs the whole sequence in one plain forward in which each layer's attention is an
explicit float32 softmax under a (T x T) mask built from the positions a real cache of the same
policy held before each chunk (read from its buffers after each chunk of an inference run): query
t of chunk c sees the positions held before c and the tokens of c up to t, within the policy's
window and sinks. Renumbered sinks score the sink keys with the query rotated back by the shift;
keys and values are those the real cache stored, read back, straight-through (an identity at
full precision). Small sizes only (the mask is T x T).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from policy_util import CACHE_KEYWORDS, build_tiny, cache_args, ids_for  # noqa: E402

import kvcache
from kvcache.cache.base import KVCache, LayerCache, Step
from kvcache.model.rope import apply_rope, rope_angles


def record_held(model, ids: torch.Tensor, policy: str, cache_length: int, sizes: list[int], **options):
    """Run ``ids`` through a real cache in chunks of ``sizes`` (inference). Returns the cache and
    held[c][l]: (B, Hp, C) positions layer l held before chunk c (-1 empty). Each layer's
    ``stored`` becomes the keys and values (B, Hkv, T, D) of every position as stored (read back),
    which the reference attends straight-through: recomputing the codes instead could round a value
    that lies on a code boundary the other way, a jump of a whole quantization step."""
    B = ids.shape[0]
    cache = kvcache.make_cache(model, policy, cache_length=cache_length, batch_size=B, **cache_args(options))
    stored = [[] for _ in cache.layers]
    for layer, keep in zip(cache.layers, stored):
        def attend(q, k, v, step, layer=layer, keep=keep, attend=layer.attend):
            parts = [(head.storage.roundtrip(k[:, h : h + 1], v[:, h : h + 1]) if hasattr(layer, "heads")
                      else head.storage.roundtrip(k, v)) for h, head in enumerate(policy_heads(layer))]
            keep.append(tuple(torch.cat([part[i] for part in parts], dim=1) for i in (0, 1)))
            return attend(q, k, v, step)
        layer.attend = attend
    held, start = [], 0
    with torch.inference_mode():
        for n in sizes:
            held.append([slots_held(layer) for layer in cache.layers])
            model(ids[:, start : start + n], cache)
            start += n
    for layer, keep in zip(cache.layers, stored):
        layer.stored = tuple(torch.cat([kv[i] for kv in keep], dim=2).clone() for i in (0, 1))
    return cache, held


def policy_heads(layer) -> list:
    """The caches that decide for a layer: its K/V heads' own under head budgets, else itself."""
    return list(getattr(layer, "heads", [layer]))


def slots_held(layer) -> torch.Tensor:
    """(B, Hp, S) the positions in the layer's slots (-1 empty); head budgets: one row per K/V
    head, padded with -1 to the largest head's slots."""
    rows = [head.storage.pos[:, :, : head.spec.cache_length] for head in policy_heads(layer)]
    width = max(r.shape[2] for r in rows)
    return torch.cat([F.pad(r, (0, width - r.shape[2]), value=-1) for r in rows], dim=1).clone()


class MaskedLayer(LayerCache):
    """The whole sequence in one call, attending under the mask the recorded decisions give."""

    def __init__(self, layer, held: list[torch.Tensor], sizes: list[int]) -> None:
        super().__init__(layer.spec, layer.options)
        self.layer, self.held, self.sizes, self.name = layer, held, sizes, layer.name

    def mask(self, B: int, T: int, device) -> torch.Tensor:
        """(B, Hp, T, T) bool: may query t see key p."""
        Hp = self.held[0].shape[1]
        allowed = torch.zeros(B, Hp, T, T, dtype=torch.bool, device=device)
        start = 0
        for held, n in zip(self.held, self.sizes):
            for b in range(B):
                for h in range(Hp):
                    kept = held[b, h][held[b, h] >= 0]
                    allowed[b, h, start : start + n, kept] = True
            allowed[:, :, start : start + n, start : start + n] = True
            start += n
        t = torch.arange(T, device=device)
        rules = []
        for head in policy_heads(self.layer):  # one rule for all heads, or one per K/V head
            rule = (t[None, :] <= t[:, None])  # causal
            window, sinks, limit = head.lookback(), head.sinks(), head.spec.sliding_window
            if window is not None:
                rule &= (t[None, :] > t[:, None] - window) | (t[None, :] < sinks)
            if limit is not None:
                rule &= t[None, :] > t[:, None] - limit
            rules.append(rule)
        return allowed & torch.stack(rules)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: Step) -> torch.Tensor:
        rk, rv = self.layer.stored
        k, v = k + (rk - k).detach(), v + (rv - v).detach()
        B, Hq, T, D = q.shape
        Hkv = k.shape[1]
        G = Hq // Hkv
        scores = (q.view(B, Hkv, G, T, D) @ k.unsqueeze(2).transpose(-1, -2)).float() * D**-0.5
        renumbered = getattr(self.layer.options, "positions", None) == "renumbered" and policy_heads(self.layer)[0].sinks()
        if renumbered and hasattr(self.layer, "heads"):
            raise NotImplementedError("the reference renumbers sinks by one cache length: not under head budgets")
        if renumbered:
            C, S = self.layer.spec.cache_length, self.layer.sinks()
            shift = (torch.arange(T, device=q.device) - (C - 1)).clamp(min=0)[None]  # (1, T)
            cos, sin = rope_angles(self.layer.spec.inv_freq, -shift, q.dtype)
            qs = apply_rope(q, cos.unsqueeze(1), sin.unsqueeze(1))
            sink_scores = (qs.view(B, Hkv, G, T, D) @ k[:, :, :S].unsqueeze(2).transpose(-1, -2)).float() * D**-0.5
            scores = torch.cat((sink_scores, scores[..., S:]), dim=-1)
        rule = self.layer.spec.scores  # the family's: Gemma 2's soft cap, gpt-oss's sink logits
        if rule is not None and rule.softcap is not None:
            scores = torch.tanh(scores / rule.softcap) * rule.softcap
        mask = self.mask(B, T, q.device).unsqueeze(2)  # (B, Hp, 1, T, T)
        scores = scores.masked_fill(~mask, float("-inf"))
        if rule is not None and rule.sink_logits is not None:
            # One more column, with no value: its weight is dropped after the softmax.
            sink = rule.sink_logits.float().view(1, Hkv, G, 1, 1).expand(B, -1, -1, T, 1)
            weights = torch.cat((scores, sink), dim=-1).softmax(-1)[..., :-1]
        else:
            weights = scores.softmax(-1)
        return (weights.to(v.dtype) @ v.unsqueeze(2)).view(B, Hq, T, D)

    def reset(self) -> None:
        pass

    def nbytes(self) -> int:
        return 0


def reference_loss(model, ids: torch.Tensor, cache, held, sizes: list[int]) -> torch.Tensor:
    """The mean next-token loss of the whole sequence under the recorded decisions' mask."""
    layers = [MaskedLayer(layer, [h[i] for h in held], sizes) for i, layer in enumerate(cache.layers)]
    logits = model(ids, KVCache(layers, cache.spec, cache.policy))
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


def gradients(model, loss_fn) -> tuple[float, dict[str, torch.Tensor]]:
    """(loss, name -> gradient) of ``loss_fn()`` for every parameter."""
    model.zero_grad(set_to_none=True)
    loss = loss_fn()
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.item(), grads


def relative_errors(got: dict, want: dict) -> dict[str, float]:
    """Per parameter: ||got - want|| / ||want||, where ||want|| is taken as at least 1% of the norm
    of the whole gradient. (A parameter whose true gradient is 0, such as the query projection
    when every query sees one key, gets float noise of about 1e-7 from either computation.)"""
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    total = torch.stack([g.norm() for g in want.values()]).norm()
    return {n: ((got[n] - want[n]).norm() / torch.maximum(want[n].norm(), 0.01 * total)).item() for n in want}


def tiny_model(path, *, layers: int = 2, **kwargs) -> kvcache.Transformer:
    """A tiny random Llama saved into ``path`` and loaded by kvcache (fp32): policy_util's
    ``build_tiny``, whose queries and keys are scaled up so attention is peaked and what a cache
    drops shows in the loss and its gradient."""
    return build_tiny(path, layers=layers, **kwargs)


def token_ids(n: int, batch: int = 1, seed: int = 0, vocab: int = 64) -> torch.Tensor:
    """(batch, n) random ids, avoiding the special ids 0..2."""
    return ids_for(n, batch=batch, seed=seed, vocab=vocab)


def plain_loss(model, ids: torch.Tensor) -> torch.Tensor:
    """The mean next-token loss of the plain forward over the whole sequence (full backprop)."""
    logits = model(ids)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


# chunked_loss's own keywords; everything else in a test's settings is the policy's option.
LOSS_KEYWORDS = CACHE_KEYWORDS | {"policy", "chunk", "weights", "labels", "ignore_index", "offload_kv"}


def loss_args(settings: dict) -> dict:
    """A test's settings as chunked_loss takes them (``cache_args`` with its keywords)."""
    return cache_args(settings, LOSS_KEYWORDS)
