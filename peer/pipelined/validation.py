"""A pipelined trainer's validation loss, on the data-parallel trainer's schedule.

The task's held-out batches (`Validation`, the same on every peer) go forward
through the stages (`pipeline.evaluation.held_out_loss`) once the pipeline has
taken a step, then never more often than every 30 s nor for more than 5% of
the time (`ValidationSchedule` measures each scoring and spaces the next one
out). The loss lands in the trainer's stats: `/status`'s `val_loss`, the
peer's DHT report (hence `/swarm`) and the page, as a data-parallel peer's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from shoal.pipeline.evaluation import held_out_loss
from shoal.pipeline.trainer import StageFailed
from shoal.pipeline.trainer_loop import TrainerLoop

from ..trainer import TrainerStats
from ..training.task import Task
from ..training.validation import Validation

__all__ = ["PipelineValidation"]

log = logging.getLogger("shoal.pipeline")

POLL_S = 1.0  # how often a waiting validation looks at the schedule and the steps


class PipelineValidation:
    def __init__(
        self,
        task: Task,
        loop: TrainerLoop,
        stats: TrainerStats,
        validation: Validation | None = None,
    ) -> None:
        self.task = task
        self.loop = loop
        self.stats = stats
        self.validation = validation or Validation(task)
        self.seconds: list[float] = []  # how long each scoring took (the last few)
        self.scorings = 0  # scorings that gave a loss
        self.failures = 0  # scorings that gave none (a stage failed, or the task raised)
        self.last_error: str | None = None  # why the last failed one failed

    async def run(self, stop: asyncio.Event) -> None:
        """Score whenever the schedule allows, once the pipeline has stepped, until `stop`."""
        if not self.validation.enabled:
            return
        schedule = self.validation.schedule
        assert schedule is not None
        first = self.loop.version
        while not stop.is_set():
            if self.loop.version > first and schedule.due(time.monotonic()):
                await self.score()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(POLL_S):
                    await stop.wait()

    async def score(self) -> float | None:
        """Score the held-out batches now; sets `stats.val_loss` (None: a stage failed)."""
        schedule = self.validation.schedule
        assert schedule is not None
        started = time.monotonic()
        try:
            batches = await asyncio.to_thread(self.validation.held_out)
            loss = await held_out_loss(
                self.loop.trainer,
                batches,
                inputs_of=self.task.stage_inputs,  # type: ignore[attr-defined]
                loss_of=self.task.stage_loss,  # type: ignore[attr-defined]
                new_id=self.loop.new_id,
            )
        except StageFailed as e:  # the stages are in trouble: next time
            log.info("validation loss: %s", e)
            self._failed(str(e))
            return None
        except Exception as e:  # a task's bug must not stop training; said, retried later
            log.warning("validation loss failed: %r", e)
            self._failed(repr(e))
            return None
        finally:
            ended = time.monotonic()
            schedule.ran(started, ended)
            self.seconds = [*self.seconds[-7:], ended - started]
        self.stats.val_loss, self.stats.val_loss_at = loss, time.time()
        self.scorings += 1
        log.info("validation loss %.4f (%d held-out batches)", loss, len(batches))
        return loss

    def _failed(self, why: str) -> None:
        self.failures += 1
        self.last_error = why[:200]

    def status(self) -> dict[str, Any]:
        """/status's `pipeline.validation`: scorings that gave a loss and that failed
        (and why the last one did), and how long the last few took (seconds)."""
        return {
            "scorings": self.scorings,
            "failures": self.failures,
            "last_error": self.last_error,
            "seconds": [round(s, 3) for s in self.seconds],
        }
