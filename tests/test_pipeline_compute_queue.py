"""The stage server's compute queue: backwards held while a lean peer's step averages."""

from __future__ import annotations

import asyncio

import pytest
import torch

from shoal.pipeline.compute_queue import ComputeQueue, Job, use_device_in_thread
from shoal.pipeline.stage import StageWorker


def _backward(key: str, samples: int) -> Job:
    x, g = torch.randn(samples, 4), torch.randn(samples, 4)
    return Job("backward", (key, x, g, samples), samples)


@pytest.mark.timeout(30)
async def test_held_backwards_wait_while_forwards_go_on_and_all_run_once_released() -> None:
    """While backwards are held (a peer within a memory budget, while its step
    averages) no gradient accumulates anywhere, so no bucket of the next step's
    exists beside the step's; the forwards behind them are answered; released, the
    backwards run in the order they came, each counted once."""
    torch.manual_seed(0)
    worker = StageWorker(torch.nn.Linear(4, 4))
    queue = ComputeQueue(worker, 0, lambda job, version, answer: None)
    runner = asyncio.create_task(queue.run())
    try:
        queue.hold_backwards(True)
        backwards = [asyncio.create_task(queue.submit(_backward(k, 2))) for k in ("a", "b")]
        forward, _ = await queue.submit(Job("forward", torch.randn(3, 4), 3))
        assert forward.shape == (3, 4)
        assert not any(b.done() for b in backwards) and queue.queued == 2
        assert worker._buckets == {}  # (no bucket: nothing accumulated)
        queue.hold_backwards(False)
        answers = await asyncio.gather(*backwards)
        assert [grad.shape for (grad, _epoch), _seconds in answers] == [(2, 4), (2, 4)]
        taken = worker.take_gradients()
        assert taken.samples == 4 and taken.keys == {"a", "b"}
    finally:
        runner.cancel()
        queue.close()


@pytest.mark.timeout(30)
def test_the_compute_thread_takes_the_stage_device_and_a_device_it_cannot_take_breaks_nothing(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The stage's compute thread makes a CUDA stage's device its own before the first
    computation (a backward in a fresh thread otherwise finds no CUDA context there),
    and a device it cannot make current is logged, never raised: a raising
    initializer would break the pool, and every computation of the stage with it."""
    taken: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "set_device", taken.append)
    use_device_in_thread(torch.device("cpu"))
    use_device_in_thread(torch.device("cuda", 1))
    assert taken == [torch.device("cuda", 1)]

    def no_such_device(device: torch.device) -> None:
        raise RuntimeError("CUDA error: invalid device ordinal")

    monkeypatch.setattr(torch.cuda, "set_device", no_such_device)
    worker = StageWorker(torch.nn.Linear(4, 4))
    worker.device = torch.device("cuda", 7)  # (computes on the CPU all the same below)
    queue = ComputeQueue(worker, 0, lambda job, version, answer: None)
    try:
        assert asyncio.run(queue.in_thread(lambda: 6 * 7)) == 42
    finally:
        queue.close()
    assert "could not make cuda:7 this stage thread's device" in caplog.text
