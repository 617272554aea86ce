"""A virtual-time asyncio event loop: when every task waits, the clock jumps to the next timer."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import gc
import itertools
import os
import random
import selectors
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

# The wall-clock time (UNIX seconds) that virtual time 0 stands for: DHT records carry
# absolute expirations, so time.time() must move with the virtual clock.
EPOCH = 1_800_000_000.0


class SimDeadlock(RuntimeError):
    """Every task waits and no timer is scheduled: nothing can ever happen again."""


def processor_sharing_s(cpu_s: list[float], cores: int, background: float) -> float:
    """How long processes needing `cpu_s` seconds of CPU each, started together, take
    to finish on `cores` cores that `background` other runnable tasks share (the
    scheduler's fair share): while n of them still run, each gets min(1, cores /
    (n + background)) of a core."""
    elapsed, done = 0.0, 0.0
    ordered = sorted(cpu_s)
    for i, cpu in enumerate(ordered):
        running = len(ordered) - i
        elapsed += (cpu - done) * max(1.0, (running + background) / cores)
        done = cpu
    return elapsed


class _JumpingSelector(selectors.DefaultSelector):
    """Polls the loop's real file descriptors (its self-pipe) without blocking; where
    the loop would sleep until its next timer, advances the virtual clock instead."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        # Virtual seconds charged per CPU second spent running callbacks: 0 makes
        # computation free (protocol behaviour only). With `cores`, it is the CPU a real
        # peer spends per second of the simulator's (sockets, its own event loop).
        self.cpu_scale = 0.0
        # With `cores`, each peer is a process of its own on a machine of that many
        # cores, shared with `background` other runnable tasks on average (other work
        # on the machine): the callbacks that were ready at one virtual instant (one
        # pass of the loop) run side by side, and the pass takes as long as the
        # processor sharing of those cores takes to finish them. Without `cores`,
        # each pass takes its total CPU time (one core, no other load).
        self.cores = 0
        self.background = 0.0
        self.loop: Any = None  # the VirtualTimeLoop this selects for (its timers)
        self.owner: contextvars.ContextVar[Any] | None = None  # names a callback's peer
        self.peer_cpu_s = 0.0  # CPU charged to peers so far (before `cpu_scale`)
        self._spent: defaultdict[Any, float] = defaultdict(float)  # this pass, per peer
        self._nested = 0.0  # CPU of metered calls inside the one running now
        self._ran_since = time.thread_time()

    def select(self, timeout: float | None = None) -> list[Any]:
        # (`timeout` is to the next timer from the clock before the CPU charge.)
        before = self.now
        if not self.cpu_scale:
            return self._select(timeout, before)
        if self.cores:
            self.now += self._shared_pass_s() * self.cpu_scale
        else:
            self.now += (time.thread_time() - self._ran_since) * self.cpu_scale
        try:
            return self._select(timeout, before)
        finally:
            self._ran_since = time.thread_time()  # (a system call: only when charging)

    def _reach_due_timer(self) -> None:
        """Move the clock to the next timer if it is due within the loop's clock
        resolution: asyncio runs such a timer at once, and on a real clock time has
        reached it by then. Here it may not have: a matchmaking leader whose deadline
        was 4e-13 s ahead woke at once, found the deadline not reached, and waited
        for it again, millions of times at one virtual instant, while other peers'
        callbacks kept the loop from ever jumping (a 256-peer Moshpit run)."""
        loop = self.loop
        if loop is not None and loop._scheduled:
            when = loop._scheduled[0]._when
            if self.now < when <= self.now + loop._clock_resolution:
                self.now = when

    def _shared_pass_s(self) -> float:
        self._spent.pop(None, None)  # the simulator's own work (delivery): no peer does it
        spent = list(self._spent.values())
        self._spent.clear()
        self.peer_cpu_s += sum(spent)
        return processor_sharing_s(spent, self.cores, self.background)

    def metered(self, callback: Callable[..., Any], *args: Any) -> Any:
        """Run `callback`, adding its CPU time (less that of metered calls it makes)
        to the peer whose context it runs in."""
        t0, nested0 = time.thread_time(), self._nested
        try:
            return callback(*args)
        finally:
            spent = time.thread_time() - t0
            owner = self.owner.get(None) if self.owner is not None else None
            self._spent[owner] += spent - (self._nested - nested0)
            self._nested = nested0 + spent

    def _select(self, timeout: float | None, before: float) -> list[Any]:
        events = super().select(0)
        self._reach_due_timer()
        if events or timeout == 0:
            return events
        if timeout is None:
            raise SimDeadlock("every task waits and no timer is scheduled")
        self.now = max(self.now, before + timeout)
        return []


class _SimTask(asyncio.Task):  # type: ignore[type-arg]
    """A task hashed by the order the loop made it in, not by its address in memory.
    The product iterates sets of tasks (a DHT lookup's `asyncio.wait` answers, done
    at one virtual instant, in the set's order): ordered by address, that order moved
    with every change of the heap's history (the collector's schedule, what the
    process ran before), and so did the figures."""

    __slots__ = ("_seq",)

    def __init__(self, coro: Any, *, seq: int, **kwargs: Any) -> None:
        self._seq = seq  # (first: registering the task hashes it)
        super().__init__(coro, **kwargs)

    def __hash__(self) -> int:
        return self._seq


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.cancelled():  # (the caller stopped waiting: as with a thread's result)
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop whose `time()` is virtual: it never sleeps, it skips ahead.

    Callbacks cost no virtual time unless `cpu_scale` charges their CPU time; timers
    (sleeps, timeouts, and the simulated network's deliveries, which are timers too)
    move the clock. `network` is the
    simulated network that `create_connection` / `create_server` go through; nothing
    here touches a real socket. Nothing here depends on real time or on where objects
    lie in memory either (executor jobs run inline, tasks hash by the order they were
    made): with `seeded_entropy` and a fixed hash salt, a run repeats exactly.
    """

    def __init__(self) -> None:
        self._jumper = _JumpingSelector()
        super().__init__(self._jumper)
        self._jumper.loop = self
        self._clock_resolution = 1e-9
        self.network: Any = None
        self._tasks_made = itertools.count()

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

    @property
    def cores(self) -> int:
        """The cores the peers share (0: CPU is charged as a total, not per peer)."""
        return self._jumper.cores

    @property
    def peer_cpu_s(self) -> float:
        """The CPU seconds charged to peers so far, before `cpu_scale` (with `cores`)."""
        return self._jumper.peer_cpu_s

    def share_cores(
        self, cores: int, owner: contextvars.ContextVar[Any], background: float = 0.0
    ) -> None:
        """Charge each peer's CPU as a process's on `cores` cores shared with
        `background` other runnable tasks; `owner` names the peer a context is."""
        if cores < 1 or background < 0:
            raise ValueError("need cores >= 1 and background >= 0")
        self._jumper.cores, self._jumper.owner = cores, owner
        self._jumper.background = background

    def run_as(self, context: contextvars.Context, callback: Callable[..., Any], *args: Any) -> Any:
        """`context.run(callback, *args)`, its CPU charged to that context's peer."""
        if self._jumper.cores:
            return context.run(self._jumper.metered, callback, *args)
        return context.run(callback, *args)

    def call_soon(
        self, callback: Callable[..., Any], *args: Any, context: contextvars.Context | None = None
    ) -> asyncio.Handle:
        if self._jumper.cores:
            callback, args = self._jumper.metered, (callback, *args)
        return super().call_soon(callback, *args, context=context)

    def call_at(
        self,
        when: float,
        callback: Callable[..., Any],
        *args: Any,
        context: contextvars.Context | None = None,
    ) -> asyncio.TimerHandle:
        if self._jumper.cores:
            callback, args = self._jumper.metered, (callback, *args)
        return super().call_at(when, callback, *args, context=context)

    def create_task(  # type: ignore[override]
        self, coro: Any, *, name: str | None = None, context: contextvars.Context | None = None
    ) -> asyncio.Task[Any]:
        """asyncio's task, hashed by the order this loop made it in (`_SimTask`)."""
        if self.get_task_factory() is not None:  # (someone set their own: theirs)
            return super().create_task(coro, name=name, context=context)
        if self.is_closed():
            raise RuntimeError("Event loop is closed")
        seq = next(self._tasks_made)
        return _SimTask(coro, loop=self, name=name, context=context, seq=seq)

    def run_in_executor(self, executor: Any, func: Any, *args: Any) -> asyncio.Future[Any]:
        """Run `func(*args)` at once on the loop's own thread (whatever `executor`);
        its result (or exception) settles the future at the next pass of the loop,
        as a thread's result would. A real thread made the run non-deterministic: the
        loop waited for it in real time without moving the clock, so where its result
        landed among the other callbacks of that virtual instant depended on how fast
        the machine was. Its work takes no virtual time, as before: with `cpu_scale`,
        its CPU is not charged. `func` must not wait for the loop (it would wait
        forever): what the product runs in threads (hashing, codecs, copies) does not."""
        if self.is_closed():
            raise RuntimeError("Event loop is closed")
        future = self.create_future()
        jumper = self._jumper
        t0 = time.thread_time() if jumper.cpu_scale else 0.0
        result: Any = None
        error: BaseException | None = None
        try:
            result = func(*args)
        except Exception as e:  # (a thread's exception is its future's; ^C is ours)
            error = e
        finally:
            if jumper.cpu_scale:
                # A thread's CPU was never the loop's: take it out of both charges.
                spent = time.thread_time() - t0
                jumper._ran_since += spent
                jumper._nested += spent
        self.call_soon(_settle, future, result, error)
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


@contextlib.contextmanager
def seeded_entropy(seed: int) -> Iterator[None]:
    """Make the process's randomness a function of `seed` while the simulation runs:
    os.urandom (round IDs, nonces, secrets), random.SystemRandom and `secrets` (they
    read random's reference to it) and random.Random() made without a seed (each DHT
    routing table's own) all draw from one generator seeded by `seed`. Unseeded, each
    run drew other IDs and other lookup targets: other figures for the same scenario.
    Keys that the `cryptography` library makes (Noise's ephemeral keys) still come
    from OpenSSL: they change the bytes on the wire, never their sizes or timing."""
    # (Its own stream: the scenario's generators draw from `seed` itself.)
    source = random.Random(f"sim entropy {seed}")
    saved = (os.urandom, random._urandom, random.Random.seed)  # type: ignore[attr-defined]
    unseeded = random.Random.seed

    def urandom(n: int) -> bytes:
        return source.randbytes(n)

    def seed_or_draw(self: random.Random, a: Any = None, version: int = 2) -> None:
        unseeded(self, source.getrandbits(64) if a is None else a, version)

    os.urandom = urandom
    random._urandom = urandom  # type: ignore[attr-defined]
    random.Random.seed = seed_or_draw  # type: ignore[method-assign]
    try:
        yield
    finally:
        os.urandom, random._urandom, random.Random.seed = saved  # type: ignore[attr-defined,method-assign]


def freeze_setup() -> None:
    """Called by a workload once its long-lived setup is built (the joins): where the
    run asked for it (`run.py`'s tuned collector: the loop's `freeze_gc`), those
    objects are never traversed by the garbage collector again."""
    if getattr(asyncio.get_running_loop(), "freeze_gc", False):
        gc.collect()
        gc.freeze()


def _callback_name(callback: Any) -> str:
    """A callback's name that does not depend on where objects lie in memory: a task's
    step names the task by the order the loop made it (`_SimTask`) and its coroutine."""
    owner = getattr(callback, "__self__", None)
    if isinstance(owner, asyncio.Task):
        coro = owner.get_coro()
        return f"task {getattr(owner, '_seq', '?')} {getattr(coro, '__qualname__', '?')}"
    if isinstance(owner, asyncio.Future):
        return f"future {getattr(callback, '__name__', '?')}"
    inner = getattr(callback, "func", None)  # (functools.partial)
    if inner is not None:
        return f"partial {_callback_name(inner)}"
    return getattr(callback, "__qualname__", None) or type(callback).__name__


@contextlib.contextmanager
def traced_callbacks(path: str) -> Iterator[None]:
    """Write a line to `path` (gzip) for every callback the loop runs: its index, the
    virtual time and its name, with its arguments' types. Two runs of one scenario
    and seed should write the same file; where they do not, their first difference
    says where the order of events parted (`zcat a b | ...`, or `cmp` on the
    decompressed files). For finding a source of non-determinism: it slows a run by
    about a third and writes about 50 MB (compressed) per 256-peer burst."""
    import gzip
    from asyncio import events

    original = events.Handle._run
    count = itertools.count()
    with gzip.open(path, "wt", compresslevel=1) as out:

        def run(handle: events.Handle) -> None:
            name = _callback_name(handle._callback)  # type: ignore[attr-defined]
            args = handle._args  # type: ignore[attr-defined]
            if args:
                name += "(" + ",".join(type(a).__name__ for a in args) + ")"
            out.write(f"{next(count)} {handle._loop.time():.9f} {name}\n")  # type: ignore[attr-defined]
            original(handle)

        events.Handle._run = run  # type: ignore[method-assign]
        try:
            yield
        finally:
            events.Handle._run = original  # type: ignore[method-assign]
