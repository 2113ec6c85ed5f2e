"""The one token bucket of the neurons: the miner's per-validator request budget and the gateway's
per-API-key rate limit both take from it."""
from __future__ import annotations

import time
from typing import Optional


class TokenBuckets:
    """One bucket per key. A bucket holds at most `size` tokens (one window's worth of requests),
    starts full and refills at `size / window_s` tokens per second; a request takes one token.
    `size` is given per call, so that each key may have its own (a validator's stake share).
    Not thread-safe: the neurons call it from their event loop only."""

    def __init__(self, window_s: float):
        self.window_s = window_s
        self._buckets: dict[str, tuple[float, float]] = {}  # key -> (tokens, updated at)

    def take(self, key: str, size: float, now: Optional[float] = None) -> Optional[float]:
        """None when the request may go (a token was taken); else the seconds until one is there."""
        tokens, rate, now = self._refilled(key, size, now)
        if tokens < 1.0:
            self._buckets[key] = (tokens, now)
            return (1.0 - tokens) / rate
        self._buckets[key] = (tokens - 1.0, now)
        return None

    def peek(self, key: str, size: float, now: Optional[float] = None) -> Optional[float]:
        """What `take` would answer, taking nothing."""
        tokens, rate, _ = self._refilled(key, size, now)
        return None if tokens >= 1.0 else (1.0 - tokens) / rate

    def _refilled(self, key: str, size: float, now: Optional[float]) -> tuple[float, float, float]:
        """(tokens in the bucket at `now`, refill rate per second, now)."""
        now = time.monotonic() if now is None else now
        size = float(size)
        rate = size / self.window_s
        tokens, updated = self._buckets.get(key, (size, now))
        return min(size, tokens + (now - updated) * rate), rate, now
