"""shoal as a library in a plain (synchronous) script: the peer on a background event loop.

    import shoal

    with shoal.sync.host("myexp", task="mytask.py:make_task", data_dir="./a") as peer:
        outer = peer.outer(model, optimizer)
        for batch in loader:
            model(batch).backward()
            outer.step(tokens=len(batch))  # blocks while a round runs

The same `Peer` and `Outer` as `shoal.peer.library.api`, driven from the caller's thread:
the event loop (uvloop when installed) runs in a daemon thread, so the network keeps
answering while the script computes; the optimizer steps in the caller's thread.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

import torch

from shoal.averaging.outer import RoundReport

from ..training.outer_loop import TrainerStats
from . import api as library
from .task_trainer import TaskTrainer

__all__ = ["SyncOuter", "SyncPeer", "SyncTaskTrainer", "host", "join"]

T = TypeVar("T")
# How long closing may take: the round in flight's bound and the transport's close (a
# CI run under load took more than 30 s after a Ctrl+C during a round).
CLOSE_TIMEOUT_S = 60.0


class _LoopThread:
    """An event loop running forever in a daemon thread; `run` waits for a coroutine."""

    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop
        try:
            import uvloop

            self.loop = uvloop.new_event_loop()
        except ImportError:  # (not on Windows)
            self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self.loop.run_forever, name="shoal-loop", daemon=True
        )
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


def host(name: str, **kwargs: Any) -> SyncPeer:
    """`shoal.host`, blocking; the same arguments."""
    return SyncPeer._start(library.host(name, **kwargs))


def join(ref: str, **kwargs: Any) -> SyncPeer:
    """`shoal.join`, blocking; the same arguments."""
    return SyncPeer._start(library.join(ref, **kwargs))


class SyncPeer:
    """A `library.Peer` on its own event loop thread; `close` (or `with`) shuts both down."""

    def __init__(self, peer: library.Peer, thread: _LoopThread) -> None:
        self.peer = peer
        self._thread = thread
        self._closed = False

    @classmethod
    def _start(cls, starting: Coroutine[Any, Any, library.Peer]) -> SyncPeer:
        thread = _LoopThread()
        try:
            return cls(thread.run(starting), thread)
        except BaseException:
            thread.stop()
            raise

    def __getattr__(self, name: str) -> Any:
        # The peer's plain attributes (peer_id, ref, addresses, manifest, model, ...).
        return getattr(self.peer, name)

    def outer(
        self, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None
    ) -> SyncOuter:
        """`Peer.outer`, blocking."""
        return SyncOuter(self._thread.run(self.peer.outer(model, optimizer)), self._thread)

    def task_trainer(self) -> SyncTaskTrainer:
        """`Peer.task_trainer`, blocking."""
        return SyncTaskTrainer(self._thread.run(self.peer.task_trainer()), self._thread)

    def close(self) -> None:
        """The round in flight ends, the peer shuts down, then its event loop."""
        if self._closed:
            return
        self._closed = True
        try:
            self._thread.run(self.peer.aclose(), CLOSE_TIMEOUT_S)
        finally:
            self._thread.stop()

    def __enter__(self) -> SyncPeer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SyncOuter:
    """`library.Outer` for a synchronous loop: `step` blocks while a round runs."""

    def __init__(self, outer: library.Outer, thread: _LoopThread) -> None:
        self.outer = outer
        self._thread = thread

    def step(
        self, *, tokens: int = 1, loss: float | torch.Tensor | None = None
    ) -> list[RoundReport]:
        """The optimizer's step here, then the strategy's turn on the peer's loop."""
        self.outer.optimizer_step()
        return self.after_step(tokens=tokens, loss=loss)

    def after_step(
        self, *, tokens: int = 1, loss: float | torch.Tensor | None = None
    ) -> list[RoundReport]:
        """`step` without the optimizer's step (your loop stepped it)."""
        value = None if loss is None else float(torch.as_tensor(loss).detach())
        return self._thread.run(self.outer.after_step(tokens=tokens, loss=value))

    @property
    def outer_steps(self) -> int:
        return self.outer.outer_steps

    @property
    def fingerprint(self) -> str | None:
        return self.outer.fingerprint

    @property
    def stats(self) -> TrainerStats:
        return self.outer.stats


class SyncTaskTrainer:
    """`library.TaskTrainer` for a synchronous loop: `step` blocks (a step and its round)."""

    def __init__(self, trainer: TaskTrainer, thread: _LoopThread) -> None:
        self.trainer = trainer
        self._thread = thread

    def step(self) -> list[RoundReport]:
        return self._thread.run(self.trainer.step())

    @property
    def model(self) -> torch.nn.Module:
        return self.trainer.model

    @property
    def outer_steps(self) -> int:
        return self.trainer.outer_steps

    @property
    def fingerprint(self) -> str | None:
        return self.trainer.fingerprint

    @property
    def stats(self) -> TrainerStats:
        return self.trainer.stats
