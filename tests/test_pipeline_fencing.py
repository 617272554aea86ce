"""A backward its trainer gave up on counts once: the trainer fences the attempt at the
slow peer before it asks another (pipeline/fencing.py)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from shoal.peer.training.tasks.bytegpt import make_task
from shoal.pipeline.stage import StageWorker

from .pipeline_swarm import TINY, Swarm
from .test_pipeline_accounting import stage_and_requests


def test_a_fenced_attempt_is_never_applied_and_the_fence_tells_what_was() -> None:
    worker, requests = stage_and_requests(3)
    (grad, epoch), = worker.backward_many([requests[0]], [b"first-k0"])  # fmt: skip
    computing, answer = worker.fence("k0", b"first-k0")
    assert not computing and answer is not None
    assert answer[1] == epoch == 0 and torch.equal(answer[0], grad)
    # Fenced before it arrived: the attempt is dropped, whenever it comes.
    assert worker.fence("k1", b"first-k1") == (False, None)
    assert worker.backward_many([requests[1]], [b"first-k1"]) == [None]
    assert worker.samples_for(0) == requests[0][3]
    # Another attempt of the same key (the trainer's retry here) is applied.
    (_, epoch), = worker.backward_many([requests[1]], [b"again-k1"])  # fmt: skip
    assert epoch == 0 and worker.samples_for(0) == requests[0][3] + requests[1][3]
    # In a batch, only the fenced attempt is left out.
    worker.fence("k2", b"first-k2")
    answers = worker.backward_many(requests[2:] + requests[:1], [b"first-k2", b"again-k0"])
    assert answers[0] is None and answers[1] is not None


def test_a_fence_during_the_computation_of_its_key_says_so() -> None:
    worker, requests = stage_and_requests(1)
    computing, release = threading.Event(), threading.Event()
    original = worker._backward

    def slow(*args: Any) -> Any:
        computing.set()
        release.wait(10)
        return original(*args)

    worker._backward = slow  # type: ignore[method-assign]
    thread = threading.Thread(target=worker.backward_many, args=([requests[0]], [b"first-k0"]))
    thread.start()
    assert computing.wait(10)
    # Too late to fence: it is being applied (the fence does not wait for the lock).
    assert worker.fence("k0", b"first-k0") == (True, None)
    release.set()
    thread.join(10)
    computing_now, answer = worker.fence("k0", b"first-k0")
    assert not computing_now and answer is not None and answer[1] == 0


def stall_first_backward(workers: list[StageWorker], when: str) -> tuple[threading.Event, list]:
    """The first backward any of `workers` computes stalls, in its compute thread
    and holding the worker's lock (as behind a state download), until released:
    before it is applied, or after (its answer late)."""
    release, stalled = threading.Event(), []
    for worker in workers:
        original = worker.backward_many

        def stalling(requests: Any, attempts: Any = None, w: Any = worker, f: Any = original):
            first = not stalled
            if first:
                stalled.append(w)
            if first and when == "before applying":
                release.wait(30)
            answers = f(requests, attempts)
            if first and when == "after applying":
                release.wait(30)
            return answers

        worker.backward_many = stalling  # type: ignore[method-assign]
    return release, stalled


@pytest.mark.timeout(60)
@pytest.mark.parametrize("when", ["before applying", "after applying"])
async def test_a_backward_answered_too_late_counts_once(
    make_host: Callable[..., Any], when: str
) -> None:
    """Two peers serve a stage; the one that gets the backward stalls past the trainer's
    deadline. Before applying it: the fence drops it there and the other peer applies
    it. After: the fence gives the trainer its answer and nobody else applies it.
    Either way the microbatch's samples are in exactly one peer's gradients."""
    task = make_task(TINY)
    (module,) = task.make_stages(3, 1)
    swarm = Swarm(make_host)
    try:
        peers = [await swarm.stage_peer(0, module, global_batch=64) for _ in range(2)]
        release, stalled = stall_first_backward([p.worker for p in peers], when)
        trainer = await swarm.trainer(1, codec="none", deadline=1.0)
        assert await trainer.refresh() == [2]  # (each announced before it started)
        batch = next(task.batches(0, 1, 0))
        await trainer.run(0, task.stage_inputs(batch), lambda y: task.stage_loss(y, batch))
        release.set()
        slow = next(p for p in peers if p.worker is stalled[0])
        await slow.server.compute.in_thread(lambda: None)  # (its stalled batch is done)
        samples = {p.worker is stalled[0]: p.worker.samples_for(0) for p in peers}
        assert trainer.counters.samples == len(batch) == sum(samples.values())
        assert trainer.counters.retries == 1 and trainer.counters.unfenced == 0
        if when == "before applying":
            assert trainer.counters.recovered == 0 and samples[True] == 0
        else:
            assert trainer.counters.recovered == 1 and samples[False] == 0
        assert all(p.version == 0 for p in peers)  # (no step took them meanwhile)
    finally:
        await swarm.aclose()
