"""How much memory a device has available, and the check made before a large allocation, so
that an impossible request fails with a message instead of an allocator error."""

from __future__ import annotations

import os

import torch

from ..errors import MemoryBudgetError


def available_bytes(device: torch.device) -> int | None:
    """Bytes that can still be allocated on ``device``: free memory on CUDA, MemAvailable (or,
    without /proc, the physical memory) on CPU; None where it cannot be known (meta, MPS)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def human(n: float) -> str:
    """Bytes as B, KiB, MiB, GiB or TiB (one decimal past bytes)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def check_fits(nbytes: int, device: torch.device, what: str, advice: str) -> None:
    """Raise ``MemoryBudgetError`` if allocating ``nbytes`` for ``what`` on ``device`` cannot
    succeed (more than is available there); ``advice`` says what to change."""
    free = available_bytes(device)
    if free is not None and nbytes > free:
        raise MemoryBudgetError(
            f"{what} needs {human(nbytes)}, more than the {human(free)} available on {device}: {advice}"
        )
