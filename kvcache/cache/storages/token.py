"""``token<bits>[/<group>]``: keys and values quantized per token, 8-, 4- or 2-bit codes with
fp16 scales and zero points (quant/codes.py), read by attention block by block (kernels/),
never decoded whole.

Each token's key (and value) for each K/V head is quantized on its own, in groups of ``group``
channels (default: the whole head). Policies write, move and evict whole tokens, and a token's
bits never depend on its neighbours. docs/policies/storage.md has the measurements.
"""

from __future__ import annotations

import torch

from ...quant.codes import SLICE_ELEMENTS, decode_tokens, encode_tokens
from ...quant.packed import PackedKeys, PackedValues, after
from .. import positions as _positions
from ..base import CacheSpec
from ..slots import put, widen


class TokenStorage:
    """Keys and values per token: codes plus an fp16 scale and zero point per group of
    ``group`` channels of each token and K/V head.

    k, v:         (B, Hkv, C + 1, D * bits / 8) uint8 codes (packed, codes.py).
    k_meta, v_meta: (B, Hkv, C + 1, 2 * D / group) fp16: the scales, then the zero points.
    pos:          (B, Hp, C + 1), -1 for an empty slot (as in ``FullStorage``: the narrowest
                  integer type holding positions below ``limit``).
    """

    layout = "token"
    packed = True
    # A chunk attends its new tokens exactly as they will be stored (``roundtrip``).
    exact_roundtrip = True
    # A token's codes do not depend on its slot.
    keeps_in_place = False
    # Every buffer is laid out per slot, so more slots can be added (``grow``).
    grows = True
    # Why a CUDA decode step over this layout takes the blocked path instead of the Triton kernel
    # at every width (None: the kernel reads it at the widths in ``KERNEL_BITS``).
    blocked_because: str | None = None

    @staticmethod
    def describe(bits: int) -> str:
        return f"{bits}-bit codes per token and K/V head for keys and values; fp16 scales"

    @classmethod
    def check(cls, name: str, bits: int, group: int | None, head_dim: int) -> None:
        """Raise ValueError if ``bits`` and ``group`` cannot hold keys of ``head_dim`` channels."""
        if head_dim * bits % 8:
            raise ValueError(f"storage {name!r}: head_dim {head_dim} does not fill whole bytes of {bits}-bit codes")
        if group is not None and head_dim % group:
            raise ValueError(
                f"storage {name!r}: a group of {group} channels must divide head_dim ({head_dim}); "
                f"valid groups: {', '.join(str(g) for g in range(1, head_dim + 1) if head_dim % g == 0)}"
            )

    @classmethod
    def build(cls, spec: CacheSpec, bits: int, group: int | None, per_head: bool = False,
              limit: int | None = None) -> TokenStorage:
        return cls(spec, bits, per_head, group, limit)

    def __init__(self, spec: CacheSpec, bits: int, per_head: bool = False, group: int | None = None,
                 limit: int | None = None) -> None:
        B, H, C, D = spec.batch_size, spec.num_kv_heads, spec.cache_length, spec.head_dim
        self.bits, self.group, self.dtype, self.head_dim = bits, D if group is None else group, spec.dtype, D
        dev = spec.device
        self.k = torch.zeros(B, H, C + 1, D * bits // 8, dtype=torch.uint8, device=dev)
        self.v = torch.zeros_like(self.k)
        self.k_meta = torch.zeros(B, H, C + 1, 2 * (D // self.group), dtype=torch.float16, device=dev)
        self.v_meta = torch.zeros_like(self.k_meta)
        self.pos = _positions.empty((B, H if per_head else 1, C + 1), limit, dev)
        # The last roundtrip's outputs with their codes (``_reuse``).
        self._read_back = None

    # ----- codes -------------------------------------------------------------------------------
    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: (B, H, T, D) -> codes (B, H, T, D * bits / 8) uint8, meta (B, H, T, 2 * D / group)
        fp16, over each group's min-max range."""
        return encode_tokens(x, self.bits, self.group)

    def encode_keys(self, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token key codes: as values' (``encode``)."""
        return self.encode(k)

    def decode(self, codes: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
        """Inverse of ``encode``: (B, H, T, D) at the model's dtype."""
        return decode_tokens(codes, meta, self.bits, self.dtype)

    def roundtrip(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v (B, Hkv, T, D) as attention reads them once stored. Storing what this returns
        stores the codes computed here: quantizing a read-back value again need not reproduce
        them (an fp16 zero point cannot always sit within half a step of a group's minimum)."""
        kq, km = self.encode_keys(k)
        vq, vm = self.encode(v)
        k, v = self.decode(kq, km), self.decode(vq, vm)
        self._read_back = ((k, kq, km), (v, vq, vm))
        return k, v

    def _buffers(self) -> tuple[torch.Tensor, ...]:
        return self.k, self.v, self.k_meta, self.v_meta

    def _encoded(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The new tokens' (k codes, v codes, k meta, v meta), in the order of ``_buffers``."""
        kr, vr = self._reuse(k, 0), self._reuse(v, 1)
        if kr is None and vr is None and _stackable(k, v):
            return _encode_pair(self.encode, k, v)
        kq, km = kr or self.encode_keys(k)
        vq, vm = vr or self.encode(v)
        return kq, vq, km, vm

    def _reuse(self, x: torch.Tensor, which: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The codes of ``x`` if it is what the last ``roundtrip`` returned (a ring or a scoring
        cache storing the chunk it attended), unmodified since."""
        # The tuple holds y alive, so no other tensor can take its memory while it is kept. (A
        # captured decode step stores a new token, never a read-back chunk.)
        if torch.compiler.is_compiling() or self._read_back is None or self._read_back[which] is None:
            return None
        y, q, meta = self._read_back[which]
        if (x.data_ptr(), x.shape, x.stride()) != (y.data_ptr(), y.shape, y.stride()):
            return None
        return q, meta

    # ----- the Storage protocol ----------------------------------------------------------------
    def write_slice(self, start: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """Write k, v: (B, Hkv, T, D) at slots [start, start + T) of every row; positions: (B, T).
        A long chunk is coded a slice of tokens at a time, straight into the slots (each token
        is coded on its own: the same codes, without a copy of them all)."""
        T = k.shape[2]
        whole = self._reuse(k, 0) is not None or self._reuse(v, 1) is not None
        step = T if whole else max(1, SLICE_ELEMENTS // max(1, k[:, :, :1].numel()))
        for t0 in range(0, T, step):
            t1 = min(T, t0 + step)
            part = (k, v) if (t0, t1) == (0, T) else (k[:, :, t0:t1], v[:, :, t0:t1])
            for buf, new in zip(self._buffers(), self._encoded(*part)):
                buf[:, :, start + t0 : start + t1] = new
        self.pos[:, :, start : start + T] = positions.unsqueeze(1)

    def read_back(self, start: int, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of slots [start, start + T) as ``roundtrip`` returns tokens stored
        there: (B, Hkv, T, D) at the model's dtype (a storage with ``exact_roundtrip`` only)."""
        if not self.exact_roundtrip:
            raise TypeError(f"{type(self).__name__} keys are not read back per token: its chunks attend with attend_chunk")
        stop = start + T
        return self.decode(self.k[:, :, start:stop], self.k_meta[:, :, start:stop]), \
            self.decode(self.v[:, :, start:stop], self.v_meta[:, :, start:stop])

    def grow(self, slots: int) -> None:
        """Hold ``slots`` slots (at least C) and the scratch slot after them: slots [0, C) keep
        their codes, the new ones are empty."""
        if not self.grows:
            raise TypeError(f"{type(self).__name__} lays out buffers for its cache_length: it cannot grow")
        self.k, self.v, self.k_meta, self.v_meta = (widen(buf, slots, 0) for buf in self._buffers())
        self.pos = widen(self.pos, slots, -1)

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """Write token t of row b to slot ``slots[b, t]`` (shared by heads); positions: (B, T)."""
        slots = slots.unsqueeze(1)  # (B, 1, T): every head's
        for buf, x in zip(self._buffers(), self._encoded(k, v)):
            put(buf, slots, x)
        put(self.pos, slots, positions.to(self.pos.dtype).unsqueeze(1))

    def empty_scratch(self) -> None:
        """Slot C: position -1, codes and their meta zero (see the Storage protocol)."""
        for buf in self._buffers():
            buf[:, :, -1] = 0
        self.pos[:, :, -1] = -1

    def settle(self, dst: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """Move the token in the scratch slot to slot ``dst`` (B, Hp, 1) and empty the scratch
        slot. Codes move as they are: a moved token is not re-quantized."""
        for buf in self._buffers():
            # A write may not read from the buffer it writes: the scratch slot is copied first.
            put(buf, dst, buf[:, :, -1:].clone())
        put(self.pos, dst, positions.to(self.pos.dtype).unsqueeze(1))
        self.pos[:, :, -1] = -1

    def keep(self, k, v, pos: torch.Tensor, index: torch.Tensor, stored: int = 0) -> None:
        """Fill slots [0, C) with candidates ``index`` (B, Hp, C) of k, v (B, Hkv, N, D), pos
        (B, Hp, N). Candidates [0, stored) are this storage's slots [0, stored) (their codes are
        taken as they are); the rest are new tokens, encoded here."""
        fresh = self._encoded(after(k, stored), after(v, stored))
        for buf, new in zip(self._buffers(), fresh):
            buf[:, :, : index.shape[-1]] = _gather_candidates(buf, new, stored, index)
        self.pos[:, :, : index.shape[-1]] = pos.gather(2, index)

    def view(self, span: int) -> tuple[PackedKeys, PackedValues, torch.Tensor]:
        """The first ``span`` slots, packed (attention reads them block by block; anything else
        decodes them on use): keys, values (B, Hkv, span, D) and pos (B, Hp, span)."""
        keys = PackedKeys(self.k[:, :, :span], self.k_meta[:, :, :span], self.bits, self.head_dim, self.dtype)
        values = PackedValues(self.v[:, :, :span], self.v_meta[:, :, :span], self.bits, self.head_dim, self.dtype)
        return keys, values, self.pos[:, :, :span]

    def buffers(self) -> dict[str, torch.Tensor]:
        return {"k": self.k, "v": self.v, "k_meta": self.k_meta, "v_meta": self.v_meta, "pos": self.pos}

    def reset(self) -> None:
        self.pos.fill_(-1)
        self._read_back = None

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers().values())


# Tokens (rows x heads x tokens) up to which a write encodes its keys and values in one call.
STACK_TOKENS = 64


def _stackable(k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether k and v are a few tokens of one shape and dtype (a decode step's write), whose
    encoding costs more in per-call overhead than in arithmetic: one call for both then."""
    return k.shape == v.shape and k.dtype == v.dtype and k.shape[:-1].numel() <= STACK_TOKENS


def _encode_pair(encode, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(k codes, v codes, k meta, v meta) of ``encode`` applied to k and v stacked: the same bits
    as two calls (every group is quantized on its own), at one call's overhead."""
    codes, meta = encode(torch.stack((k, v)))
    return codes[0], codes[1], meta[0], meta[1]


def _gather_candidates(buf: torch.Tensor, new: torch.Tensor, stored: int, index: torch.Tensor) -> torch.Tensor:
    """Candidates [0, stored) are ``buf``'s slots, the rest ``new`` (B, H, T, n): the ones ``index``
    (B, Hp, C) picks, (B, H, C, n)."""
    B, H = buf.shape[:2]
    C = index.shape[-1]
    cand = torch.cat((buf[:, :, :stored], new), dim=2)
    return cand.gather(2, index.expand(B, H, C).unsqueeze(-1).expand(B, H, C, buf.shape[-1]))
