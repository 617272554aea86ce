"""Log lines caused by remote peers: the first few per kind and minute, then one summary."""

from __future__ import annotations

import asyncio
import logging

import pytest

from shoal.transport.remote_log import RemoteEventCounter, RemoteEvents

KIND = "handshake not finished"


def test_the_first_few_of_a_kind_are_logged_then_counted() -> None:
    c = RemoteEventCounter(window=60, first_per_window=5)
    logged = [c.note(KIND, f"10.0.0.{i % 7}", now=float(i) / 100) for i in range(2000)]
    assert logged[:5] == [True] * 5
    assert not any(logged[5:])
    assert c.due(59.0) == []  # the window has not ended
    (summary,) = c.due(60.0)
    assert summary.suppressed == 1995
    assert summary.addresses == 7
    assert summary.top_count == max(sum(1 for i in range(5, 2000) if i % 7 == k) for k in range(7))
    assert summary.line().startswith(
        "suppressed 1,995 'handshake not finished' from 7 addresses in the last 60 s; most from"
    )
    assert c.total[KIND] == 2000


def test_a_new_window_logs_again_and_kinds_are_independent() -> None:
    c = RemoteEventCounter(window=60, first_per_window=1)
    assert c.note(KIND, "a", now=0)
    assert c.note("protocol violation", "a", now=1)  # its own budget
    assert not c.note(KIND, "a", now=2)
    assert c.next_due() == 60
    assert [s.kind for s in c.due(61)] == [KIND]
    assert c.note(KIND, "a", now=61)  # a new window, a new budget


def test_a_quiet_window_writes_no_summary() -> None:
    c = RemoteEventCounter(window=60, first_per_window=5)
    for t in range(5):
        assert c.note(KIND, "a", now=t)
    assert c.next_due() is None
    assert c.due(100) == []


def test_distinct_addresses_are_bounded_and_the_summary_says_at_least() -> None:
    c = RemoteEventCounter(window=60, first_per_window=0, max_addresses=100)
    for i in range(10_000):
        c.note(KIND, f"203.0.{i // 256}.{i % 256}", now=0)
    (s,) = c.flush()
    assert (s.suppressed, s.addresses, s.addresses_capped) == (10_000, 100, True)
    assert "from at least 100 addresses" in s.line()


def test_one_address_summary_names_no_top() -> None:
    c = RemoteEventCounter(window=10, first_per_window=0)
    c.note(KIND, "203.0.113.7", now=0)
    c.note(KIND, "203.0.113.7", now=1)
    (s,) = c.flush()
    assert s.line() == "suppressed 2 'handshake not finished' from 1 address in the last 10 s"


@pytest.mark.timeout(10)
async def test_the_summary_is_written_when_the_window_ends_even_if_the_flood_stopped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    logger = logging.getLogger("shoal.test.remote_log")
    events = RemoteEvents(logger, window=0.2, first_per_window=2)
    third_line = asyncio.Event()

    class Notify(logging.Handler):
        seen = 0

        def emit(self, record: logging.LogRecord) -> None:
            self.seen += 1
            if self.seen == 3:
                third_line.set()

    notify = Notify()
    logger.addHandler(notify)
    try:
        with caplog.at_level(logging.INFO, logger=logger.name):
            for i in range(500):
                events.info(KIND, "203.0.113.7" if i % 3 else "198.51.100.1", "closing %d", i)
            assert [r.getMessage() for r in caplog.records] == ["closing 0", "closing 1"]
            await third_line.wait()  # the timer writes the summary; no more events come
    finally:
        logger.removeHandler(notify)
    summary = caplog.records[2].getMessage()
    assert summary == (
        "suppressed 498 'handshake not finished' from 2 addresses in the last 0.2 s; "
        "most from 203.0.113.7 (332)"
    )
