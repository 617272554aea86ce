"""An owner for background tasks: every task it starts is awaited or cancelled.

docs/architecture/index.md forbids fire-and-forget tasks; objects that start helpers of their
own (the DHT node's pings and cache stores, the NAT manager's probes) keep
them in a `TaskSet` and close it in their `aclose`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

T = TypeVar("T")


class TaskSet:
    """Tasks owned by one object; `cancel` or `aclose` ends them all.

    A task that fails is logged (with `what`, at `level`) and dropped: a background
    helper's failure must not go unnoticed, nor take its owner down. A failure a
    remote peer can cause at will must not flood the log either: past the first,
    only the 2nd, 4th, 8th... are logged, with the count so far.
    """

    def __init__(self, log: logging.Logger, what: str, level: int = logging.WARNING) -> None:
        self._log = log
        self._what = what
        self._level = level
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False
        self.failures = 0

    def __len__(self) -> int:
        return len(self._tasks)

    def __iter__(self) -> Iterator[asyncio.Task[Any]]:
        return iter(list(self._tasks))

    def spawn(self, coro: Coroutine[Any, Any, T], *, name: str | None = None) -> asyncio.Task[T]:
        """Run `coro` as a task of this set. Once the set is closed, the task is
        cancelled before it starts (the coroutine never runs)."""
        task = asyncio.get_running_loop().create_task(coro, name=name)
        if self._closed:
            task.cancel()
            return task
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled() or (error := task.exception()) is None:
            return
        self.failures += 1
        if self.failures & (self.failures - 1) == 0:  # the 1st, 2nd, 4th, 8th...
            self._log.log(
                self._level,
                "%s background task failed (%d so far): %r",
                self._what,
                self.failures,
                error,
            )

    def cancel(self) -> None:
        """Cancel every task running now (the set stays open: for owners that close
        synchronously and may still start tasks while they wind down)."""
        for task in list(self._tasks):
            task.cancel()

    async def wait(self) -> None:
        """Until every task has ended, those started meanwhile included."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def aclose(self) -> None:
        self._closed = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
