"""Freed tensors go back to the system (peer/training/heap.py), not only to malloc's heap.

Run in a fresh process: what the heap holds depends on everything allocated before.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import pytest

from shoal.peer.training import heap

from .waiting import eventually

FRAGMENTED_HEAP = """
import json, torch
from shoal.peer.training.heap import release_free_memory

def rss_mb():
    with open("/proc/self/status") as status:
        return next(int(l.split()[1]) for l in status if l.startswith("VmRSS:")) / 1024

# A snapshot of small tensors (8 KiB: below any mmap threshold, so from the heap),
# every 20th kept alive, as the state a peer keeps holds the heap's top in place.
tensors = [torch.ones(2048) for _ in range(40_000)]
kept = tensors[::20]
before_free = rss_mb()
del tensors
freed = rss_mb()
trimmed = release_free_memory()
after = rss_mb()
print(json.dumps({"before_free": before_free, "freed": freed, "after": after,
                  "trimmed": trimmed, "kept": len(kept)}))
"""


@pytest.mark.timeout(60)
def test_freed_tensors_stay_in_the_heap_until_released_then_the_rss_drops() -> None:
    out = subprocess.run(
        [sys.executable, "-c", FRAGMENTED_HEAP], capture_output=True, text=True, timeout=50,
        check=True,
    )  # fmt: skip
    mb = json.loads(out.stdout)
    snapshot_mb = 40_000 * 8 / 1024 * 19 / 20  # what was freed: ~297 MB
    assert mb["trimmed"] is True
    assert mb["before_free"] - mb["freed"] < snapshot_mb / 4, f"free() alone gave back: {mb}"
    assert mb["freed"] - mb["after"] > snapshot_mb / 2, f"the trim gave back too little: {mb}"


@pytest.mark.timeout(10)
async def test_a_pipeline_peer_releases_every_interval_until_stopped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The pipeline daemon's schedule (its commits, audits and re-syncs free blocks on
    several tasks): one release per interval, none after `stop`, and `stop` ends it
    without waiting out the interval."""
    stop = asyncio.Event()
    released: list[float] = []

    def release() -> bool:
        released.append(time.monotonic())
        return True

    monkeypatch.setattr(heap, "release_free_memory", release)
    started = time.monotonic()
    schedule = asyncio.ensure_future(heap.release_free_memory_every(0.05, stop))
    await eventually(lambda: len(released) >= 3, "three releases", timeout=5.0)
    stop.set()
    await asyncio.wait_for(schedule, 1.0)
    count = len(released)  # (the schedule ended: none can follow)
    # One per interval (a timer may fire within the clock's resolution of its time).
    assert all(b - a >= 0.04 for a, b in zip([started, *released], released, strict=False))

    stop = asyncio.Event()
    stop.set()
    ended = time.monotonic()
    await heap.release_free_memory_every(3600.0, stop)
    assert time.monotonic() - ended < 1.0 and len(released) == count
