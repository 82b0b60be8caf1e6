"""Device identity, written once.

``torch.device("cuda")`` and ``torch.device("cuda:0")`` compare unequal, and so do ``cpu`` and
``cpu:0``, although each pair names one device. A tensor reports its device in one form only
(``cuda:0``, ``cpu``), so kvcache turns every device a caller gives into that form where it enters
(``canonical``) and compares devices with ``same``.
"""

from __future__ import annotations

import torch


def canonical(device: torch.device | str | int) -> torch.device:
    """``device`` as a tensor on it reports it: ``cpu`` (no index) for the CPU and meta, and
    ``<type>:<index>`` for an accelerator, the current one where no index is given."""
    device = torch.device(device)
    if device.type in ("cpu", "meta"):
        return torch.device(device.type)
    if device.index is not None:
        return device
    backend = getattr(torch, device.type, None)
    current = getattr(backend, "current_device", None)
    return device if current is None else torch.device(device.type, current())


def same(a: torch.device | str, b: torch.device | str) -> bool:
    """Whether ``a`` and ``b`` name one device (``cuda`` and ``cuda:0`` do, on a process whose
    current CUDA device is 0)."""
    return canonical(a) == canonical(b)


def host_reads_free(t: torch.Tensor) -> bool:
    """Whether reading ``t``'s values on the host costs nothing: eager, on the CPU. Captured
    (compiling) or on an accelerator, where a read waits for the device, code that would branch
    on such a read computes every branch instead."""
    return t.device.type == "cpu" and not torch.compiler.is_compiling()
