"""An owner for background tasks: every task it starts is awaited or cancelled.

docs/architecture/index.md forbids fire-and-forget tasks; objects that start helpers of their
own (the DHT node's pings and cache stores, the NAT manager's probes) keep
them in a `TaskSet` and close it in their `aclose`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Iterator
from typing import Any


class TaskSet:
    """Tasks owned by one object; `aclose` cancels and awaits them all.

    A task that fails is logged (with `what`) and dropped: a background
    helper's failure must not go unnoticed, nor take its owner down.
    """

    def __init__(self, log: logging.Logger, what: str) -> None:
        self._log = log
        self._what = what
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False

    def __len__(self) -> int:
        return len(self._tasks)

    def __iter__(self) -> Iterator[asyncio.Task[Any]]:
        return iter(list(self._tasks))

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        if self._closed:
            coro.close()
            return
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self._log.warning("%s background task failed: %r", self._what, task.exception())

    async def aclose(self) -> None:
        self._closed = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
