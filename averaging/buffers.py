"""Buffers of all-reduce rounds: kept from one round to the next, lent out per round."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

import torch

__all__ = ["BufferPool", "RoundBuffers", "bytes_of"]

T = TypeVar("T")


def bytes_of(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    return memoryview(t.numpy()).cast("B")


class BufferPool:
    """Large buffers kept from one round to the next.

    Fresh memory costs a page fault per 4 KiB page (the kernel zeroes each one):
    for the result vector of a large round that is as much CPU as the reduction
    itself. The buffers of the last finished round are kept for the next one
    (about one more copy of the averaged tensors, for the life of the service).
    """

    def __init__(self) -> None:
        self._free: dict[tuple[torch.dtype, int], list[torch.Tensor]] = {}

    def take(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        free = self._free.get((dtype, n))
        return free.pop() if free else torch.empty(n, dtype=dtype)

    def keep(self, buffers: list[torch.Tensor]) -> None:
        free: dict[tuple[torch.dtype, int], list[torch.Tensor]] = {}
        for t in buffers:
            free.setdefault((t.dtype, t.numel()), []).append(t)
        self._free = free


class RoundBuffers:
    """What one round borrowed from the pool; handed back when the round ends,
    unless a thread still works on them (a thread cannot be interrupted)."""

    def __init__(self, pool: BufferPool) -> None:
        self._pool = pool
        self._taken: list[torch.Tensor] = []
        self._threads = 0

    def take(self, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        t = self._pool.take(n, dtype)
        self._taken.append(t)
        return t

    def take_bytes(self, n: int) -> memoryview:
        return memoryview(self.take(n, torch.uint8).numpy())

    def split_bytes(self, sizes: list[int]) -> list[memoryview]:
        """One buffer cut into consecutive views of these sizes."""
        buf = self.take_bytes(sum(sizes))
        views = []
        offset = 0
        for size in sizes:
            views.append(buf[offset : offset + size])
            offset += size
        return views

    async def in_thread(self, fn: Callable[..., T], *args: Any) -> T:
        """Run fn(*args) in a thread; the buffers stay borrowed while it runs."""
        self._threads += 1
        try:
            return await asyncio.to_thread(fn, *args)
        finally:
            self._threads -= 1

    def give_back(self) -> None:
        """(The round ended.) The buffers go back to the pool, unless a thread still
        works on them: then they are freed once it is done (its own references), not
        when the collector's next full pass frees the round (its objects refer to each
        other): until then the next round would take fresh ones beside them."""
        if self._threads == 0:
            self._pool.keep(self._taken)
        self._taken = []
