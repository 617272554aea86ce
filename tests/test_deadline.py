"""transport.deadline: asyncio.timeout's behaviour for the RPC hot path."""

from __future__ import annotations

import asyncio

import pytest

from shoal.transport.deadline import deadline


async def test_a_block_past_its_deadline_raises_timeout_error() -> None:
    with pytest.raises(TimeoutError), deadline(0.01) as d:
        await asyncio.sleep(10)
    assert d.expired
    assert asyncio.current_task().cancelling() == 0  # the cancellation was ours, taken back


async def test_a_block_within_its_deadline_returns_and_leaves_no_timer() -> None:
    with deadline(10) as d:
        await asyncio.sleep(0)
    assert not d.expired and d._handle is None


async def test_none_arms_nothing() -> None:
    with deadline(None) as d:
        await asyncio.sleep(0)
    assert d._handle is None and d._task is None


async def test_a_cancellation_from_elsewhere_stays_a_cancellation() -> None:
    entered = asyncio.Event()

    async def guarded() -> None:
        with deadline(10):
            entered.set()
            await asyncio.sleep(10)

    task = asyncio.create_task(guarded())
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
