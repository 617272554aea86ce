"""A pipeline's validation loss: held-out batches through the stages, forward only.

A trainer sends each held-out batch forward through stage 0 .. n-1 like a
microbatch (the same requests, keys of the same form, audited alike) and
scores the last stage's outputs itself. No backward follows, so nothing
accumulates on any stage and no sample counts as trained. A stage cannot tell
these forwards from training ones when it answers them (only later, by the
backward that never comes; stage 0 could recognize the task's public held-out
inputs), and a wrong answer to one risks the same audit as any other: the loss
the trainer reports is the model's as the stages serve it, each stage at its
current version (as a microbatch's is).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Any

import torch

from .trainer import PipelineTrainer

__all__ = ["MAX_IN_FLIGHT", "held_out_loss"]

# Held-out batches sent side by side: a scoring then waits for the stages' queues
# about once rather than once per batch and stage. On a busy pipeline one at a time
# took minutes, and the 5% share (`ValidationSchedule`) then put the next scoring
# twenty times as far away.
MAX_IN_FLIGHT = 8


async def held_out_loss(
    trainer: PipelineTrainer,
    batches: Iterable[Any],
    *,
    inputs_of: Callable[[Any], torch.Tensor],
    loss_of: Callable[[torch.Tensor, Any], torch.Tensor],
    new_id: Callable[[], int],
    in_flight: int = MAX_IN_FLIGHT,
) -> float:
    """The mean loss per sample over `batches`, each sent forward through every stage,
    up to `in_flight` batches at once (`new_id`: a microbatch id, from the trainer's own
    sequence). The sum runs in batch order, whatever order the answers came in. Raises
    StageFailed when a stage does not answer (the other batches are then cancelled)."""
    if in_flight < 1:
        raise ValueError("in_flight must be >= 1")
    gate = asyncio.Semaphore(in_flight)

    async def score(batch: Any) -> tuple[float, int]:
        async with gate:
            x = inputs_of(batch)
            n = int(x.shape[0])
            key = f"{new_id()}"
            for stage in range(trainer.stages):
                x, _, _ = await trainer.calls.request(stage, "forward", key, n, [x])
            with torch.no_grad():
                return float(loss_of(x, batch)) * n, n

    tasks = [asyncio.ensure_future(score(batch)) for batch in batches]
    try:
        scored = await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    total, samples = 0.0, 0
    for loss, n in scored:
        total += loss
        samples += n
    if samples == 0:
        raise ValueError("no held-out samples")
    return total / samples
