"""Our part of an all-reduce round, reduced: each lane's chunks summed as contributions arrive.

`DataPlane` (lanes.py) receives the other members' contributions into an `OwnLane`'s
slots; `LaneSums.reduce` sums each chunk once its inputs are there, in the order
`reducer.LaneReducer` says, into the round's result (or, with a codec, into its
encoded bytes), in a thread when a chunk is large.
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch

from .buffers import RoundBuffers
from .compression import Codec
from .reducer import ChunkJob, LaneReducer, Reduction, float64_scratch, reduce_chunk

__all__ = ["ChunkCounter", "LaneSums", "OwnLane"]

# Element-ops of one chunk's reduction above which it runs in a thread: a default
# chunk (1M elements) from 4 members is 4M element-ops, 2-5 ms of CPU, which on
# the loop stalled everything else (seen up to 50 ms on a loaded machine).
_THREAD_WORK = 1 << 20


class ChunkCounter:
    """A monotonic counter tasks can wait on (chunks received, chunks reduced)."""

    __slots__ = ("_waiters", "value")

    def __init__(self) -> None:
        self.value = 0
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []

    def advance(self, value: int) -> None:
        self.value = value
        if self._waiters:
            keep = []
            for target, fut in self._waiters:
                if target <= value:
                    if not fut.done():
                        fut.set_result(None)
                else:
                    keep.append((target, fut))
            self._waiters = keep

    async def wait(self, target: int) -> None:
        if self.value >= target:
            return
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append((target, fut))
        await fut


class OwnLane:
    """Owner side of one lane of our part: the reducer, its receive slots, its signals."""

    def __init__(self, reducer: LaneReducer) -> None:
        self.reducer = reducer
        self.slots: dict[int, list[Any]] = {}
        self.changed = asyncio.Event()  # a sender attached or a contribution arrived
        self.reduced = ChunkCounter()  # mirrors reducer.reduced, for tasks to wait on
        self.encoded: list[memoryview] = []  # with a codec: the result's bytes, per chunk


class LaneSums:
    """Sums the lanes of our part into the round's result (`flat`: our own input)."""

    def __init__(
        self,
        me: int,
        chunk_elements: int,
        codec: Codec,
        reduction: Reduction,
        buffers: RoundBuffers,
        encoded: list[tuple[int, int, memoryview]],
    ) -> None:
        self.me = me
        self.chunk_elements = chunk_elements
        self.codec = codec
        self.raw = codec.name == "none"
        self.reduction = reduction
        self.buffers = buffers
        self.flat = torch.empty(0)  # set when the round runs
        self.result = torch.empty(0)
        # With a codec: (start, end, bytes) of the encoded average (the data plane's list).
        self.encoded = encoded

    async def reduce(self, lane: OwnLane) -> None:
        """Reduce every chunk of `lane` as its inputs arrive (Veto: a codec error)."""
        reducer = lane.reducer
        chunk_elements = self.chunk_elements
        acc = scratch = None
        if self.raw:
            acc = self.buffers.take(float64_scratch(chunk_elements), torch.float64)
        else:
            sizes = [self.codec.encoded_size(b - a) for a, b in reducer.chunks]
            lane.encoded = self.buffers.split_bytes(sizes)
            scratch = self.buffers.take(chunk_elements)  # the sum, before encoding
        while not reducer.complete:
            lane.changed.clear()
            job = reducer.next_job()
            if job is None:
                await lane.changed.wait()
                continue
            await self._run_job(lane, job, acc, scratch)
            reducer.finished(job.index)
            lane.reduced.advance(reducer.reduced)
            await asyncio.sleep(0)  # let the streams move between chunks

    async def _run_job(
        self, lane: OwnLane, job: ChunkJob, acc: torch.Tensor | None, scratch: torch.Tensor | None
    ) -> None:
        a, b = job.span
        inputs = [(self._input(lane, i, job.index, a, b), w) for i, w in job.order]
        out = self.result[a:b] if scratch is None else scratch[: b - a]
        encoded = None if scratch is None else lane.encoded[job.index]
        args = (self.reduction, self.codec, inputs, out, acc, encoded)
        if len(inputs) * (b - a) >= _THREAD_WORK:
            await self.buffers.in_thread(reduce_chunk, *args)
        else:
            reduce_chunk(*args)
        if encoded is not None:
            self.encoded.append((a, b, encoded))

    def _input(self, lane: OwnLane, i: int, c: int, a: int, b: int) -> torch.Tensor | memoryview:
        """Member i's contribution to chunk c of a lane: our own input, or its slot."""
        if i == self.me:
            return self.flat[a:b]
        slot = lane.slots[i][lane.reducer.slot(c)]
        return slot[: b - a] if self.raw else slot[: self.codec.encoded_size(b - a)]
