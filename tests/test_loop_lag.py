"""The event loop's lag: a ticker that notices when something holds the loop."""

from __future__ import annotations

import asyncio
import time

import pytest

from shoal.peer.status.loop_lag import LoopLagMonitor

pytestmark = pytest.mark.timeout(30)


def _ticks(monitor: LoopLagMonitor, start: float, seconds: float, lag_s: float) -> float:
    """A ticker that ran every 10 ms for `seconds`, each tick `lag_s` late; the end."""
    n = round(seconds / monitor.tick_s)
    for i in range(n):
        monitor.record(start + i * monitor.tick_s, lag_s)
    return start + (n - 1) * monitor.tick_s


def test_percentiles_over_the_window_only() -> None:
    monitor = LoopLagMonitor(window_s=10.0)
    end = _ticks(monitor, 0.0, 10.0, 0.001)
    monitor.record(end + 0.05, 0.05)  # one 50 ms stall (and the 4 ticks it held back)
    summary = monitor.summary(end + 0.05)
    assert summary == {"p50_ms": 1.0, "p99_ms": 1.0, "max_ms": 50.0, "window_s": 10.0}
    _ticks(monitor, end + 0.06, 20.0, 0.002)  # 20 s later the stall has left the window
    assert monitor.summary(end + 20.05)["max_ms"] == 2.0  # type: ignore[index]


def test_a_stall_weighs_by_its_length_not_as_one_tick() -> None:
    monitor = LoopLagMonitor(window_s=60.0)
    end = _ticks(monitor, 0.0, 10.0, 0.001)
    monitor.record(end + 1.0, 1.0)  # the loop was held 1 s of these 11
    summary = monitor.summary(end + 1.0)
    assert summary is not None
    assert summary["p50_ms"] == 1.0
    # 100 ticks of 1100 were late: the p99 is the 89th latest of them, not 1 ms.
    assert summary["p99_ms"] == pytest.approx(890.0, abs=1.0)
    assert summary["max_ms"] == 1000.0


def test_a_ticker_starved_longer_than_the_window_reports_a_full_window_of_stall() -> None:
    monitor = LoopLagMonitor(window_s=60.0)
    end = _ticks(monitor, 0.0, 10.0, 0.001)
    monitor.record(end + 99.0, 99.0)  # nothing ran for 99 s
    summary = monitor.summary(end + 99.0)
    assert summary is not None
    assert summary["window_s"] == 60.0
    assert summary["max_ms"] == 99_000.0
    assert summary["p50_ms"] == pytest.approx(30_000.0, abs=20.0)
    assert summary["p99_ms"] == pytest.approx(59_400.0, abs=20.0)


def test_nothing_before_the_first_tick() -> None:
    assert LoopLagMonitor().summary(0.0) is None


async def test_a_blocked_loop_shows_as_lag() -> None:
    monitor = LoopLagMonitor()
    ticker = asyncio.create_task(monitor.run())
    try:
        await asyncio.sleep(0.05)  # let it tick a few times
        time.sleep(0.2)  # noqa: ASYNC251  # hold the loop, as hashing a large model would
        await asyncio.sleep(0.05)
        summary = monitor.summary(time.monotonic())
        assert summary is not None and summary["max_ms"] >= 150
    finally:
        ticker.cancel()


async def test_a_stall_still_going_on_counts_before_the_ticker_runs_again() -> None:
    monitor = LoopLagMonitor()
    ticker = asyncio.create_task(monitor.run())
    try:
        await asyncio.sleep(0)  # the ticker starts: its first tick is due in 10 ms
        time.sleep(0.3)  # noqa: ASYNC251  # the loop is held: the ticker cannot run
        # Read as a /status callback that runs before the ticker would: the stall shows.
        summary = monitor.summary(time.monotonic())
        assert summary is not None and summary["max_ms"] >= 250
    finally:
        ticker.cancel()
