"""What an evicting policy's hooks see: the tokens it may keep, as one object.

``observe(c)`` and ``priority(c)`` (see evicting.py) receive a ``Candidates``: the N tokens a
layer could keep (its held slots, the chunk, or both), their keys, values, positions and per-slot
statistics, and the call's queries. A policy reads whatever it scores from here, so a new policy
that ranks by keys, values, queries or attention is one file with one or two methods.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .base import Step


@dataclass
class Candidates:
    """The N tokens a layer may keep, as attended in this call.

    stored_keys:   (B, Hkv, N, D) keys rotated at their absolute positions, as the layer holds
                them: a tensor, or a quantized storage's packed view (quant/packed.py). A policy
                reads ``keys``, the same as a tensor.
    stored_values: (B, Hkv, N, D) values, likewise (a policy reads ``values``).
    positions:  (B, Hp, N) long: absolute position of each candidate, -1 for an empty slot (the
                caller ranks empty slots lowest whatever ``priority`` says). Hp is 1 when all K/V
                heads of a row keep the same tokens, Hkv when each head keeps its own.
    stats:      name -> (B, Hp, N) float32 per-candidate statistics (the policy's ``stat_names``),
                which ``observe`` updates in place; they move with their tokens.
    queries:    (B, Hq, T, D) this call's queries, rotated at ``step.positions``.
    step:       the call's chunk (positions, padding, each row's newest position).
    mass:       (B, Hkv, N) attention the call's listened queries gave each candidate, summed over
                the query heads of each K/V head; only in ``observe``, and only for a policy that
                ``needs_attention`` (None otherwise).
    seen:       (B, Hp, N) how many listened queries could see each candidate, or 1.0 when one
                query saw them all; with ``mass`` only.
    keeps:      (B,) long, on the CPU: how many candidates each row keeps after this call
                (``cache_length``, or ``cache_length - reserve`` for a row that overflows), where a
                chunk is ranked; None in a decode step (every row keeps ``cache_length``). A score
                that depends on it (lagkv's partitions, critical's first stage) reads it here, so
                that a policy scores from its candidates and options alone.
    """

    stored_keys: object
    stored_values: object
    positions: torch.Tensor
    stats: dict[str, torch.Tensor]
    queries: torch.Tensor
    step: Step
    mass: torch.Tensor | None = None
    seen: torch.Tensor | float = 1.0
    keeps: torch.Tensor | None = None
    # Keys and values read back from packed views, by the first hook that asks.
    _decoded: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def keys(self) -> torch.Tensor:
        """(B, Hkv, N, D) the candidates' keys as a tensor (a quantized storage's read back from
        their codes, once per call, by the first hook that asks)."""
        return self._plain("stored_keys")

    @property
    def values(self) -> torch.Tensor:
        """(B, Hkv, N, D) the candidates' values as a tensor (see ``keys``)."""
        return self._plain("stored_values")

    def _plain(self, name: str) -> torch.Tensor:
        x = getattr(self, name)
        if isinstance(x, torch.Tensor) or x is None:
            return x
        if name not in self._decoded:
            self._decoded[name] = x.decoded()
        return self._decoded[name]

    @property
    def newest(self) -> torch.Tensor | int:
        """Position of each row's newest token after this call: an int when every row has the
        same (known on the host, so comparing with it costs no device work), else (B, 1, 1)."""
        step = self.step
        if step.uniform:
            return step.start0 + step.num_tokens - 1
        return step.newest[:, None, None]

    @property
    def empty(self) -> torch.Tensor:
        """(B, Hp, N) bool: slots that hold no token."""
        return self.positions < 0
