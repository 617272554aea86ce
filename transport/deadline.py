"""A deadline for the per-call hot path: asyncio.timeout's semantics at a fraction of its cost.

`asyncio.timeout` runs about 250 bytecodes a use (a state machine, an async
context manager, a TimerHandle through `reschedule`); an RPC used two (the
caller's and the handler's), about a twentieth of everything one call costs.
`deadline` is a plain context manager around one `call_later`, and behaves
the same: when the delay passes, the task is cancelled and the block raises
TimeoutError; a cancellation from elsewhere (also one that races the expiry)
stays a CancelledError; `None` arms nothing.

    with deadline(5.0):
        await something()
"""

from __future__ import annotations

import asyncio
from types import TracebackType

__all__ = ["deadline"]


class deadline:  # (lower case, used like asyncio.timeout)
    __slots__ = ("_cancelling", "_delay", "_handle", "_task", "expired")

    def __init__(self, delay: float | None) -> None:
        self._delay = delay
        self._handle: asyncio.TimerHandle | None = None
        self._task: asyncio.Task[object] | None = None
        self._cancelling = 0
        self.expired = False  # the delay passed while the block ran

    def __enter__(self) -> deadline:
        if self._delay is not None:
            task = asyncio.current_task()
            if task is None:
                raise RuntimeError("deadline() must be used inside a task")
            self._task = task
            self._cancelling = task.cancelling()
            self._handle = task.get_loop().call_later(self._delay, self._expire)
        return self

    def _expire(self) -> None:
        assert self._task is not None
        self._handle = None
        self.expired = True
        self._task.cancel()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        elif self.expired:
            assert self._task is not None
            # Ours alone if no other cancellation came meanwhile (as asyncio.timeout).
            if self._task.uncancel() <= self._cancelling and exc_type is asyncio.CancelledError:
                raise TimeoutError from exc
