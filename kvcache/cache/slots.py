"""Writing tokens into slots of a layer's buffers, as a captured step can do in place.

A captured decode step (compile.py) takes the cache's buffers as inputs and writes the new
token into them. Inductor makes an ``index_put_`` into such an input an in-place write, but not
a ``scatter_``: that one it computes into a copy of the whole buffer, which it then copies back,
two passes over every layer's keys and values a step. Eager, the two are the same write, and a
scatter the cheaper call (one token on a CPU: an index_put about 32 us, a scatter 13), so
``put`` scatters unless it is being compiled.

``widen`` gives a buffer more slots: a dense cache allocates its slots as it fills.
"""

from __future__ import annotations

import torch


def put(buf: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    """``buf[i, slots[i, t]] = values[i, t]`` for every index i of the leading dimensions and token t.

    slots: (*L, T) long, indices into dimension ``len(L)`` of buf, with L broadcastable to buf's
    first ``len(L)`` dimensions (a (B, 1, T) of slots serves every head of a (B, H, S, D) buffer);
    values: broadcastable to (*buf.shape[:len(L)], T, *buf.shape[len(L) + 1:]), of buf's dtype and
    not overlapping it (clone a slot of buf before putting it elsewhere). Two tokens aimed at one
    slot leave either one there (the scratch slot, which the caller empties afterwards)."""
    lead = slots.dim() - 1
    if not torch.compiler.is_compiling():
        shape = list(buf.shape)
        shape[lead] = slots.shape[-1]
        index = slots
        for _ in range(buf.dim() - lead - 1):
            index = index.unsqueeze(-1)
        buf.scatter_(lead, index.expand(shape), values.expand(shape))
        return
    index = [torch.arange(n, device=buf.device).view([n if i == d else 1 for i in range(lead + 1)])
             for d, n in enumerate(buf.shape[:lead])]
    buf.index_put_((*index, slots), values)


def widen(buf: torch.Tensor, slots: int, empty: int) -> torch.Tensor:
    """``buf`` (B, H, S + 1, ...) with ``slots`` + 1 slots (slots >= S): slots [0, S) as they
    were, the new slots and the scratch slot (the last) set to ``empty``. The scratch slot holds
    nothing between calls, so it is not copied.

    The new buffer is an inference tensor exactly when ``buf`` is one: what may write the buffer
    in place (inside or outside inference mode) stays what it was. (Only its making is under that
    mode: the copies run under the caller's, whose grad mode the other mode would change.)"""
    held = buf.shape[2] - 1
    with torch.inference_mode(buf.is_inference()):
        out = buf.new_empty((*buf.shape[:2], slots + 1, *buf.shape[3:]))
    out[:, :, :held] = buf[:, :, :held]
    out[:, :, held:] = empty
    return out
