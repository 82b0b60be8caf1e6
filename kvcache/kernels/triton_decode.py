"""A Triton decode kernel over packed codes (CUDA; also runs under ``TRITON_INTERPRET=1`` on CPU
tensors, which is how the tests check it).

One program per (row, K/V head, split of the slots) walks its slots in blocks of ``BLOCK_S``:
it loads the codes, unpacks and scales them in registers (per-token scales, or for KIVI keys the
per-channel scales of the slot's group, or the full-precision residual), scores the G query heads
of the group against them, and folds the block into an online softmax. Grouped heads share each
load; nothing is expanded and nothing is written but the partial results. With ``want_mass`` the
raw scores are written too (G per slot), and the attention mass is normalised once the global
max and sum are known. Splits are combined in PyTorch (flash-decoding), so a single row still
spreads over many programs.

Limits (``supported``): 2-, 4- or 8-bit codes (one plane a byte: quant/codes.py), unrotated, a power-of-two
head_dim of at least 16, no renumbered-sink query, no full-precision sink tokens (quant/sinks.py)
and no appended chunk tokens; ``kernels.decode`` sends anything else to the blocked path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..quant.codes import KERNEL_BITS
from ..quant.packed import PackedKeys, PackedValues
from ..quant.sinks import SinkKeys, SinkValues

# Slots per program: enough work per program to hide latency, few enough programs to fill the GPU.
SLOTS_PER_SPLIT = 512
NUM_WARPS = 4
# The dots' input precision: None picks "ieee" for a float32 query (exact float32 products) and
# "tf32" for a half-precision one. tf32 rounds the dots' inputs (the scaled query, the decoded
# keys and values, the weights) to 11 significant bits: no coarser than a bfloat16 or float16
# model's own tensors, and far finer than the codes' quantization. "tf32" runs on tensor cores:
# at 32k slots and batch 16 on an H200, int8 codes took 1.1 ms a layer step against 41 ms with
# "ieee" dots (benchmarks/step_kernels.py --kernel-configs).
DOT_PRECISION: str | None = None
# Slots a block and pipeline stages; None: the best measured for the dots' precision there
# (BY_PRECISION). With ieee dots, 64 slots a block in 3 stages took seven times as long as 32 in
# 1 stage (and 16 in 1 stage as long as 32).
BLOCK_S: int | None = None
NUM_STAGES: int | None = None
BY_PRECISION = {"tf32": (64, 3), "ieee": (32, 1)}


@triton.jit
def _unpack(ptr, s, d, stride_s, BITS: tl.constexpr, mask):
    """Codes of slots s (BLOCK_S, 1) and channels d (1, D) from packed bytes, as float32."""
    PER: tl.constexpr = 8 // BITS
    byte = tl.load(ptr + s * stride_s + d // PER, mask=mask, other=0).to(tl.int32)
    return ((byte >> ((d % PER) * BITS)) & ((1 << BITS) - 1)).to(tl.float32)


@triton.jit
def _token_scaled(code, meta_ptr, s, d, stride_s, N: tl.constexpr, D: tl.constexpr, mask):
    """code * scale + zero with per-token fp16 scales of N groups of D / N channels. s, mask:
    (BLOCK_S, 1); d: (1, D)."""
    if N == 1:
        # One scale and zero a slot: one load each per slot, broadcast over the channels.
        scale = tl.load(meta_ptr + s * stride_s, mask=mask, other=0.0).to(tl.float32)
        zero = tl.load(meta_ptr + s * stride_s + 1, mask=mask, other=0.0).to(tl.float32)
    else:
        grp = d // (D // N)
        scale = tl.load(meta_ptr + s * stride_s + grp, mask=mask, other=0.0).to(tl.float32)
        zero = tl.load(meta_ptr + s * stride_s + N + grp, mask=mask, other=0.0).to(tl.float32)
    return code * scale + zero


@triton.jit
def _decode_kernel(
    q_ptr, kc_ptr, km_ptr, vc_ptr, vm_ptr, mode_ptr, ch_ptr, kr_ptr, vr_ptr, rs_ptr, vis_ptr,
    acc_ptr, m_ptr, l_ptr, sc_ptr,
    S, H, G, SPLIT,
    sq_b, sq_h, sq_g,
    skc_b, skc_h, skc_s, skm_b, skm_h, skm_s,
    svc_b, svc_h, svc_s, svm_b, svm_h, svm_s,
    smo_b, smo_h, sch_b, sch_h, sch_g, sch_t,
    sr_b, sr_h, sr_s, svis_b, svis_h,
    D: tl.constexpr, BITS: tl.constexpr, GP: tl.constexpr, BLOCK: tl.constexpr,
    NK: tl.constexpr, NV: tl.constexpr, KIVI: tl.constexpr, KGROUP: tl.constexpr,
    HAS_VIS: tl.constexpr, WANT_SCORES: tl.constexpr, PRECISION: tl.constexpr,
):
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = bh // H
    h = bh % H
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + b * sq_b + h * sq_h + g[:, None] * sq_g + d[None, :], mask=g[:, None] < G, other=0.0)
    m = tl.full((GP,), float("-inf"), tl.float32)
    l = tl.zeros((GP,), tl.float32)
    acc = tl.zeros((GP, D), tl.float32)
    if KIVI:
        res_start = tl.load(rs_ptr + b)
    lo = split * SPLIT
    for start in range(lo, lo + SPLIT, BLOCK):
        s = start + tl.arange(0, BLOCK)
        live = s < S
        s2 = s[:, None]
        m2 = live[:, None]
        code = _unpack(kc_ptr + b * skc_b + h * skc_h, s2, d[None, :], skc_s, BITS, m2)
        k = _token_scaled(code, km_ptr + b * skm_b + h * skm_h, s2, d[None, :], skm_s, NK, D, m2)
        if KIVI:
            mode = tl.load(mode_ptr + b * smo_b + h * smo_h + s, mask=live, other=1).to(tl.int32)[:, None]
            if KGROUP % BLOCK == 0:
                # Blocks start at multiples of BLOCK, so the whole block lies in group start // KGROUP:
                # its scales are one row (1, D), loaded when a slot of the block is in CHANNEL mode
                # (the group's row exists then).
                n_channel = tl.sum((m2 & (mode == 0)).to(tl.int32))
                in_channel = (d[None, :] * 0 + n_channel) > 0
                ch = ch_ptr + b * sch_b + h * sch_h + (start // KGROUP) * sch_g + d[None, :]
            else:
                in_channel = m2 & (mode == 0)
                ch = ch_ptr + b * sch_b + h * sch_h + (s2 // KGROUP) * sch_g + d[None, :]
            c_scale = tl.load(ch, mask=in_channel, other=0.0).to(tl.float32)
            c_zero = tl.load(ch + sch_t, mask=in_channel, other=0.0).to(tl.float32)
            # A CHANNEL key's own scale: minus its per-token scale slot (PackedKeys).
            own = -tl.load(km_ptr + b * skm_b + h * skm_h + s2 * skm_s, mask=m2 & (mode == 0), other=-1.0).to(tl.float32)
            k = tl.where(mode == 0, (code * c_scale + c_zero) * own, k)
            r = tl.minimum(tl.maximum(s2 - res_start, 0), KGROUP - 1)
            resid = m2 & (mode == 2)
            k_res = tl.load(kr_ptr + b * sr_b + h * sr_h + r * sr_s + d[None, :], mask=resid, other=0.0).to(tl.float32)
            k = tl.where(resid, k_res, k)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # (GP, BLOCK)
        ok = live
        if HAS_VIS:
            ok = ok & (tl.load(vis_ptr + b * svis_b + h * svis_h + s, mask=live, other=0) != 0)
        scores = tl.where(ok[None, :], scores, float("-inf"))
        if WANT_SCORES:
            tl.store(sc_ptr + (bh * GP + g[:, None]) * S + s[None, :], scores, mask=(g[:, None] < G) & live[None, :])
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
        l = l * alpha + tl.sum(p, axis=1)
        vcode = _unpack(vc_ptr + b * svc_b + h * svc_h, s2, d[None, :], svc_s, BITS, m2)
        v = _token_scaled(vcode, vm_ptr + b * svm_b + h * svm_h, s2, d[None, :], svm_s, NV, D, m2)
        if KIVI:
            v_res = tl.load(vr_ptr + b * sr_b + h * sr_h + r * sr_s + d[None, :], mask=resid, other=0.0).to(tl.float32)
            v = tl.where(resid, v_res, v)
        v = tl.where(m2, v, 0.0)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        m = m_new
    out = (bh * tl.num_programs(1) + split) * GP + g
    tl.store(m_ptr + out, m)
    tl.store(l_ptr + out, l)
    tl.store(acc_ptr + out[:, None] * D + d[None, :], acc)


def supported(q: torch.Tensor, k: PackedKeys, v: PackedValues) -> bool:
    D = q.shape[-1]
    # Full-precision sinks (quant/sinks.py) are read by the blocked path only.
    plain_views = not isinstance(k, SinkKeys) and not isinstance(v, SinkValues)
    # The kernel unpacks one plane of codes per byte: widths split into planes (3, 5) are blocked.
    one_plane = k.bits in KERNEL_BITS and v.bits in KERNEL_BITS
    # Rotated codes (quant/rotation.py) are read by the blocked path, which rotates query and output.
    unrotated = k.rotation is None and v.rotation is None
    appended = k.tail is not None or v.tail is not None or k.stage_of is not None
    return one_plane and unrotated and plain_views and not appended and D >= 16 and D & (D - 1) == 0


def decode(q: torch.Tensor, k: PackedKeys, v: PackedValues, visible: torch.Tensor | None, *,
           want_mass: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``attention.decode`` over packed slots: q (B, Hq, 1, D); visible (B, Hp, S) bool or None.
    Returns out (B, Hq, 1, D) and, with ``want_mass``, (B, Hkv, S) float32."""
    B, Hq, _, D = q.shape
    H, S = k.codes.shape[1], k.codes.shape[2]
    G = Hq // H
    GP = max(16, triton.next_power_of_2(G))  # tl.dot needs 16 rows
    precision = DOT_PRECISION or ("ieee" if q.dtype == torch.float32 else "tf32")
    block = BLOCK_S or BY_PRECISION[precision][0]
    splits = max(1, triton.cdiv(S, SLOTS_PER_SPLIT))
    split = triton.cdiv(triton.cdiv(S, splits), block) * block
    dev = q.device
    qf = (q.float() * D**-0.5).reshape(B, H, G, D).contiguous()
    acc = torch.empty(B * H * splits * GP, D, device=dev)
    m = torch.empty(B * H * splits * GP, device=dev)
    l = torch.empty_like(m)
    scores = torch.empty(B * H * GP, S, device=dev) if want_mass else m
    kivi = k.mode is not None
    dummy = k.meta  # any tensor: arguments a layout does not use
    mode = k.mode if kivi else dummy
    channel = k.channel if kivi else dummy
    k_res = k.residual if kivi else dummy
    v_res = v.residual if kivi else dummy
    res_start = k.res_start if kivi else dummy
    # A copy, not a bool-to-uint8 view: inductor cannot lower that view of a kernel's argument
    # inside a captured step (torch 2.11), and the copy is one byte a slot.
    vis = visible.to(torch.uint8) if visible is not None else dummy
    vis_h = 0 if visible is None or visible.shape[1] == 1 else vis.stride(1)
    _decode_kernel[(B * H, splits)](
        qf, k.codes, k.meta, v.codes, v.meta, mode, channel, k_res, v_res, res_start, vis,
        acc, m, l, scores,
        S, H, G, split,
        *qf.stride()[:3],
        *k.codes.stride()[:3], *k.meta.stride()[:3],
        *v.codes.stride()[:3], *v.meta.stride()[:3],
        *(mode.stride()[:2] if kivi else (0, 0)), *(channel.stride()[:4] if kivi else (0, 0, 0, 0)),
        *(k_res.stride()[:3] if kivi else (0, 0, 0)),
        *((vis.stride(0), vis_h) if visible is not None else (0, 0)),
        D=D, BITS=k.bits, GP=GP, BLOCK=block, NK=k.meta.shape[-1] // 2, NV=v.meta.shape[-1] // 2,
        KIVI=kivi, KGROUP=max(k.group, 1), HAS_VIS=visible is not None, WANT_SCORES=want_mass,
        PRECISION=precision, num_warps=NUM_WARPS, num_stages=NUM_STAGES or BY_PRECISION[precision][1],
    )
    # Combine the splits (B, H, splits, GP): rescale each to the global max.
    m = m.view(B, H, splits, GP)
    l = l.view(B, H, splits, GP)
    acc = acc.view(B, H, splits, GP, D)
    top = m.amax(2, keepdim=True)
    top = torch.where(torch.isinf(top), 0.0, top)
    w = torch.exp(m - top)
    total = (w * l).sum(2)  # (B, H, GP)
    out = (w.unsqueeze(-1) * acc).sum(2) / total.clamp(min=torch.finfo(torch.float32).tiny).unsqueeze(-1)
    out = out[:, :, :G].reshape(B, Hq, 1, D).to(q.dtype)
    if not want_mass:
        return out, None
    p = torch.exp(scores.view(B, H, GP, S)[:, :, :G] - top[:, :, 0, :G, None]) / total[:, :, :G, None]
    return out, p.sum(2)
