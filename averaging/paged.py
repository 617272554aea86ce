"""Tensors in a shared mapping of a file, whose pages a reader gives back.

A stage peer within a memory budget keeps its optimizer's moments in such tensors
(`pipeline.memory.StageLimits.moments_on_disk`), and a state download keeps what
it fetched in them until it is copied (`state_sync.downloads_in`). Their pages
are the kernel's page cache, written back and dropped under pressure like any
file's; what the process holds of them is the pages it touched and did not give
back (they count in its resident set, and in a budget's peak). So code that reads
or writes such a tensor whole calls `release` after it (for any other tensor a
lookup and nothing else): the tensor's pages leave the process's page tables
(`MADV_DONTNEED`, which for a shared file mapping keeps their contents) and come
back from the page cache, or the file, at the next touch. `release_range` does
the same for raw memory a writer was handed (a checkpoint's `torch.save`).

Each tensor starts on a page of its own, so releasing one never drops a page that
another being computed with still uses.
"""

from __future__ import annotations

import bisect
import math
import mmap
import os
import tempfile
import threading
import weakref
from collections.abc import Sequence
from pathlib import Path

import torch

__all__ = ["PAGE", "file_tensors", "release", "release_range"]

PAGE = mmap.PAGESIZE

_lock = threading.Lock()
_starts: list[int] = []  # registered tensors' first addresses, sorted
# start address -> (end address, offset of the start in its mapping, the mapping)
_entries: dict[int, tuple[int, int, weakref.ref[mmap.mmap]]] = {}


def file_tensors(
    folder: Path, shapes: Sequence[tuple[Sequence[int], torch.dtype]], *, suffix: str = ".paged"
) -> list[torch.Tensor]:
    """Zeroed tensors of `shapes` in one shared mapping of a new file of `folder`, each
    from a page boundary; the file's blocks reserved up front (a write into a hole of a
    full disk would kill the process) and unlinked at once: its space goes with the last
    tensor. Their pages are given back with `release`."""
    sizes = [math.prod(s) * torch.empty(0, dtype=d).element_size() for s, d in shapes]
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += -(-size // PAGE) * PAGE
    folder.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=folder, suffix=suffix)
    try:
        os.unlink(name)
        os.posix_fallocate(fd, 0, max(total, 1))
        buffer = mmap.mmap(fd, max(total, 1), access=mmap.ACCESS_WRITE)
    finally:
        os.close(fd)
    out = []
    for (shape, dtype), offset, size in zip(shapes, offsets, sizes, strict=True):
        if size == 0:
            out.append(torch.empty(list(shape), dtype=dtype))
            continue
        count = math.prod(shape)
        t = torch.frombuffer(buffer, dtype=dtype, count=count, offset=offset).view(list(shape))
        _register(t.data_ptr(), size, offset, buffer)
        weakref.finalize(t, _unregister, t.data_ptr())
        out.append(t)
    return out


def release(t: torch.Tensor) -> None:
    """Give back the pages of `t`'s file mapping, if it is one of `file_tensors`' (or a
    view into one: the whole tensor's); nothing for any other tensor."""
    if _starts and t.device.type == "cpu":
        _release(t.data_ptr(), None)


def release_range(address: int, length: int) -> None:
    """Give back the whole pages within `length` bytes from `address`, where they are
    of a registered tensor (raw memory a writer was handed, say)."""
    if _starts and length > 0:
        _release(address, length)


def _register(start: int, size: int, offset: int, buffer: mmap.mmap) -> None:
    with _lock:
        bisect.insort(_starts, start)
        _entries[start] = (start + size, offset, weakref.ref(buffer))


def _unregister(start: int) -> None:
    with _lock:
        i = bisect.bisect_left(_starts, start)
        if i < len(_starts) and _starts[i] == start:
            del _starts[i]
        _entries.pop(start, None)


def _release(address: int, length: int | None) -> None:
    with _lock:
        i = bisect.bisect_right(_starts, address) - 1
        if i < 0:
            return
        start = _starts[i]
        end, offset, ref = _entries[start]
    buffer = ref()
    if buffer is None or address >= end:
        return
    # Whole pages only: the tensor's first page is its own, a range's partial ends are
    # left alone (a neighbour in the same page may be in use).
    if length is None:
        first, last = start, end
    else:
        first = start + -(-(address - start) // PAGE) * PAGE
        last = start + (min(address + length, end) - start) // PAGE * PAGE
    if last <= first:
        return
    try:
        buffer.madvise(mmap.MADV_DONTNEED, offset + (first - start), last - first)
    except (ValueError, OSError):  # (closed meanwhile: nothing held any more)
        return
