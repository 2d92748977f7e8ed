"""Token buckets by key: how a receiver bounds what strangers can make it do.

Each key (an agent id, or ``""`` for everyone together) holds up to ``burst`` tokens and earns
``rate`` a second; an action that costs more than the key holds is refused. Keys are kept in an
insertion-ordered table of bounded size (:func:`sfl_core.wire.protocol.remember`), so a flood of
invented ids costs bounded memory; a key pushed out starts again full, which only ever errs
towards answering.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from sfl_core.wire.protocol import MAX_REMEMBERED, remember

__all__ = ["TokenBuckets"]


class TokenBuckets:
    """``burst`` tokens per key, refilled at ``rate`` per second (thread-safe)."""

    def __init__(self, burst: float, rate: float, *, clock: Callable[[], float] = time.monotonic,
                 limit: int = MAX_REMEMBERED):
        if burst <= 0 or rate < 0:
            raise ValueError(f"TokenBuckets: burst must be > 0 and rate >= 0, got {burst!r}, {rate!r}")
        self.burst, self.rate, self._clock, self._limit = float(burst), float(rate), clock, limit
        self._buckets: dict[str, tuple[float, float]] = {}   # key -> (tokens, at)
        self._lock = threading.Lock()

    def take(self, key: str, cost: float = 1.0) -> bool:
        """Spend ``cost`` tokens of ``key``'s bucket if it holds them; False (nothing spent) if not."""
        now = self._clock()
        with self._lock:
            tokens, at = self._buckets.get(key, (self.burst, now))
            tokens = min(self.burst, tokens + (now - at) * self.rate)
            ok = tokens >= cost
            remember(self._buckets, key, (tokens - cost if ok else tokens, now), limit=self._limit)
            return ok
