"""TaskSet: the owner of every background task; failures are logged, close cancels."""

from __future__ import annotations

import asyncio
import logging

import pytest

from shoal.transport.tasks import TaskSet

log = logging.getLogger("shoal.test.tasks")


async def _fail(message: str) -> None:
    raise RuntimeError(message)


async def test_a_failed_task_is_logged_with_its_owner(caplog: pytest.LogCaptureFixture) -> None:
    tasks = TaskSet(log, "prober")
    with caplog.at_level(logging.WARNING, logger=log.name):
        # (The set's done callback was added first: it has run when gather returns.)
        await asyncio.gather(tasks.spawn(_fail("boom")), return_exceptions=True)
    assert len(tasks) == 0
    assert tasks.failures == 1
    assert "prober background task failed (1 so far): RuntimeError('boom')" in caplog.text


async def test_a_flood_of_failures_logs_only_powers_of_two(
    caplog: pytest.LogCaptureFixture,
) -> None:
    tasks = TaskSet(log, "handler")
    with caplog.at_level(logging.WARNING, logger=log.name):
        spawned = [tasks.spawn(_fail(str(i))) for i in range(100)]
        await asyncio.gather(*spawned, return_exceptions=True)
    assert tasks.failures == 100
    assert len(caplog.records) == 7  # the 1st, 2nd, 4th, ... 64th


async def test_aclose_cancels_the_running_tasks_and_a_later_spawn_never_runs() -> None:
    tasks = TaskSet(log, "owner")
    started = asyncio.Event()
    ran_after_close = False

    async def forever() -> None:
        started.set()
        await asyncio.Event().wait()

    async def late() -> None:
        nonlocal ran_after_close
        ran_after_close = True

    running = tasks.spawn(forever())
    await asyncio.wait_for(started.wait(), 5)
    await tasks.aclose()
    assert running.cancelled()
    after = tasks.spawn(late())
    await asyncio.gather(after, return_exceptions=True)
    assert after.cancelled() and not ran_after_close


async def test_cancel_leaves_the_set_open_and_wait_includes_tasks_started_meanwhile() -> None:
    tasks = TaskSet(log, "owner")
    blocker = tasks.spawn(asyncio.Event().wait())
    tasks.cancel()
    await asyncio.gather(blocker, return_exceptions=True)
    assert blocker.cancelled()
    order: list[str] = []

    async def second() -> None:
        order.append("second")

    async def first() -> None:
        tasks.spawn(second())  # started while `wait` waits
        order.append("first")

    tasks.spawn(first())
    await asyncio.wait_for(tasks.wait(), 5)
    assert order == ["first", "second"]
    assert len(tasks) == 0
