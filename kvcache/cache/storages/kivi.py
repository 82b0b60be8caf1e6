"""``kivi<bits>[/<group>]``: KIVI. Values per token (as ``token``); keys per channel over groups
of ``group`` consecutive slots (default 64), which share one scale and zero point per channel.
Keys have a few large fixed-sign channels (after RoPE), which per-token scales spend their
levels on; per-channel scales do not. The newest tokens of a group that is not yet full stay at
full precision (the residual) until the group fills. At 2 and 3 bits each per-channel key also
has a scale of its own (quant/codes.py ``quantize_scaled``); at 2 bits values are in 4 groups of
channels.

Per-channel groups under eviction (``KiviStorage``): a group's scales are set once, when every
slot of the group has received a token in slot order (dense and ring caches, and scoring caches
while they fill), and never re-quantized. Every key is also quantized per token when written,
so a slot can fall back to its own scale: a token written anywhere else (a scoring policy's
decode step placing its token over the evicted one, a slot past a partly rewritten group) is
kept per token, and the group keeps its scales for the tokens still in it. A policy that moves
a per-channel key to another slot (a chunk's gather) re-quantizes it per token, once: the only
time a key's codes are computed from codes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ...kernels import fused
from ...quant.codes import KEY_TOKEN_SCALE, VALUE_GROUPS, encode_tokens, key_clip, pack, quantize, quantize_scaled, unpack
from ...quant.packed import CHANNEL, RESIDUAL, TOKEN, PackedKeys, PackedValues, after
from ...runtime import devices
from ..base import CacheSpec
from ..slots import put
from .token import TokenStorage, _encode_pair, _stackable

# Queries per fused call of ``KiviStorage.attend_chunk``: their mask (queries x slots) stays small.
CHUNK_QUERIES = 256
# Keys (slots x K/V heads) a chunk's write quantizes per channel at a time: its temporaries (a few
# float32 copies of them, more at 2 bits' clipped-range search) stay a few MiB whatever the chunk.
SEAL_SLOTS = 2048
# The per-token scale of a key kept per channel: its per-token meta is never read as such, so a
# negative scale (scales are never negative) says the slot's mode instead of a mode byte per slot.
# It is the negated scale of the key on top of its group's per channel (``quantize_scaled``), at
# widths that take one (``KEY_TOKEN_SCALE``), else this mark: a factor of 1.
CHANNEL_MARK = -1.0


class KiviStorage(TokenStorage):
    """KIVI: values per token (as ``TokenStorage``), keys per channel over groups of ``group``
    consecutive slots, with a full-precision residual (module docstring).

    k, v, k_meta, v_meta, pos: as ``TokenStorage``; ``k_meta`` holds each key's per-token scale
                  and zero point (one group of channels), used by slots in TOKEN mode; for a
                  key kept per channel, minus its scale on top of the group's (2-bit keys,
                  ``quant/codes.py`` ``quantize_scaled``) or ``CHANNEL_MARK`` (a factor of 1).
                  Values are per token in ``VALUE_GROUPS`` groups of channels (2 bits: 4, when
                  head_dim allows), else one.
    k_mode:       (B, Hkv, C + 1) uint8, derived (``modes``), not stored: RESIDUAL for the
                  slots of each row's open group, CHANNEL where ``k_meta`` holds the mark,
                  TOKEN elsewhere (quant/packed.py). Values of RESIDUAL slots are read at full
                  precision too, the others from their codes.
    k_channel:    (B, Hkv, C // group + 1, 2, D) fp16: per-channel scale and zero point of each
                  group of slots (only whole groups are used: a group cut short by the end of
                  the cache, and the scratch slot, keep their keys per token).
    k_residual, v_residual: (B, Hkv, group, D) model dtype: keys and values of each row's open
                  group, the first ``fill[b]`` of its slots from ``res_start[b]`` (-1: none open).
    res_start, fill: (B,) long, on the buffers' device (a decode step reads no host state).
    """

    layout = "kivi"
    exact_roundtrip = False
    # A per-channel key that moves is re-quantized per token (``keep``): survivors should stay.
    keeps_in_place = True
    # Key groups (``k_channel``) and which of them are cut short are laid out for the cache_length.
    grows = False
    # Slots per key group, when the name does not say.
    default_group = 64

    @staticmethod
    def describe(bits: int) -> str:
        return (f"KIVI, {bits}-bit: keys per channel over groups of {KiviStorage.default_group} slots (newest in "
                f"full precision until their group fills), values per token; fp16 scales. More bytes than token{bits} "
                f"(the residual of {KiviStorage.default_group} tokens per row and layer, the per-channel scales): "
                f"several times more on caches of a few hundred slots, where token{bits} is the leaner choice")

    @classmethod
    def check(cls, name: str, bits: int, group: int | None, head_dim: int) -> None:
        """Raise ValueError if ``bits`` cannot hold keys of ``head_dim`` channels: the group counts
        slots here, so only the token layout's whole-bytes rule applies."""
        super().check(name, bits, None, head_dim)

    @classmethod
    def build(cls, spec: CacheSpec, bits: int, group: int | None, per_head: bool = False,
              limit: int | None = None) -> KiviStorage:
        return cls(spec, bits, per_head, group or cls.default_group, limit)

    def __init__(self, spec: CacheSpec, bits: int, per_head: bool = False, group: int = 64,
                 limit: int | None = None) -> None:
        # Values stay per token, in groups of channels at 2 bits (``value_group``), as KIVI keeps them.
        super().__init__(spec, bits, per_head, self.value_group(bits, spec.head_dim), limit)
        B, H, C, D = spec.batch_size, spec.num_kv_heads, spec.cache_length, spec.head_dim
        dev = spec.device
        self.key_group = group
        # Clipped ranges searched when a group of keys is quantized per channel (quant/codes.py;
        # none: min-max). Keys per token and values are quantized over their min-max range.
        self.key_clip = key_clip(bits)
        # Whether per-channel keys take a scale per key too (``quantize_scaled``).
        self.key_token_scale = bits in KEY_TOKEN_SCALE
        self.k_meta = torch.zeros(B, H, C + 1, 2, dtype=torch.float16, device=dev)
        self.k_channel = torch.zeros(B, H, C // group + 1, 2, D, dtype=torch.float16, device=dev)
        self.k_residual = torch.zeros(B, H, group, D, dtype=spec.dtype, device=dev)
        self.v_residual = torch.zeros_like(self.k_residual)
        self.res_start = torch.full((B,), -1, dtype=torch.long, device=dev)
        self.fill = torch.zeros(B, dtype=torch.long, device=dev)
        # What the last write completed, for the queries of its chunk that preceded completion:
        # (stage_k, stage_v, stage_of, seal_pos), see PackedKeys. Not state: a view of the
        # next attention call only.
        self._staged: tuple[torch.Tensor, ...] | None = None

    @staticmethod
    def value_group(bits: int, head_dim: int) -> int | None:
        """Channels per value group: head_dim / ``VALUE_GROUPS[bits]`` where that fills whole bytes
        of codes, else None (one group over the head)."""
        n = VALUE_GROUPS.get(bits, 1)
        g = head_dim // n
        return g if n > 1 and head_dim % n == 0 and g * bits % 8 == 0 else None

    def _quantize_keys(self, x: torch.Tensor, given: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Groups of keys x (..., G, D) per channel: codes, per-channel scale and zero (..., 1, D),
        and what each key's ``k_meta`` holds (..., G, 2): minus its own scale (2 bits) or the mark.
        ``given`` (..., G, 1): the own scales that kept keys keep (``quantize_scaled``)."""
        if self.key_token_scale:
            q, scale, zero, t = quantize_scaled(x, self.bits, clip=self.key_clip, given=given)
            meta = torch.cat((-t, torch.full_like(t, CHANNEL_MARK)), -1)
        else:
            q, scale, zero = quantize(x, self.bits, dim=-2, clip=self.key_clip)
            meta = torch.full(x.shape[:-1] + (2,), CHANNEL_MARK, dtype=torch.float16, device=x.device)
        return q, scale, zero, meta

    def modes(self, span: int) -> torch.Tensor:
        """Each key's layout in slots [0, span): (B, Hkv, span) uint8 CHANNEL, TOKEN or RESIDUAL."""
        slot = torch.arange(span, device=self.k.device)
        start = self.res_start[:, None]
        resid = (self.fill[:, None] > 0) & (slot >= start) & (slot < start + self.fill[:, None])  # (B, span)
        channel = self.k_meta[:, :, :span, 0] < 0
        mode = torch.where(channel, CHANNEL, TOKEN)
        return torch.where(resid[:, None], RESIDUAL, mode).to(torch.uint8)

    @property
    def k_mode(self) -> torch.Tensor:
        """Every slot's key layout (``modes``): (B, Hkv, C + 1) uint8."""
        return self.modes(self.pos.shape[2])

    def _mark_channel(self, where: torch.Tensor, j0: int = 0) -> None:
        """Mark the keys of slots [j0, j0 + n) where ``where`` (B, Hkv, n) is set as per channel
        (those marked already keep their meta: their own scale)."""
        meta = self.k_meta[:, :, j0 : j0 + where.shape[-1]]
        meta.copy_(torch.where(where[..., None] & (meta[..., :1] >= 0), CHANNEL_MARK, meta))

    @property
    def whole_groups(self) -> int:
        """Groups of slots that can be quantized per channel: those that end before slot C."""
        return (self.pos.shape[2] - 1) // self.key_group

    def encode_keys(self, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token key codes (the TOKEN layout): one group of channels per token and head."""
        return encode_tokens(k, self.bits, self.head_dim)

    def roundtrip(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The new tokens as an evicting cache's chunk attends them before placing them: values as
        stored per token, keys at full precision, since their layout depends on where they are
        placed (as KIVI attends a prompt before quantizing it)."""
        vq, vm = self.encode(v)
        v = self.decode(vq, vm)
        self._read_back = (None, (v, vq, vm))
        return k, v

    def _encoded(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        vr = self._reuse(v, 1)
        if vr is None and self.group == self.head_dim and _stackable(k, v):
            # Keys per token and values share one group of channels: one call for both.
            return _encode_pair(self.encode_keys, k, v)
        kq, km = self.encode_keys(k)
        vq, vm = vr or self.encode(v)
        return kq, vq, km, vm

    # ----- writes in slot order: the residual and its groups --------------------------------
    def write_slice(self, start: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        B, T = positions.shape
        C = self.pos.shape[2] - 1
        self._staged = None
        if start == C:
            # The scratch slot (a scoring policy's decode step stages its token there): per token.
            super().write_slice(start, k, v, positions)
            return
        self.write(torch.arange(start, start + T, device=self.k.device).expand(B, T), k, v, positions)

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """Write token t of row b to slot ``slots[b, t]``; positions: (B, T). Every key is coded per
        token; a run of slots that starts a group (or continues the row's open group) is kept in
        the residual instead, and a group it completes is quantized per channel."""
        self._staged = None
        slots = slots.to(self.k.device)
        # Per-token meta for every written key: each is TOKEN unless it lies in the open group.
        super().write(slots, k, v, positions)
        if not self.whole_groups:
            return
        if slots.shape[1] == 1:
            self._write_one(slots[:, 0], k[:, :, 0], v[:, :, 0])
        else:
            self._write_runs(slots, k, v, positions)

    def _write_one(self, s: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """One token per row at slots ``s`` (B,), k, v (B, H, D): fixed shapes and no host reads
        (but one on the CPU, eager), so a captured decode step runs it. The ``_Runs`` rules for a
        single token."""
        G, C, NG = self.key_group, self.pos.shape[2] - 1, self.whole_groups
        B, H, D = k.shape
        real = s < C
        group, offset = s // G, s % G
        open_ = self.fill > 0
        cont = real & open_ & (group * G == self.res_start) & (offset == self.fill)
        starts = real & (offset == 0) & (group < NG)
        resid = cont | starts
        # An abandoned group's slots fall back to the per-token codes written with them (their
        # mode follows res_start and fill).
        abandon = real & open_ & ~cont
        at = offset.clamp(max=G - 1)[:, None, None]  # (B, 1, 1)
        index = at[..., None].expand(B, H, 1, D)
        for buf, x in ((self.k_residual, k), (self.v_residual, v)):
            put(buf, at, torch.where(resid[:, None, None, None], x[:, :, None].to(buf.dtype), buf.gather(2, index)))
        fill = torch.where(resid, offset + 1, torch.where(abandon, 0, self.fill))
        res_start = torch.where(resid, group * G, torch.where(abandon, -1, self.res_start))
        seal = resid & (offset == G - 1)
        # On the CPU, eager, a step that completes no group skips the sealing below (it would
        # change nothing; a host read costs nothing there). Captured or on a GPU it always runs.
        if not devices.host_reads_free(seal) or bool(seal.any()):
            self._seal_one(seal, group)
        self.fill.copy_(torch.where(seal, 0, fill))
        self.res_start.copy_(torch.where(seal, -1, res_start))

    def _seal_one(self, seal: torch.Tensor, group: torch.Tensor) -> None:
        """Quantize every row's residual per channel and keep the result where ``seal`` (B,) says
        the row completed its group ``group`` (B,) (``_write_one``)."""
        G, NG, D = self.key_group, self.whole_groups, self.head_dim
        B, H = self.k.shape[:2]
        q, scale, zero, kmeta = self._quantize_keys(self.k_residual)
        g = group.clamp(max=NG - 1)
        slots = (g[:, None] * G + torch.arange(G, device=g.device))[:, None, :]  # (B, 1, G)
        sealed = seal[:, None, None, None]
        codes = self.k.gather(2, slots[..., None].expand(B, H, G, self.k.shape[-1]))
        put(self.k, slots, torch.where(sealed, pack(q, self.bits), codes))
        put(self.k_meta, slots, torch.where(sealed, kmeta, self.k_meta.gather(2, slots[..., None].expand(B, H, G, 2))))
        meta = torch.cat((scale, zero), 2).unsqueeze(2)  # (B, H, 1, 2, D)
        column = g[:, None, None]  # (B, 1, 1)
        old = self.k_channel.gather(2, column[..., None, None].expand(B, H, 1, 2, D))
        put(self.k_channel, column, torch.where(sealed[..., None], meta, old))

    def _write_runs(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """A chunk: plan its runs on the host (``_Runs``), stage each residual run's keys and
        values at full precision, seal the groups they complete, keep the last open one."""
        B, H, T, D = k.shape
        G, dev = self.key_group, self.k.device
        res_start, fill = self.res_start.cpu(), self.fill.cpu()
        # An abandoned group falls back to per-token keys, an open one is RESIDUAL: both follow
        # res_start and fill, set at the end.
        slots = slots.cpu()
        plan = _Runs(slots, self.pos.shape[2] - 1, G, self.whole_groups, res_start, fill)
        if plan.runs:
            NS = plan.runs
            if plan.aligned(slots):
                # Every row writes whole groups from a group's first slot, in slot order: run r is
                # the chunk's tokens [r G, (r + 1) G), so the staged groups are views of k and v
                # (the last, open one, if any, goes to the residual).
                stages = [x.to(residual.dtype)[:, :, : T // G * G].unflatten(2, (T // G, G))
                          for x, residual in ((k, self.k_residual), (v, self.v_residual))]
            else:
                index = torch.where(plan.resid, plan.run * G + plan.offset, NS * G).to(dev)  # (B, T)
                stages = []
                for x, residual in ((k, self.k_residual), (v, self.v_residual)):
                    # (B, H, NS + 1, G, D): one group per run, and a last one for the tokens of no run.
                    stage = x.new_zeros(B, H, NS + 1, G, D, dtype=residual.dtype)
                    stage.view(B, H, (NS + 1) * G, D).scatter_(2, index[:, None, :, None].expand(B, H, T, D),
                                                              x.to(residual.dtype))
                    for b, r in plan.continued:
                        stage[b, :, r, : int(fill[b])] = residual[b, :, : int(fill[b])]
                    stages.append(stage[:, :, :NS])
            bs, rs = plan.sealed.nonzero(as_tuple=True)
            if bs.numel():
                self._seal(stages[0], bs, rs, plan.group[bs, rs])
            for b, r in enumerate(plan.open_run):
                if r < 0:
                    continue
                if r < stages[0].shape[2]:
                    self.k_residual[b], self.v_residual[b] = stages[0][b, :, r], stages[1][b, :, r]
                else:  # aligned: the open run is the chunk's last T mod G tokens
                    n = T - r * G
                    for x, residual in ((k, self.k_residual), (v, self.v_residual)):
                        residual[b, :, :n] = x[b, :, r * G :]
                        residual[b, :, n:] = 0
            if bs.numel():
                NB = self.k_channel.shape[2]
                stage_of = torch.full((B, NB), -1, dtype=torch.long, device=dev)
                seal_pos = torch.full((B, NB), -1, dtype=torch.long, device=dev)
                groups = plan.group[bs, rs].to(dev)
                stage_of[bs.to(dev), groups] = rs.to(dev)
                seal_pos[bs.to(dev), groups] = plan.last_pos(bs, rs, positions.cpu()).to(dev)
                self._staged = (stages[0], stages[1], stage_of, seal_pos)
        touched = plan.any_real.to(dev)
        self.res_start.copy_(torch.where(touched, plan.res_start.to(dev), self.res_start))
        self.fill.copy_(torch.where(touched, plan.fill.to(dev), self.fill))

    def _seal(self, stage: torch.Tensor, bs: torch.Tensor, rs: torch.Tensor, groups: torch.Tensor) -> None:
        """Quantize the staged keys of runs (bs, rs) per channel over their groups and store them,
        ``SEAL_SLOTS`` slots at a time (groups are quantized on their own: the temporaries
        follow that, not the chunk)."""
        G, dev = self.key_group, self.k.device
        step = max(1, SEAL_SLOTS // (G * stage.shape[1]))
        for i in range(0, bs.numel(), step):
            b_idx, g_idx = bs[i : i + step].to(dev), groups[i : i + step].to(dev)
            q, scale, zero, kmeta = self._quantize_keys(stage[b_idx, :, rs[i : i + step].to(dev)])  # (n, H, G, D)
            self.k_channel[b_idx, :, g_idx] = torch.cat((scale, zero), 2)  # (n, H, 2, D)
            slot = g_idx[:, None] * G + torch.arange(G, device=dev)  # (n, G)
            rows = b_idx[:, None].expand_as(slot)
            self.k[rows, :, slot] = pack(q, self.bits).transpose(1, 2)  # (n, G, H, Db)
            self.k_meta[rows, :, slot] = kmeta.transpose(1, 2)  # (n, G, H, 2)

    # ----- moves: settle and keep --------------------------------------------------------------
    def settle(self, dst: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """Move the scratch slot's token (kept per token) over slot ``dst`` (B, Hp, 1). A token
        placed inside a row's open group breaks its run: the group falls back to per-token keys.
        No host reads (a captured decode step runs this)."""
        self._staged = None
        G = self.key_group
        hit = (self.fill > 0) & ((dst // G) * G == self.res_start[:, None, None]).flatten(1).any(1)
        self.fill.masked_fill_(hit, 0)
        self.res_start.masked_fill_(hit, -1)
        # The scratch slot's per-token meta moves with it: the token is TOKEN where it lands.
        super().settle(dst, k, v, positions)

    def keep(self, k, v, pos: torch.Tensor, index: torch.Tensor, stored: int = 0) -> None:
        """As ``TokenStorage.keep``. Per destination slot: a per-channel key that stays in its slot
        keeps its codes; one that moves is re-quantized per token; a whole group whose every slot
        receives a new token is quantized per channel from their full-precision keys; anything
        else is kept per token. No group stays open."""
        self._staged = None
        B, H = self.k.shape[:2]
        C, dev = index.shape[-1], self.k.device
        idx = index.expand(B, H, C)
        new_k = after(k, stored)
        NEW = 255
        src_mode = torch.full((B, H, C), NEW, dtype=torch.uint8, device=dev)
        if stored:
            src_mode = torch.where(idx < stored, self.modes(stored).gather(2, idx.clamp(max=stored - 1)), src_mode)
        # Values, and every key's per-token codes (a new token's from its full-precision key).
        super().keep(k, v, pos, index, stored)
        slot = torch.arange(C, device=dev)
        moved = (src_mode == CHANNEL) & (idx != slot)
        if bool(moved.any()):
            self._requantize_moved(idx, moved)
        stays = (idx == slot) & (src_mode != NEW)
        mode = torch.where((src_mode == CHANNEL) & stays, CHANNEL, TOKEN).to(torch.uint8)
        NG = min(self.whole_groups, C // self.key_group)
        if NG:
            # Whole groups whose every slot receives a new token: quantized per channel.
            G = self.key_group
            fresh = (src_mode[..., : NG * G] == NEW).view(B, H, NG, G)
            whole = fresh.all(-1)  # (B, H, NG)
            if bool(whole.any()):
                self._seal_kept(new_k, idx[..., : NG * G] - stored, whole, mode)
            # Groups of kept keys that stayed in place and new tokens (what ``in_place`` makes):
            # sealed again, so that the new tokens are kept per channel too.
            unmoved = (stays[..., : NG * G].view(B, H, NG, G) | fresh).all(-1)
            sealed = (mode[..., : NG * G] == CHANNEL).view(B, H, NG, G).all(-1)
            # (Not groups with empty slots: their stale contents would widen the range.)
            occupied = (self.pos[:, :, : NG * G] >= 0).expand(B, H, NG * G).reshape(B, H, NG, G).all(-1)
            again = unmoved & occupied & ~sealed & ~whole
            if bool(again.any()):
                self._seal_kept(new_k, idx[..., : NG * G] - stored, again, mode, fresh.flatten(2))
        self._mark_channel(mode == CHANNEL)
        self.res_start.fill_(-1)
        self.fill.zero_()

    def _requantize_moved(self, idx: torch.Tensor, moved: torch.Tensor) -> None:
        """The per-channel keys that moved to another slot (B, H, C) get per-token codes from
        their old codes (gathered by ``TokenStorage.keep`` already) and old group's scales."""
        B, H, C = idx.shape
        G, D = self.key_group, self.head_dim
        for j0 in range(0, C, 1024):
            j1 = min(j0 + 1024, C)
            m = moved[..., j0:j1]
            if not bool(m.any()):
                continue
            grp = (idx[..., j0:j1] // G).clamp(max=self.k_channel.shape[2] - 1)  # (B, H, n) source groups
            meta = self.k_channel.gather(2, grp[..., None, None].expand(B, H, j1 - j0, 2, D)).float()
            # (Their own scales, on top of their group's, came with them: minus ``k_meta``'s.)
            own = -self.k_meta[:, :, j0:j1, :1].float()
            x = (unpack(self.k[:, :, j0:j1], self.bits).float() * meta[..., 0, :] + meta[..., 1, :]) * own
            codes, km = encode_tokens(x, self.bits, D)
            self.k[:, :, j0:j1] = torch.where(m[..., None], codes, self.k[:, :, j0:j1])
            self.k_meta[:, :, j0:j1] = torch.where(m[..., None], km, self.k_meta[:, :, j0:j1])

    def _seal_kept(self, new_k: torch.Tensor, src: torch.Tensor, groups: torch.Tensor, mode: torch.Tensor,
              fresh: torch.Tensor | None = None) -> None:
        """Quantize per channel the groups ``groups`` (B, H, NG). Each of their slots holds a new
        token (at ``src`` (B, H, NG * group) in ``new_k`` (B, H, T, D)) where ``fresh`` (B, H,
        NG * group) says so, or everywhere without ``fresh``; elsewhere a kept key in its own
        slot, read as it is now (its group's scales, its own, or the residual). A kept key
        re-quantized over a range that the new tokens did not widen gets its codes back."""
        B, H, NG = groups.shape
        G, D = self.key_group, self.head_dim
        keys = None if fresh is None else self.view(NG * G)[0]
        step = max(1, 1024 // G)
        for g0 in range(0, NG, step):
            g1 = min(g0 + step, NG)
            w = groups[..., g0:g1]
            if not bool(w.any()):
                continue
            j0, j1 = g0 * G, g1 * G
            x = new_k.gather(2, src[..., j0:j1].clamp(min=0)[..., None].expand(B, H, j1 - j0, D))
            given = None
            if fresh is not None:
                x = torch.where(fresh[..., j0:j1, None], x, keys.decode(j0, j1).to(x.dtype))
                # A kept per-channel key keeps its own scale (``quantize_scaled``): no drift.
                own = -self.k_meta[:, :, j0:j1, :1]
                given = torch.where(fresh[..., j0:j1, None], 0.0, own.clamp(min=0)).view(B, H, g1 - g0, G, 1)
            q, scale, zero, kmeta = self._quantize_keys(x.view(B, H, g1 - g0, G, D), given)
            slot_w = w.repeat_interleave(G, -1)
            self.k[:, :, j0:j1] = torch.where(slot_w[..., None], pack(q, self.bits).flatten(2, 3), self.k[:, :, j0:j1])
            self.k_meta[:, :, j0:j1] = torch.where(slot_w[..., None], kmeta.flatten(2, 3), self.k_meta[:, :, j0:j1])
            meta = torch.cat((scale, zero), 3)  # (B, H, n, 2, D)
            self.k_channel[:, :, g0:g1] = torch.where(w[..., None, None], meta, self.k_channel[:, :, g0:g1])
            mode[..., j0:j1] = torch.where(slot_w, CHANNEL, mode[..., j0:j1])

    # ----- reading -----------------------------------------------------------------------------
    def view(self, span: int) -> tuple[PackedKeys, PackedValues, torch.Tensor]:
        """The first ``span`` slots, packed: per-channel, per-token and residual keys as the
        slots hold them, and what the last write completed for queries that preceded it."""
        stage_k, stage_v, stage_of, seal_pos = self._staged if self._staged is not None else (None,) * 4
        mode = self.modes(span)
        shared = dict(mode=mode, group=self.key_group, res_start=self.res_start, stage_of=stage_of, seal_pos=seal_pos)
        keys = PackedKeys(self.k[:, :, :span], self.k_meta[:, :, :span], self.bits, self.head_dim, self.dtype,
                          channel=self.k_channel, residual=self.k_residual, stage=stage_k, **shared)
        values = PackedValues(self.v[:, :, :span], self.v_meta[:, :, :span], self.bits, self.head_dim, self.dtype,
                              residual=self.v_residual, stage=stage_v, **shared)
        return keys, values, self.pos[:, :, :span]

    def attend_chunk(self, q: torch.Tensor, q_pos: torch.Tensor, n_tokens: torch.Tensor,
                     window: int | None) -> torch.Tensor:
        """Attention of a chunk just written in slot order (slot s holds position s, as a dense
        cache writes), each query reading the slots as it would at its position, exactly as the
        packed kernel reads them (``PackedKeys``), but over decoded slots with the fused kernel,
        a block of slots at a time (kernels/fused.py), so no full-precision copy of the cache is held.

        q: (B, Hq, T, D) at q_pos (B, T); the first ``n_tokens[b]`` (CPU) of row b are real;
        ``window``: the model's sliding window. Returns (B, Hq, T, D), zero at padding.

        A query reads every slot as it is now (groups quantized per channel once complete, the
        open group at full precision), except the group it belongs to when this write completed
        that group after it: that group's keys and values were still full precision (staged).
        Every slot is read as it is now by the queries at or after its group's seal (the
        position whose token completed the group in this write; every query, for a group not
        completed by it), and from its staged copy by the queries of its group before the seal:
        the copies are appended as extra keys to the last block a query block reads, under a
        mask of those two rules. Rows that differ in positions or staging go one at a time.
        Afterwards nothing is staged: a later query reads every slot as it is now.

        Two regions, so that what is held follows a block of queries, not the chunk: the groups
        sealed before the chunk (its stored past, read as they are now by every query) are
        decoded a block at a time and attended by all the chunk's queries, folded into one
        float32 output per query; the slots from there on (the chunk's own, and the open group
        it continued) are attended a block of queries at a time, each folded on its own and
        written out at q's dtype, their blocks decoded once and kept for the later query blocks
        (at most the chunk's own slots, which its keys and values hold at full precision anyway).
        """
        B, T = q_pos.shape
        starts = q_pos[:, 0].cpu()
        span = int((starts + n_tokens).max())
        keys, values, k_pos = self.view(span)
        staged = self._staged
        uniform = bool((starts == starts[0]).all() and (n_tokens == n_tokens[0]).all())
        rows = [slice(0, B)] if uniform and (staged is None or bool((staged[2] == staged[2][:1]).all())) else \
            [slice(b, b + 1) for b in range(B)]
        G = self.key_group
        single = not fused.folds(q)
        out = torch.zeros_like(q)
        past_fold = None
        for r in rows:
            n = int(n_tokens[r].max())
            if n == 0:
                continue
            seal, copies = self._staged_reads(r, span, q.device)
            pos_r = k_pos[r.start, 0]
            keys_r, values_r = keys.rows(r), values.rows(r)
            # Groups sealed before the chunk's first position: every query reads them as they are.
            past = 0 if single else int(starts[r.start]) // G * G
            if past:
                if past_fold is None:
                    past_fold = fused.Fold(q)
                self._attend_past(past_fold, r, n, q_pos, keys_r, values_r, pos_r, past, q, window)
            # The slots from ``past`` on, decoded a block at a time as the query blocks reach them
            # and kept (one buffer), so that a query block reads them in one call or two.
            decoded = _Decoded(keys_r, values_r, past, span, fused.slot_blocks(keys_r, span, q, G, start=past))
            read = _RowsRead(q, q_pos, r, pos_r, past, past_fold, decoded, seal, copies, span, window, single, G)
            for t0 in range(0, n, CHUNK_QUERIES):
                t1 = min(n, t0 + CHUNK_QUERIES)
                out[r, :, t0:t1] = read.attend(t0, t1)
        # The chunk's queries were the last to read the staged groups: later ones read every slot
        # as it is (and the staged copies, views of the chunk's keys and values, are let go).
        self._staged = None
        return out

    def _attend_past(self, fold, r: slice, n: int, q_pos: torch.Tensor, keys: PackedKeys, values: PackedValues,
                     pos_r: torch.Tensor, past: int, q: torch.Tensor, window: int | None) -> None:
        """Fold into ``fold`` the queries [0, n) of rows ``r`` over slots [0, past), groups sealed
        before the chunk: each block decoded once, attended by every query (under the model's
        window, if any, else without a mask)."""
        for s0, s1 in fused.slot_blocks(keys, past, q[r], self.key_group):
            kb, vb = keys.decode(s0, s1), values.decode(s0, s1)
            for t0 in range(0, n, CHUNK_QUERIES):
                t1 = min(n, t0 + CHUNK_QUERIES)
                if window is None:
                    fold.add(r, t0, t1, kb, vb, None)
                    continue
                p = q_pos[r.start, t0:t1, None]
                pos = pos_r[s0:s1]
                visible = (pos >= 0) & (pos <= p) & (pos > p - window)
                fold.add(r, t0, t1, kb, vb, visible.expand(kb.shape[0], 1, *visible.shape))

    def _staged_reads(self, r: slice, span: int, dev: torch.device):
        """For rows ``r``, which share what the last write staged: per slot of [0, span), the
        position from which it is read as it is now (seal; -1: always), and a function of a slot
        range [lo, hi) giving the staged copies there (slots, keys, values: (b, Hkv, n, D) at
        the model's dtype; (None, None, None) if none), or None when nothing is staged."""
        seal = torch.full((span,), -1, dtype=torch.long, device=dev)
        if self._staged is None:
            return seal, None
        stage_k, stage_v, stage_of, seal_pos = (x[r] for x in self._staged)
        NB = stage_of.shape[1]
        group = torch.arange(span, device=dev) // self.key_group
        entry = torch.where(group < NB, stage_of[0, group.clamp(max=NB - 1)], -1)
        seal = torch.where(entry >= 0, seal_pos[0, group.clamp(max=NB - 1)], -1)
        if not bool((entry >= 0).any()):
            return seal, None

        def copies(lo: int, hi: int):
            slots = lo + (entry[lo:hi] >= 0).nonzero().flatten()
            if slots.numel() == 0:
                return None, None, None
            e, off = entry[slots], slots % self.key_group
            return slots, stage_k[:, :, e, off].to(self.dtype), stage_v[:, :, e, off].to(self.dtype)

        return seal, copies

    def reset(self) -> None:
        super().reset()
        self.k_meta.zero_()
        self.res_start.fill_(-1)
        self.fill.zero_()
        self._staged = None

    def buffers(self) -> dict[str, torch.Tensor]:
        return {**super().buffers(), "k_channel": self.k_channel,
                "k_residual": self.k_residual, "v_residual": self.v_residual, "res_start": self.res_start,
                "fill": self.fill}


class _Decoded:
    """Slots [start, span) of packed keys and values decoded into one buffer each, a block of
    ``blocks`` at a time, as far as asked (``upto``): each block decoded once."""

    def __init__(self, keys: PackedKeys, values: PackedValues, start: int, span: int,
                 blocks: list[tuple[int, int]]) -> None:
        self.keys, self.values, self.start, self.blocks = keys, values, start, list(blocks)
        B, H = keys.codes.shape[:2]
        shape = (B, H, span - start, keys.head_dim)
        self.k = torch.empty(shape, dtype=keys.dtype, device=keys.device)
        self.v = torch.empty(shape, dtype=values.dtype, device=values.device)
        self.done = start

    def upto(self, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The buffers, decoded at least up to slot ``stop`` (indices from ``start``)."""
        while self.done < stop and self.blocks:
            s0, s1 = self.blocks.pop(0)
            self.k[:, :, s0 - self.start : s1 - self.start] = self.keys.decode(s0, s1)
            self.v[:, :, s0 - self.start : s1 - self.start] = self.values.decode(s0, s1)
            self.done = s1
        return self.k, self.v


@dataclass
class _RowsRead:
    """How the query blocks of rows ``r`` of one ``KiviStorage.attend_chunk`` call (rows that share
    positions and staging) read the slots from ``past`` on, folded with the past they read before.

    q: (B, Hq, T, D) and q_pos (B, T): the whole chunk's queries; rows ``r`` are read.
    pos: (span,) long, the position each slot of the rows holds (-1: empty).
    past: slots [0, past) are groups sealed before the chunk, folded into ``past_fold`` (q's fold,
          None while no rows had any past) for every query of the rows.
    decoded: the rows' slots [past, span), decoded as the query blocks reach them.
    seal, copies: what the last write staged for the rows (``KiviStorage._staged_reads``).
    window: the model's sliding window; single: q does not fold (``fused.folds``); G: the key group.
    """

    q: torch.Tensor
    q_pos: torch.Tensor
    r: slice
    pos: torch.Tensor
    past: int
    past_fold: fused.Fold | None
    decoded: _Decoded
    seal: torch.Tensor
    copies: Callable[[int, int], tuple] | None
    span: int
    window: int | None
    single: bool
    G: int

    def attend(self, t0: int, t1: int) -> torch.Tensor:
        """Queries [t0, t1) of the rows over slots [past, span), folded with what their past gave
        them: (b, Hq, t1 - t0, D) at q's dtype."""
        r, past, G, window = self.r, self.past, self.G, self.window
        if self.past_fold is not None and past:
            acc, lse = self.past_fold.acc[r, :, t0:t1], self.past_fold.lse[r, :, t0:t1]
            fold = fused.Fold(self.q[r, :, t0:t1], acc=acc, lse=lse)
        else:
            fold = fused.Fold(self.q[r, :, t0:t1])
        rows = slice(0, self.decoded.keys.codes.shape[0])
        p = self.q_pos[r.start, t0:t1, None]  # (n, 1): the block's positions, shared by the rows
        newest = int(p.max())
        own = max(past, int(p.min()) // G * G)  # the block's first group
        e = min(self.span, newest + 1)  # slot s holds position s: later slots are unseen
        kb, vb = self.decoded.upto(e)
        # Slots before the block's first group every query reads as they are now (each
        # group there was sealed before the block's first position): one call, no mask.
        a = past if self.single or window is not None else own
        if a > past:
            fold.add(rows, 0, t1 - t0, kb[:, :, : a - past], vb[:, :, : a - past], None)
        pos = self.pos[a:e]
        visible = (pos >= 0) & (pos <= p) & (p >= self.seal[a:e])
        kr, vr = kb[:, :, a - past : e - past], vb[:, :, a - past : e - past]
        if self.copies is not None:
            # The staged copies the block may read: its own groups'.
            slots, ks, vs = self.copies(own, newest + 1)
            if slots is not None:
                c_pos = self.pos[slots]
                kr, vr = torch.cat((kr, ks), dim=2), torch.cat((vr, vs), dim=2)
                visible = torch.cat((visible, (c_pos <= p) & (p < self.seal[slots])), dim=1)
                pos = torch.cat((pos, c_pos))
        if window is not None:
            visible &= pos > p - window
        if kr.shape[2]:
            fold.add(rows, 0, t1 - t0, kr, vr, visible.expand(kr.shape[0], 1, *visible.shape))
        return fold.out()


class _Runs:
    """How one write (slots (B, T), CPU; slot ``C`` is scratch) lays keys in groups of ``G`` slots,
    of which the first ``NG`` are whole.

    A run is a stretch of consecutive slots within one group. It goes to the residual if its
    group is whole and it starts the group (offset 0) or continues the row's open group
    (``res_start``, ``fill``); otherwise its keys stay per token. A residual run that reaches the
    end of its group completes (seals) it. A row that writes and does not continue its open
    group abandons it (``abandon``).
    """

    def __init__(self, slots: torch.Tensor, C: int, G: int, NG: int, res_start: torch.Tensor, fill: torch.Tensor) -> None:
        B, T = slots.shape
        self.G = G
        real = slots < C
        group, offset = slots // G, slots % G
        prev = torch.cat((torch.full((B, 1), -2, dtype=torch.long), slots[:, :-1]), 1)
        starts = real & ((prev != slots - 1) | (offset == 0))
        cont = starts & (group * G == res_start[:, None]) & (offset == fill[:, None]) & (fill[:, None] > 0)
        ok = cont | (starts & (offset == 0) & (group < NG))
        t = torch.arange(T).expand(B, T)
        first = torch.where(starts, t, -1).cummax(1).values  # the start of each token's run
        self.resid = real & (first >= 0) & ok.gather(1, first.clamp(min=0))
        run_starts = starts & self.resid
        self.run = run_starts.long().cumsum(1) - 1  # (B, T): each residual token's run
        self.offset = offset
        self.any_real = real.any(1)
        self.abandon = self.any_real & ~cont.any(1) & (fill > 0)
        n_runs = run_starts.sum(1)
        self.runs = int(n_runs.max()) if B else 0
        NS = max(self.runs, 1)
        # Per run: its group, its token count (with the residual it continues), its last token.
        column = torch.where(self.resid, self.run, NS)  # tokens of no run go to an extra column
        self.group = torch.zeros(B, NS + 1, dtype=torch.long).scatter_(1, column, group)[:, :NS]
        count = torch.zeros(B, NS + 1, dtype=torch.long).scatter_add_(1, column, torch.ones_like(column))[:, :NS]
        self.continued = [(int(b), int(self.run[b, tt])) for b, tt in zip(*cont.nonzero(as_tuple=True))]
        for b, r in self.continued:
            count[b, r] += int(fill[b])
        self._last = torch.full((B, NS + 1), -1, dtype=torch.long).scatter_reduce_(
            1, column, torch.where(self.resid, t, -1), "amax")[:, :NS]
        self.sealed = (torch.arange(NS)[None, :] < n_runs[:, None]) & (count == G)
        # The open group after the write: the row's last residual run, if it is not sealed.
        last = (n_runs - 1).clamp(min=0)[:, None]
        last_open = (n_runs > 0) & ~self.sealed.gather(1, last)[:, 0]
        self.open_run = torch.where(last_open, last[:, 0], -1).tolist()
        self.res_start = torch.where(last_open, self.group.gather(1, last)[:, 0] * G, -1)
        self.fill = torch.where(last_open, count.gather(1, last)[:, 0], 0)

    def aligned(self, slots: torch.Tensor) -> bool:
        """Whether every row writes the same slots s0, s0 + 1, ... from a group's first slot, each
        token in a run (none continued): run r is then tokens [r G, (r + 1) G) of the chunk."""
        B, T = slots.shape
        s0 = int(slots[0, 0]) if T else 0
        return (T > 0 and s0 % self.G == 0 and not self.continued and bool(self.resid.all())
                and bool((slots == torch.arange(s0, s0 + T)).all()))

    def last_pos(self, bs: torch.Tensor, rs: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Position of the last token of runs (bs, rs): positions (B, T), CPU."""
        return positions[bs, self._last[bs, rs]]
