"""Test timeouts that end a hung test, not the run (pytest-timeout's hooks, in conftest).

pytest-timeout's thread method ends a test at its timeout with ``os._exit``. Under
xdist that kills the worker; the stacks it prints go to the worker's stdout, which
execnet points at /dev/null; and pytest-xdist 3.8's loadgroup scheduler then hangs on
the replacement worker (pytest-xdist#1323, #1327, #1378). One test past its timeout
on CI (stop 34) so left the run at 99 % until CI's 90 minutes were up, naming no test.

Here a test at its timeout is interrupted instead, and fails like any other test:
the stacks of every thread (and of every asyncio task) go into its captured stderr,
then its event loop's tasks are cancelled, or, outside a loop, `TimedOut` is raised
in the main thread. Only a test still running `grace_s()` later ends the worker, its
stacks printed on the worker's real stderr first (which reaches the terminal), and
``--max-worker-restart 0`` (pyproject) then ends the run at once instead of hanging.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import sys
import threading
import traceback
import weakref
from collections.abc import Callable
from typing import Any

import pytest

GRACE_ENV = "SHOAL_TEST_TIMEOUT_GRACE_S"
DEFAULT_GRACE_S = 30.0  # teardown of a swarm test stops its daemons: give it time

# The loops tests run on (conftest's loop factory registers them), to cancel their
# tasks from the timer's thread: a loop's own thread is the only safe place for that.
LOOPS: weakref.WeakSet[asyncio.AbstractEventLoop] = weakref.WeakSet()


class TimedOut(Exception):
    """Raised in a synchronous test's main thread at its timeout."""

    def __init__(self, *args: object) -> None:
        # (raised as a class, by PyThreadState_SetAsyncExc: no arguments)
        super().__init__(*(args or ("the test ran past its timeout",)))


def grace_s() -> float:
    """Seconds between a test's interruption and the end of its worker."""
    return float(os.environ.get(GRACE_ENV, DEFAULT_GRACE_S))


def tracked(
    factory: Callable[[], asyncio.AbstractEventLoop],
) -> Callable[[], asyncio.AbstractEventLoop]:
    """`factory`, with every loop it makes registered for interruption."""

    def make() -> asyncio.AbstractEventLoop:
        loop = factory()
        LOOPS.add(loop)
        return loop

    return make


def thread_stacks() -> str:
    names = {t.ident: t.name for t in threading.enumerate()}
    here = threading.get_ident()
    return "\n".join(
        f"--- thread {names.get(ident, ident)} ---\n" + "".join(traceback.format_stack(frame))
        for ident, frame in sys._current_frames().items()
        if ident != here
    )


def cancel_every_task(loop: asyncio.AbstractEventLoop, why: str) -> None:
    """(On the loop's thread.) Print where every task waits, then cancel them all."""
    for task in asyncio.all_tasks(loop):
        print(f"--- task {task.get_name()} ---", file=sys.stderr)
        task.print_stack(file=sys.stderr)
    for task in asyncio.all_tasks(loop):
        task.cancel(why)


class Deadline:
    """A test's timeout: interrupt at `timeout_s`, end the worker `grace_s()` later."""

    def __init__(self, item: pytest.Item, timeout_s: float) -> None:
        self.item = item
        self.timeout_s = timeout_s
        self.main_thread = threading.get_ident()
        self.lock = threading.Lock()
        self.over = False  # the test ended: nothing may be raised in its thread any more
        self.timers = [
            threading.Timer(timeout_s, self.interrupt),
            threading.Timer(timeout_s + grace_s(), self.end_worker),
        ]
        for timer in self.timers:
            timer.daemon = True
            timer.name = f"timeout of {item.nodeid}"
            timer.start()

    def cancel(self) -> None:
        with self.lock:
            self.over = True
        for timer in self.timers:
            timer.cancel()

    def interrupt(self) -> None:
        why = f"{self.item.nodeid} timed out after {self.timeout_s:g} s"
        with self.lock:
            if self.over:
                return
            print(
                f"\n+++ {why}: the stacks of every thread +++\n{thread_stacks()}", file=sys.stderr
            )
            running = [loop for loop in LOOPS if loop.is_running() and not loop.is_closed()]
            for loop in running:
                loop.call_soon_threadsafe(cancel_every_task, loop, why)
            if not running:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(
                    ctypes.c_ulong(self.main_thread), ctypes.py_object(TimedOut)
                )

    def end_worker(self) -> None:
        with self.lock:
            if self.over:
                return
            capture = self.item.config.pluginmanager.getplugin("capturemanager")
            if capture is not None:
                capture.suspend_global_capture(in_=False)  # back to the real stderr
            print(
                f"\n+++ {self.item.nodeid} still runs {grace_s():g} s after its "
                f"{self.timeout_s:g} s timeout: ending this worker +++\n{thread_stacks()}\n",
                file=sys.stderr,
                flush=True,
            )
            os._exit(1)


def pytest_timeout_set_timer(item: pytest.Item, settings: Any) -> bool:
    item.stash[DEADLINE] = Deadline(item, settings.timeout)
    return True  # (firstresult: pytest-timeout's own timer is not set)


def pytest_timeout_cancel_timer(item: pytest.Item) -> bool:
    deadline = item.stash.get(DEADLINE, None)
    if deadline is not None:
        deadline.cancel()
    return True


DEADLINE = pytest.StashKey[Deadline]()
