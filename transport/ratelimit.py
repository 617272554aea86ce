"""Rate limits as token buckets, sans I/O: the caller passes the time.

A remote peer decides how often it connects, asks and misbehaves; every limit on
what that costs us (requests answered, log lines written, records stored) is a
bucket per key (a peer, an IP, a /24) that refills at a steady rate up to a
burst. `KeyedBuckets` bounds its own memory: a flood of distinct keys evicts the
least recently used, which at worst forgets that a key was throttled.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field

__all__ = ["KeyedBuckets", "TokenBucket"]


@dataclass
class TokenBucket:
    """`rate` tokens per second, at most `burst` saved up; starts full."""

    rate: float
    burst: float
    tokens: float = field(default=-1.0)
    updated: float | None = None

    def __post_init__(self) -> None:
        if self.rate < 0 or self.burst <= 0:
            raise ValueError("a token bucket needs rate >= 0 and burst > 0")
        if self.tokens < 0:
            self.tokens = self.burst

    def _refill(self, now: float) -> None:
        if self.updated is not None and now > self.updated:
            self.tokens = min(self.burst, self.tokens + (now - self.updated) * self.rate)
        if self.updated is None or now > self.updated:
            self.updated = now

    def take(self, now: float, cost: float = 1.0) -> bool:
        """Spend `cost` tokens if there are that many (True), else spend none (False)."""
        self._refill(now)
        if self.tokens >= cost:
            self.tokens -= cost
            return True
        return False

    def available(self, now: float) -> float:
        self._refill(now)
        return self.tokens


class KeyedBuckets:
    """One `TokenBucket` per key, for at most `max_keys` keys (least recently used go)."""

    def __init__(self, rate: float, burst: float, *, max_keys: int = 4096) -> None:
        if max_keys < 1:
            raise ValueError("max_keys must be >= 1")
        TokenBucket(rate, burst)  # (validates the arguments once, here)
        self.rate = rate
        self.burst = burst
        self.max_keys = max_keys
        self._buckets: OrderedDict[Hashable, TokenBucket] = OrderedDict()

    def take(self, key: Hashable, now: float, cost: float = 1.0) -> bool:
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = TokenBucket(self.rate, self.burst)
            while len(self._buckets) > self.max_keys:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(key)
        return bucket.take(now, cost)

    def __len__(self) -> int:
        return len(self._buckets)
