"""The layer caches behind ``chunked_loss``'s two passes: one records what a real cache did, one
replays it with gradients.

Recording (no gradient): the sequence runs chunk by chunk through a real cache of the chosen
policy whose layers are wrapped in ``Recorder``. Each wrapper copies the keys and values of the
chunk, as the cache attends them (read back from its storage's format), into a ``KeyValueStore``
of the whole sequence, then lets the real layer cache attend and evict as it always does.
``held_positions`` reads, after each chunk, which positions each layer kept: the policy's
decisions, made once, without gradient.

Replay (with gradient, one chunk at a time, last chunk first): a ``Replay`` layer attends the
chunk's queries over the recorded keys and values of the positions its layer held before the
chunk (fresh leaf tensors, so their gradient can be collected and sent back to the chunk that
made them) plus the chunk's own, under the policy's visibility rules. Nothing is written in place
into a tensor autograd saved, which is why backward through a real cache fails.
"""

from __future__ import annotations

import torch

from ..cache.base import LayerCache, Step
from ..cache.evicting import EvictingCache
from ..cache.headwise import HeadwiseCache
from ..kernels import attention
from ..kernels.sdpa import sdpa
from ..runtime import devices


def sink_biased(q, q_sink, k, v, q_pos, k_pos, rule: dict) -> torch.Tensor:
    """Attention in which the keys at positions below ``rule["sinks"]`` are scored with ``q_sink``
    (renumbered sinks), as one fused call through ``attention.sink_bias``, as every fused path
    scores them. q, q_sink: (B, Hq, n, D); k, v: (B, Hkv, N, D); q_pos: (B, n); k_pos: (B, 1, N), the
    same sink columns in every row (a uniform batch of a position-keyed ring) -> (B, Hq, n, D)."""
    cols = ((k_pos[0, 0] >= 0) & (k_pos[0, 0] < rule["sinks"])).nonzero().squeeze(1)
    bias = attention.sink_bias(q, q_sink, k, cols)
    visible = attention.visibility(q_pos, k_pos, rule["window"], rule["sinks"], rule["limit"])  # (B, 1, n, N)
    bias = bias.masked_fill(~visible, float("-inf"))
    return sdpa(q, k, v, attn_mask=bias, enable_gqa=q.shape[1] != k.shape[1])


class KeyValueStore:
    """Keys and values of every position of the sequence for one layer, as its cache attended them.

    k, v: (B, Hkv, T, D) in the dtype the model computed them in, on ``device`` (the model's, or
    the CPU when they are offloaded: pinned there when the model is on CUDA, for faster copies);
    allocated by the first write.
    """

    def __init__(self, length: int, device: torch.device) -> None:
        self.length, self.device = length, devices.canonical(device)
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def write(self, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: (B, Hkv, n, D) of positions [start, start + n)."""
        if self.k is None:
            B, H, _, D = k.shape
            pin = self.device.type == "cpu" and k.device.type == "cuda"
            self.k = torch.empty(B, H, self.length, D, dtype=k.dtype, device=self.device, pin_memory=pin)
            self.v = torch.empty(B, H, self.length, D, dtype=v.dtype, device=self.device, pin_memory=pin)
        stop = start + k.shape[2]
        # Blocking: a device-to-host copy must land before the host reads it back.
        self.k[:, :, start:stop] = k
        self.v[:, :, start:stop] = v

    def gather(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values at positions ``pos`` (B, Hp, S) (-1: an empty slot, filled with position
        0's values, which attention never sees): (B, Hkv, S, D) each, fresh tensors on the
        store's device."""
        B, H, _, D = self.k.shape
        index = pos.to(self.device).clamp(min=0).expand(B, H, -1).unsqueeze(-1).expand(-1, -1, -1, D)
        return self.k.gather(2, index), self.v.gather(2, index)


def _replayable(layer: LayerCache) -> bool:
    return isinstance(layer, EvictingCache) or (not layer.evicts and hasattr(layer, "storage"))


def check_supported(layer: LayerCache) -> None:
    """Raise ValueError unless ``chunked_loss`` can record and replay ``layer``: the dense cache,
    every policy built on EvictingCache, and head budgets (one such cache per K/V head)."""
    if _replayable(layer) or (isinstance(layer, HeadwiseCache) and all(map(_replayable, layer.heads))):
        return
    raise ValueError(
        f"chunked_loss cannot replay the {layer.name!r} layer cache: it supports the dense cache and policies "
        "built on EvictingCache (every registered policy), with uniform, per-layer or per-head budgets"
    )


def storages(layer: LayerCache) -> list:
    """The storages a layer's keys and values go through: one per K/V head under head budgets."""
    return [head.storage for head in layer.heads] if isinstance(layer, HeadwiseCache) else [layer.storage]


def stored_form(layer: LayerCache, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v (B, Hkv, n, D) as ``layer`` stores and attends them (its storage's codes read back);
    head budgets: each K/V head through its own cache's storage."""
    if not isinstance(layer, HeadwiseCache):
        return layer.storage.roundtrip(k, v)
    pairs = [head.storage.roundtrip(k[:, h : h + 1], v[:, h : h + 1]) for h, head in enumerate(layer.heads)]
    return torch.cat([kk for kk, _ in pairs], dim=1), torch.cat([vv for _, vv in pairs], dim=1)


def held_positions(layer: LayerCache, start: int, batch: int) -> torch.Tensor:
    """(B, Hp, S) long: the positions ``layer`` holds once it has seen ``start`` tokens (-1 for an
    empty slot). The dense cache holds every position, so its set is not read from the buffers.
    Head budgets: one row per K/V head (Hp = Hkv), each head's slots padded with -1 to the
    largest head's."""
    if isinstance(layer, HeadwiseCache):
        held = [held_positions(head, start, batch) for head in layer.heads]  # (B, 1, S_h) each
        width = max(h.shape[2] for h in held)
        return torch.cat([torch.nn.functional.pad(h, (0, width - h.shape[2]), value=-1) for h in held], dim=1)
    if not layer.evicts:
        return torch.arange(start, device=layer.spec.device).expand(batch, 1, start)
    return layer.storage.pos[:, :, : layer.spec.cache_length].clone()


def rules(layer: LayerCache) -> dict:
    """The visibility rules ``layer`` attends by (see ``attention.visibility``)."""
    if isinstance(layer, EvictingCache):
        return dict(window=layer.lookback(), sinks=layer.sinks(), limit=layer.spec.sliding_window,
                    scores=layer.spec.scores)
    return dict(window=None, sinks=0, limit=layer.spec.sliding_window, scores=layer.spec.scores)


class Recorder(LayerCache):
    """Wraps a real layer cache: copies each chunk's keys and values, as attended, into ``store``."""

    def __init__(self, inner: LayerCache, store: KeyValueStore) -> None:
        super().__init__(inner.spec, inner.options)
        self.inner, self.store = inner, store
        self.name, self.evicts = inner.name, inner.evicts

    def check(self, step: Step) -> None:
        self.inner.check(step)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: Step) -> torch.Tensor:
        # What the cache attends for a new token is its stored form read back (``roundtrip``):
        # the same values later chunks read from the slots.
        self.store.write(step.start0, *stored_form(self.inner, k, v))
        return self.inner.attend(q, k, v, step)

    def advance_decode(self) -> None:
        # A one-token chunk is a decode step, whose host bookkeeping follows the step.
        self.inner.advance_decode()

    def reset(self) -> None:
        self.inner.reset()

    def nbytes(self) -> int:
        return self.inner.nbytes()


class Replay(LayerCache):
    """One layer of one chunk, replayed with gradient.

    ``kept_k``, ``kept_v``: (B, Hkv, S, D) leaves holding the recorded keys and values of the
    positions ``kept_pos`` (B, Hp, S) the layer held before the chunk (None for the first chunk);
    ``chunk_k``, ``chunk_v``: (B, Hkv, n, D) the chunk's keys and values as recorded. After the
    model call, ``new_k`` and ``new_v`` are the chunk's keys and values in the graph, where the
    gradient later chunks sent them enters.
    """

    def __init__(self, policy_layer: LayerCache, kept: tuple | None, chunk_k: torch.Tensor,
                 chunk_v: torch.Tensor) -> None:
        super().__init__(policy_layer.spec, policy_layer.options)
        self.policy_layer, self.name = policy_layer, policy_layer.name
        self.kept_k, self.kept_v, self.kept_pos = kept if kept is not None else (None, None, None)
        self.chunk_k, self.chunk_v = chunk_k, chunk_v
        self.new_k: torch.Tensor | None = None
        self.new_v: torch.Tensor | None = None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: Step) -> torch.Tensor:
        # Forward with the recorded values (what the recording pass attended: a quantized
        # storage's read-back codes, and bit for bit what later chunks were given), backward
        # straight through to the recomputed ones.
        k = k + (self.chunk_k - k).detach()
        v = v + (self.chunk_v - v).detach()
        self.new_k, self.new_v = k, v
        layer = self.policy_layer
        if not isinstance(layer, HeadwiseCache):
            return _attend(layer, q, k, v, self.kept_k, self.kept_v, self.kept_pos, step)
        # Head budgets: each K/V head with its query group, by its own cache's rules.
        G = q.shape[1] // k.shape[1]
        outs = []
        for h, head in enumerate(layer.heads):
            kept = (None, None, None) if self.kept_pos is None else \
                (self.kept_k[:, h : h + 1], self.kept_v[:, h : h + 1], self.kept_pos[:, h : h + 1])
            outs.append(_attend(head, q[:, h * G : (h + 1) * G], k[:, h : h + 1], v[:, h : h + 1], *kept, step))
        return torch.cat(outs, dim=1)

    def reset(self) -> None:
        pass

    def nbytes(self) -> int:
        return 0


def _attend(layer: LayerCache, q, k, v, kept_k, kept_v, kept_pos, step: Step) -> torch.Tensor:
    """A chunk's queries q (B, Hq, n, D) over the held keys and values kept_k, kept_v (B, Hkv, S,
    D) at kept_pos (B, Hp, S) (None for the first chunk) and its own k, v (B, Hkv, n, D), under
    ``layer``'s visibility rules -> (B, Hq, n, D)."""
    rule = rules(layer)
    q_sink = layer.sink_queries(q, step)
    if kept_pos is None:
        return attention.causal(q, k, v, q_sink=q_sink, **rule)
    Hp = kept_pos.shape[1]
    new_pos = step.positions.unsqueeze(1).expand(-1, Hp, -1)
    cand_k = torch.cat((kept_k, k), dim=2)
    cand_v = torch.cat((kept_v, v), dim=2)
    cand_pos = torch.cat((kept_pos, new_pos), dim=2)
    if q_sink is None:
        return attention.masked(q, cand_k, cand_v, step.positions, cand_pos, **rule)
    if rule["scores"] is not None:
        # A family's scores rule needs the explicit softmax, which scores renumbered sinks itself.
        weight = step.positions.new_zeros(step.positions.shape, dtype=torch.float32)
        return attention.masked_with_weights(q, cand_k, cand_v, step.positions, cand_pos, weight, q_sink=q_sink,
                                             **rule)[0]
    return sink_biased(q, q_sink, cand_k, cand_v, step.positions, cand_pos, rule)
