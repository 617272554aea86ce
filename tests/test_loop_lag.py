"""The event loop's lag: a ticker that notices when something holds the loop."""

from __future__ import annotations

import asyncio
import time

from shoal.peer.status.loop_lag import LoopLagMonitor


def test_percentiles_over_the_window_only() -> None:
    monitor = LoopLagMonitor(window_s=10.0)
    for i in range(100):
        monitor.record(float(i) / 10, 0.001)  # 10 s of 1 ms lags
    monitor.record(10.0, 0.5)  # one 500 ms stall
    summary = monitor.summary(10.0)
    assert summary == {"p50_ms": 1.0, "p99_ms": 1.0, "max_ms": 500.0, "window_s": 10.0}
    for i in range(101, 300):  # 20 s later the stall has left the window
        monitor.record(float(i) / 10, 0.002)
    assert monitor.summary(30.0)["max_ms"] == 2.0  # type: ignore[index]


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
