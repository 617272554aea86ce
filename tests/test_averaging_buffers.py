"""The buffers a round borrows (`averaging/buffers.py`): the last round's are kept for
the next, and a round that ends while a thread still works on its buffers holds
none of them once that thread is done."""

from __future__ import annotations

import asyncio
import threading
import weakref

import pytest
import torch

from shoal.averaging.buffers import BufferPool, RoundBuffers

pytestmark = pytest.mark.timeout(30)


def test_the_last_rounds_buffers_are_lent_to_the_next() -> None:
    pool = BufferPool()
    first = RoundBuffers(pool)
    lent = first.take(1000)
    first.give_back()
    second = RoundBuffers(pool)
    assert second.take(1000).data_ptr() == lent.data_ptr()  # (no fresh pages)
    assert second.take(1000).data_ptr() != lent.data_ptr()  # (one each)


async def test_buffers_a_thread_still_uses_at_the_end_are_freed_when_it_is_done() -> None:
    """Not kept by the round (its objects refer to each other, and the collector frees
    them only at a full pass, rounds later): not lent again either, while in use."""
    pool = BufferPool()
    buffers = RoundBuffers(pool)
    busy = buffers.take(1000)
    gone = weakref.ref(busy)
    started, finish = threading.Event(), threading.Event()

    def work(t: torch.Tensor) -> None:
        started.set()
        finish.wait(10)
        t.fill_(1.0)

    job = asyncio.ensure_future(buffers.in_thread(work, busy))
    await asyncio.to_thread(started.wait, 10)
    buffers.give_back()  # (the round ended: the thread cannot be interrupted)
    in_use, lent = busy.data_ptr(), RoundBuffers(pool).take(1000).data_ptr()
    assert lent != in_use
    del busy
    finish.set()
    await job
    assert gone() is None
