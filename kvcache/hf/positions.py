"""The check that transformers rotated every real token at the position kvcache gives it.

Keys are stored rotated by the transformers model (at its ``position_ids``) and tagged with
kvcache's positions (each row's real tokens numbered from 0 in the order they are fed), which
masks, eviction and renumbering read. The two must agree, or attention would be computed at one
distance and masked at another.
"""

from __future__ import annotations

import torch

from ..cache import Step
from .padding import Layout


def check_positions(step: Step, layout: Layout, position_ids: torch.Tensor) -> None:
    """Raise unless ``position_ids`` (B or 1, T), as transformers rotated the chunk, equal the
    positions ``step`` gives its real tokens (``layout`` says where they are). 3D (multimodal)
    positions are not compared."""
    B, T = step.positions.shape
    if position_ids.dim() != 2 or position_ids.shape[-1] != T:
        return
    given = position_ids.expand(B, T)
    want = step.positions if layout.back is None else step.positions.gather(1, layout.back)
    agree = given == want
    if layout.pad is not None:
        agree |= layout.pad
    # A host check on every device: a device-side assert would leave the process's CUDA context
    # unusable. transformers' own generate loop reads the device every step anyway.
    if bool(agree.all()):
        return
    row = int((~agree).any(1).long().argmax())
    real = slice(None) if layout.pad is None else ~layout.pad[row]
    raise ValueError(
        f"position_ids of row {row} ({given[row][real].tolist()}) differ from the positions the cache gives its "
        f"tokens ({want[row][real].tolist()}): kvcache numbers each row's real tokens from 0 in the order they "
        "are fed. Pass the attention_mask of every column fed so far (as generate does), so that transformers "
        "numbers them alike, or leave position_ids out"
    )
