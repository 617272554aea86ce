"""The committed state an averager serves to downloaders: a frozen copy, or its live tensors.

By default each commit freezes a host copy of the state and its hash, which the
state server hands out while the owner's tensors change (`StateServer(copy=
False)`). A *live* state (`live=True`: the owner changes its tensors only
through commits, loads and writes announced with `before_change`) is served and
checkpointed from the live tensors themselves; only its hash is taken at each
commit. Before its tensors change, a download reading them gets a host copy
(`StateServer.before_change`, one at a time), and readers that cannot take one
(a checkpoint being written: `pinned`) make the change wait. A model's state
then costs its copy only while a download overlaps a change, not for the run.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import torch

from .fingerprint import state_fingerprint
from .state_sync import State, StateServer

__all__ = ["ServedState"]


class ServedState:
    def __init__(self, server: StateServer, *, live: bool) -> None:
        self.server = server
        self.live = live
        self.committed: State | None = None  # None before the first commit
        self._copy = False  # `committed` is a copy `before_change` kept of a live state
        self._pins = 0
        self._unpinned = asyncio.Event()
        self._unpinned.set()

    async def freeze(
        self, tensors: Sequence[torch.Tensor], meta: Mapping[str, Any], work: int
    ) -> State:
        """The state as it is now, served from here on: a copy and its hash, in a
        thread (a whole model's worth of both would stall the event loop); a live
        one's hash only. Nothing may write the tensors meanwhile."""
        tensors, meta, live = tuple(tensors), dict(meta), self.live

        def snapshot() -> State:
            if live:
                return State(tensors, meta, state_fingerprint(tensors, meta), work)
            copies = tuple(t.detach().to("cpu", copy=True) for t in tensors)
            return State(copies, meta, state_fingerprint(copies, meta), work)

        self.committed = await asyncio.to_thread(snapshot)
        self._copy = False
        return self.committed

    async def before_change(self, *, keep_reads: bool = True) -> None:
        """A live state's tensors are about to change: wait for pinned readers, then
        keep a copy for the downloads reading it (`keep_reads`) or drop what is
        served (nothing is served until the next `freeze` but a kept copy)."""
        if not self.live:
            return
        while self._pins:
            await self._unpinned.wait()
        kept = await self.server.before_change(keep=keep_reads)
        self.committed, self._copy = kept, kept is not None

    def before_download(self) -> None:
        """We are about to download a newer state: a copy kept for others' downloads
        makes room for ours (those downloads move on to a newer holder)."""
        if not self.live:
            return
        self.server.drop_copies()
        if self._copy:
            self.committed, self._copy = None, False

    @contextlib.asynccontextmanager
    async def pinned(self) -> AsyncIterator[State | None]:
        """The committed state (None: none yet), unchanged until the block ends: a
        change waits for it meanwhile. For readers that cannot take a copy (writing
        a checkpoint of a live state); keep it short."""
        self._pins += 1
        self._unpinned.clear()
        try:
            yield self.committed
        finally:
            self._pins -= 1
            if not self._pins:
                self._unpinned.set()
