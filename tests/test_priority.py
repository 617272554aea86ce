"""Training threads run below the event loop's CPU priority (peer/training/priority.py)."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator

import pytest
import torch

from shoal.peer.training.inner import BatchPrefetcher
from shoal.peer.training.priority import TRAINING_NICE, lower_this_thread

pytestmark = [
    pytest.mark.timeout(30),
    pytest.mark.skipif(
        not sys.platform.startswith("linux"), reason="per-thread nice values are Linux's"
    ),
]


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_lowering_a_thread_leaves_the_loops_thread_alone() -> None:
    before = _nice()
    seen: dict[str, int] = {}

    def worker() -> None:
        lower_this_thread()
        seen["nice"] = _nice()

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen["nice"] == min(19, before + TRAINING_NICE)
    assert _nice() == before


def test_lowering_stops_at_the_lowest_priority_without_error() -> None:
    seen: list[bool] = []

    def worker() -> None:
        for _ in range(3):
            seen.append(lower_this_thread(nice=19))
        seen.append(_nice() == 19)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    first, *again, at_19 = seen
    assert at_19
    assert again == [False, False]  # already at 19: nothing to change
    assert first == (_nice() < 19)


def test_the_batch_prefetcher_draws_batches_below_the_loops_priority() -> None:
    def nice_of_the_drawing_thread() -> Iterator[int]:
        while True:
            yield _nice()

    prefetcher = BatchPrefetcher(nice_of_the_drawing_thread(), torch.device("cpu"))
    try:
        drawn = next(prefetcher)
    finally:
        prefetcher.close()
    assert drawn == min(19, _nice() + TRAINING_NICE)


def test_a_daemons_helper_threads_run_between_the_loop_and_training() -> None:
    """`shoal run`'s default executor (a round's reductions and hashes, state reads and
    writes) runs below the loop's priority and above training's."""
    from shoal.peer.training.priority import HELPER_NICE, helper_executor

    assert 0 < HELPER_NICE < TRAINING_NICE
    before = _nice()
    with helper_executor() as pool:
        assert pool.submit(_nice).result(timeout=10) == min(19, before + HELPER_NICE)
    assert _nice() == before
