"""A virtual-time asyncio event loop: when every task waits, the clock jumps to the next timer."""

from __future__ import annotations

import asyncio
import contextlib
import selectors
import time
from collections.abc import Iterator
from typing import Any

# The wall-clock time (UNIX seconds) that virtual time 0 stands for: DHT records carry
# absolute expirations, so time.time() must move with the virtual clock.
EPOCH = 1_800_000_000.0


_THREAD_POLL_S = 0.05


class SimDeadlock(RuntimeError):
    """Every task waits and no timer is scheduled: nothing can ever happen again."""


class _JumpingSelector(selectors.DefaultSelector):
    """Polls the loop's real file descriptors (its self-pipe) without blocking; where
    the loop would sleep until its next timer, advances the virtual clock instead."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.threads_busy = 0  # executor jobs running: their results come in real time
        # Virtual seconds charged per CPU second spent running callbacks: 0 makes
        # computation free (protocol behaviour only); 1/cores models every peer
        # sharing one machine's cores, as real processes on one machine do.
        self.cpu_scale = 0.0
        self._ran_since = time.thread_time()

    def select(self, timeout: float | None = None) -> list[Any]:
        # (`timeout` is to the next timer from the clock before the CPU charge.)
        before = self.now
        if not self.cpu_scale:
            return self._select(timeout, before)
        self.now += (time.thread_time() - self._ran_since) * self.cpu_scale
        try:
            return self._select(timeout, before)
        finally:
            self._ran_since = time.thread_time()  # (a system call: only when charging)

    def _select(self, timeout: float | None, before: float) -> list[Any]:
        events = super().select(0)
        if events or timeout == 0:
            return events
        if self.threads_busy:
            # A thread's work takes no virtual time: wait for it in real time (its
            # result wakes the loop through the self-pipe), without moving the clock.
            return super().select(_THREAD_POLL_S)
        if timeout is None:
            raise SimDeadlock("every task waits and no timer is scheduled")
        self.now = max(self.now, before + timeout)
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop whose `time()` is virtual: it never sleeps, it skips ahead.

    Callbacks cost no virtual time unless `cpu_scale` charges their CPU time; timers
    (sleeps, timeouts, and the simulated network's deliveries, which are timers too)
    move the clock. `network` is the
    simulated network that `create_connection` / `create_server` go through; nothing
    here touches a real socket.
    """

    def __init__(self) -> None:
        self._jumper = _JumpingSelector()
        super().__init__(self._jumper)
        self._clock_resolution = 1e-9
        self.network: Any = None

    def time(self) -> float:
        return self._jumper.now

    @property
    def cpu_scale(self) -> float:
        """Virtual seconds charged per real second of callbacks (0: computation is free)."""
        return self._jumper.cpu_scale

    @cpu_scale.setter
    def cpu_scale(self, value: float) -> None:
        self._jumper.cpu_scale = value
        self._jumper._ran_since = time.thread_time()  # charged from now on

    def run_in_executor(self, executor: Any, func: Any, *args: Any) -> asyncio.Future[Any]:
        future = super().run_in_executor(executor, func, *args)
        self._jumper.threads_busy += 1

        def done(_: asyncio.Future[Any]) -> None:
            self._jumper.threads_busy -= 1

        future.add_done_callback(done)
        return future

    async def create_connection(  # type: ignore[override]
        self, protocol_factory: Any, host: str | None = None, port: int | None = None, **kw: Any
    ) -> tuple[asyncio.Transport, asyncio.BaseProtocol]:
        if self.network is None or kw.get("sock") is not None or host is None or port is None:
            raise OSError("only simulated connections (host, port) exist in the simulator")
        return await self.network.connect(host, int(port), protocol_factory)

    async def create_server(  # type: ignore[override]
        self, protocol_factory: Any, host: str | None = None, port: int | None = None, **kw: Any
    ) -> Any:
        if self.network is None or kw.get("sock") is not None or host is None:
            raise OSError("only simulated listeners (host, port) exist in the simulator")
        return self.network.listen(host, int(port or 0), protocol_factory)


@contextlib.contextmanager
def virtual_clocks(loop: VirtualTimeLoop) -> Iterator[None]:
    """Make time.time() and time.monotonic() (and the transport's cached reference to
    the latter) read the loop's virtual clock while the simulation runs: protocol code
    reads them for expirations, RTTs and idle times."""
    from shoal.transport import connection

    saved = (time.time, time.monotonic, connection._now)

    def wall() -> float:
        return EPOCH + loop.time()

    time.time = wall  # type: ignore[assignment]
    time.monotonic = loop.time  # type: ignore[assignment]
    connection._now = loop.time
    try:
        yield
    finally:
        time.time, time.monotonic, connection._now = saved  # type: ignore[assignment]
