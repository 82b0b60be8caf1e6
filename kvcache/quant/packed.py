"""Packed views: what a quantized storage's ``view`` returns instead of decoded tensors.

A ``PackedKeys`` or ``PackedValues`` describes the first S slots of a layer's buffers as codes
plus their scales. Attention (kvcache/kernels/) reads it one block of slots at a time and never decodes
the whole. A view is not a tensor: whatever else reads it asks for ``decoded()`` (a policy's
hooks get decoded keys and values from ``Candidates``), and a torch function given a view fails
rather than decoding the whole cache unseen.

A view may carry a full-precision ``tail`` (B, Hkv, T, D) after its S slots: the new tokens of
an evicting cache's chunk, which are attended (and ranked) with the kept slots before any of
them is placed. ``with_tail`` builds it.

Shapes: B batch rows, H K/V heads, S slots, D head_dim, Db = D * bits / 8 bytes of codes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..runtime import devices
from .codes import plane_bytes, unpack

# Key layouts, per slot (``PackedKeys.mode``).
CHANNEL = 0  # codes scaled per channel by the slot's group of ``group`` slots (KIVI)
TOKEN = 1  # codes scaled per token (``meta``), as values always are
RESIDUAL = 2  # full precision, in ``residual`` (the open group's newest tokens)


class _Packed:
    """Shared by PackedKeys and PackedValues: a view that is not a tensor.

    It has a shape, a device and a dtype; ``decoded()`` reads it back as a tensor and
    ``with_tail()`` appends new tokens. Nothing else applies to it: a torch function or a
    tensor method given a packed view fails, so that no code decodes a whole cache by accident.
    """

    codes: torch.Tensor
    dtype: torch.dtype
    tail: torch.Tensor | None

    @property
    def slots(self) -> int:
        """S, the packed slots (the tail excluded)."""
        return self.codes.shape[2]

    @property
    def shape(self) -> torch.Size:
        """(B, H, S + T, D): the packed slots, then the tail's T tokens."""
        B, H, S, _ = self.codes.shape
        return torch.Size((B, H, S + (0 if self.tail is None else self.tail.shape[2]), self.head_dim))

    @property
    def device(self) -> torch.device:
        return self.codes.device

    @property
    def requires_grad(self) -> bool:
        """Whether the view carries a gradient (only its tail can: codes carry none)."""
        return self.tail is not None and self.tail.requires_grad

    def detach(self):
        """The view with its tail detached."""
        return self if self.tail is None else dataclasses.replace(self, tail=self.tail.detach())

    def decoded(self) -> torch.Tensor:
        """Every slot read back at the model's dtype, the tail appended: (B, H, S + T, D)."""
        out = self.decode(0, self.slots)
        return out if self.tail is None else torch.cat((out, self.tail.to(out.dtype)), dim=2)

    def rows(self, r: slice):
        """The view of rows ``r`` alone (its tensors, every one batch first, sliced; nothing copied)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return dataclasses.replace(self, **{name: t[r] for name, t in fields.items() if isinstance(t, torch.Tensor)})

    def with_tail(self, tail: torch.Tensor):
        """The view followed by ``tail`` (B, H, T, D), full-precision tokens not yet placed (an
        evicting cache's chunk, attended and ranked with the kept slots)."""
        if self.tail is not None:
            tail = torch.cat((self.tail, tail), dim=2)
        return dataclasses.replace(self, tail=tail)


def after(x, stored: int) -> torch.Tensor:
    """The candidates of ``x`` (B, H, N, D) after its first ``stored``: a tensor's slice, or a
    packed view's tail (the packed slots being the ``stored`` ones)."""
    if isinstance(x, _Packed):
        if x.slots != stored or x.tail is None:
            raise ValueError(f"a packed view of {x.slots} slots and a tail of "
                             f"{0 if x.tail is None else x.tail.shape[2]} has no tokens after {stored}")
        return x.tail
    return x[:, :, stored:]


@dataclass(eq=False)
class PackedValues(_Packed):
    """Values kept per token.

    codes: (B, H, S, Db) uint8; meta: (B, H, S, 2 * n) fp16, the scales then the zero points of
    n groups of D / n channels per token. ``rotation`` (B, 1, D, D) float32 or None: the codes
    are of each value times it (quant/rotation.py), read back times its transpose. KIVI adds, as
    for its keys (``PackedKeys``): ``mode``, whose RESIDUAL slots read ``residual`` (B, H, group,
    D) at full precision, and the staged full-precision values of groups completed by the last
    write (``stage``, ``stage_of``, ``seal_pos``).
    """

    codes: torch.Tensor
    meta: torch.Tensor
    bits: int
    head_dim: int
    dtype: torch.dtype
    tail: torch.Tensor | None = None
    mode: torch.Tensor | None = None
    group: int = 0
    residual: torch.Tensor | None = None
    res_start: torch.Tensor | None = None
    stage: torch.Tensor | None = None
    stage_of: torch.Tensor | None = None
    seal_pos: torch.Tensor | None = None
    rotation: torch.Tensor | None = None

    def decode(self, s0: int, s1: int) -> torch.Tensor:
        """Slots [s0, s1) at the model's dtype: (B, H, s1 - s0, D)."""
        out = _unrotated(_decode_tokens(self.codes[:, :, s0:s1], self.meta[:, :, s0:s1], self.bits), self.rotation)
        if self.mode is not None:
            res = _rows_of(self.residual, self.res_start, s0, s1).float()
            out = torch.where(self.mode[:, :, s0:s1, None] == RESIDUAL, res, out)
        return out.to(self.dtype)

    def mix(self, p: torch.Tensor, s0: int, s1: int, q_pos: torch.Tensor | None = None,
            work: torch.Tensor | None = None, present: tuple[bool, bool, bool] | None = None) -> torch.Tensor:
        """sum_s p[..., s] * value[s] over slots [s0, s1): p (B, H, R, s1 - s0) float32 -> (B, H, R, D).
        ``q_pos`` (B, R): each row's position, for staged values (None: none are read).
        ``work``: a float32 buffer of at least (B, H, s1 - s0, D) to convert the codes into.
        ``present``: whether the slots hold CHANNEL, TOKEN, RESIDUAL keys, if the caller knows.

        Scales and zero points are applied to the weights, not to the codes: with n groups,
        p @ (q * scale + zero) = (p * scale) @ q + p @ zero per group, so the only pass over the
        block is converting its codes to float."""
        if self.mode is None:
            return self._mix_codes(p, s0, s1, work)
        resid = self.mode[:, :, s0:s1].unsqueeze(2) == RESIDUAL  # (B, H, 1, m)
        staged = _staged_mask(self, q_pos, s0, s1)  # (B, 1, R, m) or None
        full = resid if staged is None else resid | staged
        out = self._mix_codes(torch.where(full, 0.0, p), s0, s1, work)
        if present[RESIDUAL] if present is not None else _any(resid):
            # The weights of the residual slots gathered onto the open group's entries, then one
            # (R, group) @ (group, D) product: no copy of an entry per slot of the span.
            entry = _entry_of(self.res_start, s0, s1, self.residual.shape[2])[:, None, None, :].expand_as(p)
            w = p.new_zeros(p.shape[:3] + (self.residual.shape[2],))
            out = out + w.scatter_add_(-1, entry, torch.where(resid, p, 0.0)) @ self.residual.float()
        if staged is not None:
            out = out + torch.where(staged & ~resid, p, 0.0) @ _staged_rows(self, s0, s1).float()
        return out

    def _mix_codes(self, p: torch.Tensor, s0: int, s1: int, work: torch.Tensor | None) -> torch.Tensor:
        return _unrotated(self._mix_coded(p, s0, s1, work), self.rotation)

    def _mix_coded(self, p: torch.Tensor, s0: int, s1: int, work: torch.Tensor | None) -> torch.Tensor:
        """``_mix_codes`` in the codes' own (rotated) coordinates."""
        q = as_float(self.codes[:, :, s0:s1], self.bits, work)  # (B, H, m, D)
        scale, zero = self.meta[:, :, s0:s1].float().unflatten(-1, (2, -1)).unbind(-2)  # (B, H, m, n)
        n = scale.shape[-1]
        if n == 1:
            return (p * scale[..., 0].unsqueeze(-2)) @ q + p @ zero
        # Per group of channels: (B, H, n, R, m) @ (B, H, n, m, D / n).
        pg = p.unsqueeze(2) * scale.transpose(-1, -2).unsqueeze(-2)
        out = pg @ q.unflatten(-1, (n, -1)).transpose(2, 3) + (p @ zero).transpose(-1, -2).unsqueeze(-1)
        return out.permute(0, 1, 3, 2, 4).flatten(-2)


@dataclass(eq=False)
class PackedKeys(_Packed):
    """Keys, per token or (KIVI) per channel over groups of ``group`` slots.

    codes:    (B, H, S, Db) uint8.
    meta:     (B, H, S, 2 * n) fp16 per-token scales then zero points (n groups of channels);
              used by slots in TOKEN mode (every slot when ``mode`` is None). A CHANNEL slot
              (n = 1) holds minus its own scale there, which multiplies its per-channel reading:
              key = (code * S + Z) * -meta[..., 0] (quant/codes.py ``quantize_scaled``; -1 at
              widths without one).
    mode:     (B, H, S) uint8 CHANNEL / TOKEN / RESIDUAL, or None (per-token layout).
    rotation: (B, 1, D, D) float32 or None (per-token layout only): the codes are of each key
              times it (quant/rotation.py); a query is rotated alike before it scores them.
    channel:  (B, H, NB, 2, D) fp16 scale and zero point of each channel over each group of
              ``group`` slots (group j covers slots [j * group, (j + 1) * group)).
    residual: (B, H, group, D) full-precision keys of each row's open group, whose slot
              ``res_start[b] + i`` is entry i; ``res_start`` (B,) long, -1 when no group is open.
    stage, stage_of, seal_pos: what a query that precedes a group's completion saw. Groups
              completed by the write that preceded this view were full precision before it:
              stage (B, H, NS, group, D) holds them, stage_of (B, NB) long names each group's
              entry (-1: none), seal_pos (B, NB) long the position of the token that completed
              it. A query at a position below seal_pos reads the staged keys (chunk-independence:
              a chunk sees what token-by-token decoding saw).
    """

    codes: torch.Tensor
    meta: torch.Tensor
    bits: int
    head_dim: int
    dtype: torch.dtype
    tail: torch.Tensor | None = None
    mode: torch.Tensor | None = None
    channel: torch.Tensor | None = None
    group: int = 0
    residual: torch.Tensor | None = None
    res_start: torch.Tensor | None = None
    stage: torch.Tensor | None = None
    stage_of: torch.Tensor | None = None
    seal_pos: torch.Tensor | None = None
    rotation: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.rotation is not None and self.mode is not None:
            raise ValueError("rotated key codes are per token: a view with key modes (KIVI) takes no rotation")

    def decode(self, s0: int, s1: int) -> torch.Tensor:
        """Slots [s0, s1) at the model's dtype, as a query after every completed group reads them.
        Only the layouts the slots hold are computed (a sealed block: its groups' scales alone)."""
        if self.mode is None:
            out = _decode_tokens(self.codes[:, :, s0:s1], self.meta[:, :, s0:s1], self.bits)
            return _unrotated(out, self.rotation).to(self.dtype)
        mode = self.mode[:, :, s0:s1].unsqueeze(-1)
        B, H, m = mode.shape[:3]
        out = None
        if _any(mode == CHANNEL):
            out = self._channel_decode(s0, s1)
        if _any(mode == TOKEN):
            tok = _decode_tokens(self.codes[:, :, s0:s1], self.meta[:, :, s0:s1], self.bits)
            out = tok if out is None else torch.where(mode == TOKEN, tok, out)
        if _any(mode == RESIDUAL):
            res = _rows_of(self.residual, self.res_start, s0, s1).float()
            out = res if out is None else torch.where(mode == RESIDUAL, res, out)
        if out is None:  # no slot at all
            out = torch.zeros(B, H, m, self.head_dim, device=self.device)
        return out.to(self.dtype)

    def _channel_decode(self, s0: int, s1: int) -> torch.Tensor:
        """Slots [s0, s1) read per channel, float32 (B, H, m, D): (code * S + Z) * t with each
        group's S, Z and each key's own t; whole groups take their group's scales by broadcast."""
        G = self.group
        x = unpack(self.codes[:, :, s0:s1], self.bits).float()
        own = -self.meta[:, :, s0:s1, :1].float()  # (B, H, m, 1): each CHANNEL key's own scale
        whole = (s1 - s0) // G * G if s0 % G == 0 else 0
        if whole:
            scale, zero = self.channel[:, :, s0 // G : (s0 + whole) // G].float().unbind(-2)  # (B, H, n, D)
            x[:, :, :whole].unflatten(2, (-1, G)).mul_(scale.unsqueeze(3)).add_(zero.unsqueeze(3))
        if whole < s1 - s0:
            slots = torch.arange(s0 + whole, s1, device=self.device)
            scale, zero = self.channel[:, :, slots // G].float().unbind(-2)  # (B, H, m', D)
            x[:, :, whole:].mul_(scale).add_(zero)
        return x.mul_(own)

    def scores(self, q: torch.Tensor, q_pos: torch.Tensor | None, s0: int, s1: int,
               work: torch.Tensor | None = None, present: tuple[bool, bool, bool] | None = None) -> torch.Tensor:
        """q (B, H, R, D) float32, already scaled -> q . key[s] (B, H, R, s1 - s0) float32.

        ``q_pos`` (B, R): each query row's position, for staged groups (None: no staged reads).
        ``work``: a float32 buffer of at least (B, H, s1 - s0, D) to convert the codes into.
        ``present``: whether the slots hold CHANNEL, TOKEN, RESIDUAL keys, if the caller knows.
        Scales are applied to queries and scores, not to the codes: per token,
        q . (c * scale + zero) = scale * (q . c) + zero * sum(q); per channel over a group, with
        each key's own scale t, q . (c * S + Z) t = ((q * S) . c + q . Z) t."""
        q_codes = as_float(self.codes[:, :, s0:s1], self.bits, work)  # (B, H, m, D)
        if self.mode is None:
            return _token_scores(rotated(q, self.rotation), q_codes, self.meta[:, :, s0:s1].float())
        mode = self.mode[:, :, s0:s1].unsqueeze(2)  # (B, H, 1, m)
        has = present if present is not None else [_any(mode == m) for m in (CHANNEL, TOKEN, RESIDUAL)]
        if tuple(has) == (True, False, False):
            out = self._channel_scores(q, q_codes, s0, s1, work)  # a sealed block: nothing to choose
        else:
            out = q.new_zeros(q.shape[:3] + (s1 - s0,))
        if has[TOKEN]:
            out = torch.where(mode == TOKEN, _token_scores(q, q_codes, self.meta[:, :, s0:s1].float()), out)
        if has[CHANNEL] and has[TOKEN] | has[RESIDUAL]:
            out = torch.where(mode == CHANNEL, self._channel_scores(q, q_codes, s0, s1, work), out)
        if has[RESIDUAL]:
            # Each open-group entry scored once, (R, group), then read at the slots holding it.
            per_entry = q @ self.residual.float().transpose(-1, -2)  # (B, H, R, group)
            entry = _entry_of(self.res_start, s0, s1, self.residual.shape[2])[:, None, None, :]
            out = torch.where(mode == RESIDUAL, per_entry.gather(-1, entry.expand(out.shape)), out)
        staged = _staged_mask(self, q_pos, s0, s1)
        if staged is not None:
            out = torch.where(staged, q @ _staged_rows(self, s0, s1).float().transpose(-1, -2), out)
        return out

    def _channel_scores(self, q: torch.Tensor, q_codes: torch.Tensor, s0: int, s1: int,
                        work: torch.Tensor | None = None) -> torch.Tensor:
        """Scores of slots [s0, s1) (s0 a multiple of ``group``) as CHANNEL slots. ``q_codes``
        (B, H, m, D): the slots' codes as float, which ``as_float`` wrote into ``work`` if one is
        given. Where its rows reach the end of the last group, the rows past m stand in for the
        partial group's missing slots (their scores are cut off), so the groups are one batched
        product."""
        G = self.group
        m = s1 - s0
        n = -(-m // G)
        g0 = s0 // G
        scale, zero = self.channel[:, :, g0 : g0 + n].float().unbind(-2)  # (B, H, n, D)
        if work is not None and work.shape[2] >= n * G:
            whole, codes = n, work[:, :, : n * G, : q_codes.shape[-1]]
        else:
            whole, codes = m // G, q_codes  # a partial last group is scored on its own
        parts = []
        if whole:
            # (B, H, n, R, D) @ (B, H, n, D, G) -> (B, H, n, R, G)
            grouped = codes[:, :, : whole * G].unflatten(2, (whole, G))
            raw = (q.unsqueeze(2) * scale[:, :, :whole].unsqueeze(3)) @ grouped.transpose(-1, -2)
            raw = raw + (q @ zero[:, :, :whole].transpose(-1, -2)).transpose(-1, -2).unsqueeze(-1)
            parts.append(raw.permute(0, 1, 3, 2, 4).flatten(-2)[..., :m])
        if whole * G < m:
            # (B, H, R, D) @ (B, H, D, m - whole * G) with the last group's scales and zeros.
            tail = (q * scale[:, :, whole].unsqueeze(2)) @ q_codes[:, :, whole * G :].transpose(-1, -2)
            parts.append(tail + q @ zero[:, :, whole].unsqueeze(-1))
        raw = parts[0] if len(parts) == 1 else torch.cat(parts, -1)
        own = -self.meta[:, :, s0:s1, 0].float().unsqueeze(2)  # (B, H, 1, m): each key's own scale
        return raw * own


def as_float(codes: torch.Tensor, bits: int, work: torch.Tensor | None = None) -> torch.Tensor:
    """Packed codes (B, H, m, Db) as float32 (B, H, m, D), written into ``work`` if given (a
    reused buffer: converting into fresh memory every block costs page faults)."""
    B, H, m, Db = codes.shape
    D = Db * 8 // bits
    if work is None:
        return unpack(codes, bits).float()
    out = work[:, :, :m, :D]
    parts = plane_bytes(bits, D)
    if len(parts) == 1:
        if bits == 8:
            return out.copy_(codes)
        per, mask = 8 // bits, 2**bits - 1
        lanes = out.unflatten(-1, (Db, per))
        for j in range(per):
            lanes[..., j].copy_((codes >> (j * bits)) & mask)
        return out
    # Split widths (quant/codes.py): their codes as bytes first, then one conversion.
    return out.copy_(unpack(codes, bits))


def rotated(x: torch.Tensor, rotation: torch.Tensor | None) -> torch.Tensor:
    """x (B, H, R, D) float32 in the coordinates of codes made under ``rotation`` (B, 1, D, D)."""
    return x if rotation is None else x @ rotation


def _unrotated(x: torch.Tensor, rotation: torch.Tensor | None) -> torch.Tensor:
    """x (B, H, R, D) float32, read in rotated coordinates, back in the model's."""
    return x if rotation is None else x @ rotation.transpose(-1, -2)


def _any(mask: torch.Tensor) -> bool:
    """Whether any element is set; True where a host read is not free (compiling, or off the
    CPU): every branch is computed."""
    return not devices.host_reads_free(mask) or bool(mask.any())


def _entry_of(res_start: torch.Tensor, s0: int, s1: int, group: int) -> torch.Tensor:
    """(B, m): the residual entry each slot of [s0, s1) reads (garbage where not RESIDUAL)."""
    slots = torch.arange(s0, s1, device=res_start.device)
    return (slots[None, :] - res_start[:, None]).clamp(0, group - 1)


def _rows_of(residual: torch.Tensor, res_start: torch.Tensor, s0: int, s1: int) -> torch.Tensor:
    """(B, H, m, D): the residual entry of each slot of [s0, s1) (garbage where not RESIDUAL)."""
    B, H, G, D = residual.shape
    idx = _entry_of(res_start, s0, s1, G)  # (B, m)
    return residual.gather(2, idx[:, None, :, None].expand(B, H, -1, D))


def _staged_mask(x, q_pos: torch.Tensor | None, s0: int, s1: int) -> torch.Tensor | None:
    """(B, 1, R, m) bool: which query rows read slots [s0, s1) from the staged full-precision
    copy (their group was completed after them, within the last write), or None."""
    if q_pos is None or x.stage_of is None:
        return None
    groups = torch.arange(s0, s1, device=q_pos.device) // x.group
    entry = x.stage_of[:, groups]  # (B, m)
    if not bool((entry >= 0).any()):
        return None
    return (entry >= 0)[:, None, None, :] & (q_pos[:, None, :, None] < x.seal_pos[:, groups][:, None, None, :])


def _staged_rows(x, s0: int, s1: int) -> torch.Tensor:
    """(B, H, m, D): the staged copy of slots [s0, s1) (garbage where not staged)."""
    G = x.group
    B, H, NS, _, D = x.stage.shape
    slots = torch.arange(s0, s1, device=x.stage.device)
    entry = x.stage_of[:, slots // G].clamp(min=0)  # (B, m)
    idx = entry * G + slots % G
    return x.stage.flatten(2, 3).gather(2, idx[:, None, :, None].expand(B, H, -1, D))


def _decode_tokens(codes: torch.Tensor, meta: torch.Tensor, bits: int) -> torch.Tensor:
    """Per-token codes (B, H, m, Db) and meta (B, H, m, 2n) -> float32 (B, H, m, D)."""
    q = unpack(codes, bits).float()
    scale, zero = meta.float().unflatten(-1, (2, -1)).unbind(-2)  # (B, H, m, n)
    n = scale.shape[-1]
    g = q.unflatten(-1, (n, -1)) * scale.unsqueeze(-1) + zero.unsqueeze(-1)
    return g.flatten(-2)


def _token_scores(q: torch.Tensor, q_codes: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
    """q (B, H, R, D) against per-token codes (B, H, m, D) with meta (B, H, m, 2n): (B, H, R, m)."""
    scale, zero = meta.unflatten(-1, (2, -1)).unbind(-2)  # (B, H, m, n)
    n = scale.shape[-1]
    if n == 1:
        raw = q @ q_codes.transpose(-1, -2)
        return raw * scale[..., 0].unsqueeze(-2) + q.sum(-1, keepdim=True) * zero[..., 0].unsqueeze(-2)
    # Per group of channels: (B, H, n, R, D / n) @ (B, H, n, D / n, m).
    qg = q.unflatten(-1, (n, -1)).transpose(2, 3)
    raw = qg @ q_codes.unflatten(-1, (n, -1)).permute(0, 1, 3, 4, 2)  # (B, H, n, R, m)
    raw = raw * scale.permute(0, 1, 3, 2).unsqueeze(-2) + qg.sum(-1, keepdim=True) * zero.permute(0, 1, 3, 2).unsqueeze(-2)
    return raw.sum(2)
