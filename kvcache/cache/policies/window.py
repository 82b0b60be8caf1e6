"""window: the most recent ``cache_length`` tokens (a sliding window over a ring of slots).

Each query sees exactly the ``cache_length`` newest positions up to its own, however the
sequence is chunked, so a chunked prefill gives the same result as token-by-token decoding.
"""

from __future__ import annotations

from ..ring import RingCache


class WindowCache(RingCache):
    name = "window"
    description = "the most recent cache_length tokens (sliding window)"

    def lookback(self) -> int | None:
        return self.spec.cache_length
