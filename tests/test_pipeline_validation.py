"""A pipeline's validation loss: held-out batches forward through the stages, training nothing."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from shoal.peer.pipelined.validation import PipelineValidation
from shoal.peer.trainer import TrainerStats
from shoal.peer.training.tasks.bytegpt import make_task
from shoal.peer.training.validation import Validation
from shoal.pipeline.evaluation import held_out_loss
from shoal.pipeline.trainer import StageFailed

from .pipeline_swarm import TINY, Swarm, loop_for
from .waiting import eventually

GLOBAL_BATCH = 8


async def _swarm(make_host: Callable[..., Any], task: Any) -> tuple[Swarm, Any]:
    swarm = Swarm(make_host)
    for k, module in enumerate(task.make_stages(5, 3)):
        await swarm.stage_peer(k, module, global_batch=GLOBAL_BATCH)
    trainer = await swarm.trainer(3, codec="none")
    return swarm, loop_for(trainer, task, shard=0, global_batch=GLOBAL_BATCH, lag=0)


def _local_loss(task: Any, swarm: Swarm, batches: list[Any]) -> float:
    """The held-out loss of the stages' parameters as they are now, in one process."""
    total, samples = 0.0, 0
    with torch.no_grad():
        for batch in batches:
            y = task.stage_inputs(batch)
            for k in range(3):
                y = swarm.of_stage(k)[0].worker.module(y)
            total += float(task.stage_loss(y, batch)) * len(batch)
            samples += len(batch)
    return total / samples


class _LossRaises:
    """A task whose loss function fails (a bug of the task's)."""

    def __init__(self, task: Any) -> None:
        self.task = task

    def __getattr__(self, name: str) -> Any:
        return getattr(self.task, name)

    def stage_loss(self, outputs: torch.Tensor, batch: Any) -> torch.Tensor:
        raise RuntimeError("no loss today")


@pytest.mark.timeout(60)
async def test_the_held_out_loss_goes_forward_through_the_stages_trains_nothing_and_is_reported(
    make_host: Callable[..., Any],
) -> None:
    task = make_task(TINY)
    swarm, loop = await _swarm(make_host, task)
    try:
        await loop.run(steps=1)
        await loop.trainer.settled()
        stats = TrainerStats()
        validation = PipelineValidation(task, loop, stats, Validation(task, batches=3))
        held = [(p.version, p.held_samples, p.optimizer.fingerprint()) for p in swarm.peers]
        samples, microbatches = loop.trainer.counters.samples, loop.trainer.counters.microbatches
        forwards = loop.trainer.counters.requests["forward"]

        loss = await validation.score()

        assert loss is not None and stats.val_loss == loss and stats.val_loss_at is not None
        assert loss == pytest.approx(_local_loss(task, swarm, task.eval_batches(3)), rel=1e-5)
        assert loop.trainer.counters.requests["forward"] == forwards + 3 * 3
        # Nothing accumulated, nothing counted as trained, no stage stepped.
        assert [(p.version, p.held_samples, p.optimizer.fingerprint()) for p in swarm.peers] == held
        assert loop.trainer.counters.samples == samples
        assert loop.trainer.counters.microbatches == microbatches
        # The next scoring waits at least 30 s (and 20x what this one took).
        schedule = validation.validation.schedule
        assert schedule is not None and not schedule.due(time.monotonic() + 29.0)
        report = validation.status()
        assert report["scorings"] == 1 and report["failures"] == 0
        assert report["last_error"] is None and len(report["seconds"]) == 1

        # A task whose loss raises: no loss, training goes on, /status says why.
        broken = PipelineValidation(_LossRaises(task), loop, stats, Validation(task, batches=1))
        assert await broken.score() is None and stats.val_loss == loss
        report = broken.status()
        assert report["scorings"] == 0 and report["failures"] == 1
        assert "no loss today" in report["last_error"]
    finally:
        loop.trainer.close()
        await swarm.aclose()


@pytest.mark.timeout(60)
async def test_a_trainer_scores_once_the_pipeline_stepped_and_then_not_within_30_s(
    make_host: Callable[..., Any],
) -> None:
    task = make_task(TINY)
    swarm, loop = await _swarm(make_host, task)
    stop = asyncio.Event()
    stats = TrainerStats()
    validation = PipelineValidation(task, loop, stats, Validation(task, batches=2))
    stepped: list[float] = []
    for peer in swarm.peers:
        peer.on_step = lambda _result: stepped.append(time.time())
    running = asyncio.ensure_future(validation.run(stop))
    try:
        await loop.run(steps=2)
        await eventually(lambda: stats.val_loss is not None, "a validation loss", 20)
        assert stats.val_loss_at is not None and stats.val_loss_at > min(stepped)
        assert 0 < stats.val_loss < 10 and len(validation.seconds) == 1
    finally:
        stop.set()
        await running
        loop.trainer.close()
        await swarm.aclose()


class _QueuedStages:
    """Stages whose every answer waits until `together` requests are in flight at once
    (a busy queue): held-out batches sent one at a time would never be answered. Each
    stage adds its index to the input, so the loss of a batch is known."""

    def __init__(self, stages: int, together: int, fail_stage: int | None = None) -> None:
        self.stages = stages
        self.calls = self
        self.together = together
        self.fail_stage = fail_stage
        self.in_flight = 0
        self.most = 0
        self.answered = 0
        self.cancelled = 0
        self._enough = asyncio.Event()

    async def request(
        self, stage: int, method: str, key: str, samples: int, tensors: list[torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, Any], str]:
        assert method == "forward"
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        if self.in_flight >= self.together:
            self._enough.set()
        try:
            await self._enough.wait()
            if stage == self.fail_stage and key == "0":
                raise StageFailed(f"stage {stage} did not answer")
            if self.fail_stage is not None:
                await asyncio.Event().wait()  # (the others hang: they must be cancelled)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.in_flight -= 1
        self.answered += 1
        return tensors[0] + stage, {}, "peer"


def _mean_of_first(x: torch.Tensor, _batch: Any) -> torch.Tensor:
    return x[:, 0].mean()


@pytest.mark.timeout(10)
async def test_held_out_batches_go_through_the_stages_side_by_side_and_sum_in_batch_order() -> None:
    stages = _QueuedStages(3, together=4)
    batches = [torch.full((2, 3), float(i)) for i in range(6)]
    ids = iter(range(100))

    loss = await held_out_loss(
        stages, batches, inputs_of=lambda b: b, loss_of=_mean_of_first,  # type: ignore[arg-type]
        new_id=lambda: next(ids), in_flight=4,
    )  # fmt: skip

    # Each batch i ends at i + 0 + 1 + 2: the mean over batches of i + 3.
    assert loss == pytest.approx(sum(i + 3 for i in range(6)) / 6)
    assert stages.most == 4 and stages.answered == 6 * 3


@pytest.mark.timeout(10)
async def test_a_stage_that_fails_one_held_out_batch_fails_the_scoring_and_cancels_the_rest() -> (
    None
):
    stages = _QueuedStages(2, together=3, fail_stage=0)
    ids = iter(range(100))

    with pytest.raises(StageFailed):
        await held_out_loss(
            stages, [torch.zeros(1, 2)] * 3, inputs_of=lambda b: b,  # type: ignore[arg-type]
            loss_of=_mean_of_first, new_id=lambda: next(ids),
        )  # fmt: skip

    assert stages.in_flight == 0 and stages.cancelled == 2
