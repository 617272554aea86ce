"""Give the C heap's free pages back to the operating system (glibc's malloc_trim).

A peer allocates and frees hundreds of MB at a time: a checkpoint copies every
tensor of the model, the optimizers and the strategy (a snapshot a thread writes
while training goes on), a re-sync downloads a whole state, a round its buffers.
glibc's malloc keeps what it gets back inside its heap instead of unmapping it: its
mmap threshold rises with each large block freed, so later blocks of that size come
from the heap, and free memory inside the heap is only returned when it is at the
top. A soak witness (bench/soak.py --profile-memory) so held 450 to 640 MB of free
heap in a 2 GB resident set, drifting up between snapshots, while its Python objects
stayed flat. `malloc_trim(0)` releases every free page of every arena.
"""

from __future__ import annotations

import asyncio
import ctypes
import sys
from collections.abc import Callable

# How often a peer releases: a trim costs milliseconds (the pages it frees fault in
# again when used), a minute's garbage can be hundreds of MB (a checkpoint's
# snapshot, a downloaded state).
TRIM_INTERVAL_S = 60.0


def _find_malloc_trim() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc's; musl (Alpine) has none
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _find_malloc_trim()

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
# Blocks from this size up are mapped on their own and unmapped when freed.
LARGE_BLOCK = 1 << 20


def return_large_blocks_at_once(threshold: int = LARGE_BLOCK) -> bool:
    """Map every block of `threshold` bytes or more on its own, so that freeing it
    gives it back at once (glibc's threshold otherwise rises with each large block
    freed, and later ones stay in the heap: resident, free, until a trim). For a
    process that is a peer (`shoal run`: a verifying 50M peer grew by about a model
    state per round without it) and a peer held to a memory budget (`--max-memory`),
    whose peak must be what it holds, not what it held. Process-wide: not for a
    library user's process. False where malloc has no such setting."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, threshold))


def release_free_memory() -> bool:
    """Return the heap's free pages to the system; False where malloc cannot.

    Blocking (milliseconds, and malloc is locked meanwhile): call it from a worker
    thread, after large blocks were freed."""
    if _MALLOC_TRIM is None:
        return False
    return bool(_MALLOC_TRIM(0))


async def release_free_memory_every(interval: float, stop: asyncio.Event) -> None:
    """Release the heap's free pages every `interval` seconds (in a thread) until
    `stop`: for a peer whose large blocks are freed on several threads and tasks."""
    while not stop.is_set():
        try:
            async with asyncio.timeout(interval):
                await stop.wait()
        except TimeoutError:
            await asyncio.to_thread(release_free_memory)
