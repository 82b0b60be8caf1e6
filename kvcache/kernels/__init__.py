"""Attention over packed codes: the one place a kernel is chosen.

``attention.py``'s functions hand packed keys and values (``PackedKeys``, ``PackedValues``, what a
quantized storage's ``view`` returns) to ``attend`` and ``decode`` here, with the same arguments
they take. A decode step on CUDA runs the Triton kernel (triton_decode.py) when Triton is
installed; everything else, and CUDA without Triton, runs the blocked PyTorch path (blocked.py).
Triton is imported only when a CUDA decode step first needs it; set ``KVCACHE_TRITON=0`` to keep
the blocked path on CUDA. A chunk whose queries read every slot alike attends them decoded a block
at a time through the fused kernel instead (``attend_decoded``, fused.py). Full-precision keys
and values take PyTorch's SDPA through ``sdpa.sdpa`` (no cuDNN plan per key length on CUDA).
"""

from __future__ import annotations

import os
import warnings

import torch

from ..quant.packed import CHANNEL, RESIDUAL, TOKEN, PackedKeys, PackedValues
from . import blocked
from .fused import attend_decoded
from .visibility import visibility

__all__ = ["CHANNEL", "RESIDUAL", "TOKEN", "PackedKeys", "PackedValues", "attend", "attend_decoded", "decode", "is_packed"]

_triton_module = None
_triton_checked = False


def is_packed(x: object) -> bool:
    return isinstance(x, (PackedKeys, PackedValues))


def attend(q, k, v, q_pos, k_pos, *, window=None, sinks=0, limit=None, all_visible=False, q_weight=None,
           q_sink=None):
    """Queries at ``q_pos`` against packed slots at ``k_pos``: ``attention.masked``'s arguments
    (and ``masked_with_weights``' with ``q_weight``). Returns out, mass, seen (None without
    ``q_weight``). One query per row (a dense decode step) takes ``decode``."""
    if q.shape[2] == 1 and q_weight is None and q_sink is None:
        visible = None if all_visible else visibility(q_pos, k_pos, window, sinks, limit)[:, :, 0]
        return decode(q, k, v, visible)[0], None, None
    return blocked.attend(q, k, v, q_pos, k_pos, window=window, sinks=sinks, limit=limit, all_visible=all_visible,
                          q_weight=q_weight, q_sink=q_sink)


def decode(q: torch.Tensor, k: PackedKeys, v: PackedValues, visible: torch.Tensor | None, *,
           q_sink: torch.Tensor | None = None, sink_slots: int = 0, want_mass: bool = False):
    """One query per row against packed slots: ``attention.decode``'s arguments and results."""
    if q.is_cuda and q_sink is None:
        triton_decode = _triton()
        if triton_decode is not None and triton_decode.supported(q, k, v):
            return triton_decode.decode(q, k, v, visible, want_mass=want_mass)
    return blocked.decode(q, k, v, visible, q_sink=q_sink, sink_slots=sink_slots, want_mass=want_mass)


def _triton():
    """The Triton decode module, or None (not installed, or disabled): imported on first use."""
    global _triton_module, _triton_checked
    if not _triton_checked:
        _triton_checked = True
        if os.environ.get("KVCACHE_TRITON", "1") != "0":
            try:
                from . import triton_decode
            except ImportError as e:
                warnings.warn(f"Triton is not available ({e}): quantized decode on CUDA runs the blocked "
                              "PyTorch path, which is slower; install triton for the fused kernel", stacklevel=3)
            else:
                _triton_module = triton_decode
    return _triton_module
