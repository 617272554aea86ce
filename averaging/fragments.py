"""Streaming DiLoCo's fragments: one averaged part of the parameters each, and its round.

A `Fragment` holds its share of the local parameters, its global copy, outer momentum
and pseudo-gradient buffers, its own `Averager`, and the round in flight: started in
the background at the fragment's offset (`begin`), merged or cancelled by
`diloco.StreamingDiLoCo`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import torch

from .averager import Averager, StepResult
from .host_state import delta_into, numel, off_loop

__all__ = ["Fragment", "FragmentOutcome", "RoundTask", "committed"]


@dataclass(frozen=True, slots=True)
class FragmentOutcome:
    result: StepResult  # the catch-up round's when a re-sync was followed by a commit
    resynced: bool
    bytes_sent: int
    seconds: float


RoundTask = asyncio.Task[FragmentOutcome]


@dataclass(eq=False)
class Fragment:
    index: int
    offset: int  # synchronized at inner steps s > 0 with s % H == offset
    params: list[torch.Tensor]
    globals: list[torch.Tensor]
    momentum: list[torch.Tensor]
    deltas: list[torch.Tensor]
    averager: Averager | None = None
    samples: int = 0  # behind the local fragment since its last sync began
    task: RoundTask | None = None  # the round in flight
    weight: int = 0  # the samples the round in flight carries
    started_at: int = 0  # inner steps taken when the round began
    finished_at: int | None = None  # ... and when it ended
    loaded: bool = field(default=False)

    @property
    def avg(self) -> Averager:
        """The fragment's averager (set right after the fragment is made)."""
        assert self.averager is not None
        return self.averager

    async def begin(
        self,
        inner_steps: Callable[[], int],
        run: Callable[[int], Coroutine[Any, Any, FragmentOutcome]],
        name: str,
    ) -> None:
        """Start the fragment's round in the background (`run(weight)`), on the
        pseudo-gradient of its local parameters and the samples behind them."""
        await off_loop(
            lambda: delta_into(self.deltas, self.globals, self.params), numel(self.params)
        )
        self.weight, self.samples = self.samples, 0
        self.started_at, self.finished_at = inner_steps(), None
        task = asyncio.get_running_loop().create_task(run(self.weight), name=name)

        def ended(_: object) -> None:
            self.finished_at = inner_steps()

        task.add_done_callback(ended)
        self.task = task

    async def cancel(self) -> None:
        """Cancel the round in flight, if any: its samples are not synchronized yet."""
        task, self.task = self.task, None
        if task is None:
            return
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        self.samples += self.weight


def committed(task: RoundTask) -> bool:
    """The round of `task` ended with a commit."""
    if not task.done() or task.cancelled() or task.exception() is not None:
        return False
    return task.result().result.committed
