"""One deadline type for everything a step waits on: a point in the event loop's time.

A step's budget passes through matchmaking, the all-reduce and a re-sync as a
`Deadline`, never as a relative timeout restarted at each stage (which would
let a step overrun its budget by the sum of the stages) nor as wall-clock time
(which jumps with NTP). Wall clock is for DHT expirations only.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass

__all__ = ["Deadline"]


def _now() -> float:
    return asyncio.get_running_loop().time()


@dataclass(frozen=True, slots=True)
class Deadline:
    """`at`: the loop time (``loop.time()``) it passes at; None: never."""

    at: float | None

    @classmethod
    def after(cls, seconds: float | None) -> Deadline:
        """`seconds` from now (None: never)."""
        if seconds is None:
            return cls(None)
        if math.isnan(seconds):
            raise ValueError("a deadline needs a number of seconds")
        return cls(_now() + seconds)

    @classmethod
    def never(cls) -> Deadline:
        return cls(None)

    def remaining(self) -> float | None:
        """Seconds left, at least 0; None for never."""
        return None if self.at is None else max(0.0, self.at - _now())

    def expired(self) -> bool:
        return self.at is not None and _now() >= self.at

    def within(self, seconds: float) -> Deadline:
        """The earlier of this deadline and `seconds` from now."""
        other = _now() + seconds
        return Deadline(other if self.at is None else min(self.at, other))

    def scope(self) -> asyncio.Timeout:
        """``async with deadline.scope():`` raises TimeoutError when it passes."""
        return asyncio.timeout_at(self.at)
