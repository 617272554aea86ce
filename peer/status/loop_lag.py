"""How long the event loop is held: a 10 ms ticker that measures how late it runs.

Everything a peer does for others (heartbeats, DHT answers, the all-reduce's
sends, the status endpoint) waits while something holds the event loop; a
tick that runs 80 ms late means every one of them waited up to 80 ms. The
monitor keeps the last minute of ticks and reports percentiles of the lateness
(`/status` `loop_lag_ms`, `/metrics` shoal_event_loop_lag_*).
"""

from __future__ import annotations

import asyncio
import collections
import math
import time

__all__ = ["LoopLagMonitor"]

TICK_S = 0.01
WINDOW_S = 60.0
SUMMARY_CACHE_S = 0.5  # /status may be polled 10 times a second: sort at most twice


class LoopLagMonitor:
    def __init__(self, tick_s: float = TICK_S, window_s: float = WINDOW_S) -> None:
        self.tick_s = tick_s
        self.window_s = window_s
        self._lags: collections.deque[tuple[float, float]] = collections.deque()
        self._summary: tuple[float, dict[str, float] | None] | None = None

    async def run(self) -> None:
        """Tick until cancelled."""
        loop = asyncio.get_running_loop()
        due = loop.time() + self.tick_s
        while True:
            await asyncio.sleep(max(0.0, due - loop.time()))
            now = loop.time()
            # Windows and summaries on the monotonic clock: status() may be read from
            # any thread (a metrics scrape), where there is no loop to ask the time.
            self.record(time.monotonic(), max(0.0, now - due))
            due = now + self.tick_s

    def record(self, now: float, lag_s: float) -> None:
        self._lags.append((now, lag_s))
        while self._lags and self._lags[0][0] < now - self.window_s:
            self._lags.popleft()

    def summary(self, now: float) -> dict[str, float] | None:
        """{"p50_ms", "p99_ms", "max_ms", "window_s"} over the last window; None before
        the first tick."""
        if self._summary is not None and now - self._summary[0] < SUMMARY_CACHE_S:
            return self._summary[1]
        lags = sorted(lag for _, lag in self._lags)
        out = None
        if lags:
            out = {
                "p50_ms": round(1000 * _quantile(lags, 0.50), 2),
                "p99_ms": round(1000 * _quantile(lags, 0.99), 2),
                "max_ms": round(1000 * lags[-1], 2),
                "window_s": round(min(self.window_s, now - self._lags[0][0]), 1),
            }
        self._summary = (now, out)
        return out


def _quantile(ordered: list[float], q: float) -> float:
    """The nearest-rank quantile of a sorted list."""
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]
