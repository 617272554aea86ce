"""How long the event loop is held: a 10 ms ticker that measures how late it runs.

Everything a peer does for others (heartbeats, DHT answers, the all-reduce's
sends, the status endpoint) waits while something holds the event loop; a
tick that runs 80 ms late means every one of them waited up to 80 ms. The
monitor keeps the last minute of ticks and reports percentiles of the lateness
(`/status` `loop_lag_ms`, `/metrics` shoal_event_loop_lag_*).

A stall weighs by its length. A tick that runs 2 s late kept the ticker from
running 200 times; those ticks are counted too, each as late as it would have
been (2 s, 1.99 s, ... down to 10 ms), so the percentiles are those of the
lateness over time: a loop held 2 s in a minute has a p99 near 1.4 s, not that
of the one tick that ran. A stall still going on when the summary is read (from
another thread, or by a callback that ran before the ticker) counts up to now,
and a stall longer than the window fills it: a ticker that did not run for 99 s
reports a full window of late ticks and a max of 99 s, not an empty window.
"""

from __future__ import annotations

import asyncio
import collections
import math
import time
from collections.abc import Iterator

__all__ = ["LoopLagMonitor"]

TICK_S = 0.01
WINDOW_S = 60.0
SUMMARY_CACHE_S = 0.5  # /status may be polled 10 times a second: sort at most twice


class LoopLagMonitor:
    def __init__(self, tick_s: float = TICK_S, window_s: float = WINDOW_S) -> None:
        self.tick_s = tick_s
        self.window_s = window_s
        self._lags: collections.deque[tuple[float, float]] = collections.deque()
        self._due: float | None = None  # when the running ticker's next tick is due
        self._summary: tuple[float, dict[str, float] | None] | None = None

    async def run(self) -> None:
        """Tick until cancelled."""
        # On the monotonic clock (uvloop's loop.time() counts whole milliseconds), which
        # status() may also read from any thread (a metrics scrape).
        self._due = time.monotonic() + self.tick_s
        try:
            while True:
                await asyncio.sleep(max(0.0, self._due - time.monotonic()))
                now = time.monotonic()
                self.record(now, max(0.0, now - self._due))
                self._due = now + self.tick_s
        finally:
            self._due = None

    def record(self, now: float, lag_s: float) -> None:
        """A tick ran at `now`, `lag_s` late (and with it the ticks it kept from running)."""
        self._lags.extend(self._held_back(now - lag_s + self.tick_s, now))
        self._lags.append((now, lag_s))
        while self._lags and self._lags[0][0] < now - self.window_s:
            self._lags.popleft()

    def summary(self, now: float) -> dict[str, float] | None:
        """{"p50_ms", "p99_ms", "max_ms", "window_s"} over the last window (a stall in
        progress included); None before the first tick."""
        if self._summary is not None and now - self._summary[0] < SUMMARY_CACHE_S:
            return self._summary[1]
        since = now - self.window_s
        # (the deque is trimmed when a tick runs: a starved ticker leaves older ticks)
        ticks = [tick for tick in self._lags if tick[0] >= since]
        if self._due is not None and now > self._due:
            ticks.extend(self._held_back(self._due, now))
        out = None
        if ticks:
            lags = sorted(lag for _, lag in ticks)
            out = {
                "p50_ms": round(1000 * _quantile(lags, 0.50), 2),
                "p99_ms": round(1000 * _quantile(lags, 0.99), 2),
                "max_ms": round(1000 * lags[-1], 2),
                "window_s": round(min(self.window_s, now - ticks[0][0]), 1),
            }
        self._summary = (now, out)
        return out

    def _held_back(self, first_due: float, now: float) -> Iterator[tuple[float, float]]:
        """(due, lateness at `now`) of the ticks due from `first_due` that a loop held
        until `now` kept from running, those of the last window only."""
        skip = max(0, math.ceil((now - self.window_s - first_due) / self.tick_s))
        due = first_due + skip * self.tick_s
        while due < now:
            yield due, now - due
            due += self.tick_s


def _quantile(ordered: list[float], q: float) -> float:
    """The nearest-rank quantile of a sorted list."""
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]
