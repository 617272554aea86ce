"""The validation loss a peer reports: the task's held-out batches, scored after a round.

The validation loss of docs/guide/inspecting.md (bench/convergence.py) is the mean loss over the
task's `eval_batches`, the same batches on every peer, so peers' values
compare. The daemon computes the same number on the model a round left: after
a committed DiLoCo round the peer's parameters are the swarm's global ones;
for NoLoCo (and Streaming DiLoCo, whose fragments merge into the parameters
trained meanwhile) they are the peer's own. A pipelined experiment never
holds the whole model on one peer: its trainers score the batches forward
through the stages (peer/pipelined/validation.py).

Evaluating costs forward passes on the training thread, so it is bounded:
`batches` batches (8 by default) and, by `ValidationSchedule`, never more
often than `min_interval_s` and never more than `max_share` of the time
(a slow evaluation of a big model spaces the next one out).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shoal.averaging.outer import RoundOutcome, RoundReport

from .task import Task

__all__ = [
    "DEFAULT_VALIDATION_BATCHES",
    "DEFAULT_VALIDATION_INTERVAL_S",
    "DEFAULT_VALIDATION_SHARE",
    "Validation",
    "ValidationSchedule",
    "changes_the_model",
]

DEFAULT_VALIDATION_BATCHES = 8
# A round every few seconds (small models, LAN) would otherwise be evaluated each time.
DEFAULT_VALIDATION_INTERVAL_S = 30.0
# At most this share of the training thread's time goes to evaluation.
DEFAULT_VALIDATION_SHARE = 0.05

# The outcomes after which the model is another one than before the round.
_MODEL_CHANGED = (RoundOutcome.COMMITTED, RoundOutcome.RESYNCED)


def changes_the_model(reports: list[RoundReport]) -> bool:
    """Whether any of these rounds left the peer with a new model (committed or re-synced)."""
    return any(r.outcome in _MODEL_CHANGED for r in reports)


class ValidationSchedule:
    """When the next evaluation may run (sans-I/O: the caller passes monotonic times).

    The first is due at once; after one that took `d` seconds, the next waits
    `max(min_interval_s, d / max_share - d)` from its end.
    """

    def __init__(
        self,
        min_interval_s: float = DEFAULT_VALIDATION_INTERVAL_S,
        max_share: float = DEFAULT_VALIDATION_SHARE,
    ) -> None:
        if min_interval_s < 0 or not 0 < max_share <= 1:
            raise ValueError("min_interval_s must be >= 0 and max_share in (0, 1]")
        self.min_interval_s = min_interval_s
        self.max_share = max_share
        self._next: float | None = None  # None: due at the first chance

    def due(self, now: float) -> bool:
        return self._next is None or now >= self._next

    def ran(self, started: float, ended: float) -> None:
        """An evaluation ran from `started` to `ended` (failed ones count: they cost too)."""
        took = max(0.0, ended - started)
        self._next = ended + max(self.min_interval_s, took / self.max_share - took)


@dataclass
class Validation:
    """What a trainer needs to score its model: the task's held-out batches (read once,
    on first use, in the caller's thread) and the schedule."""

    task: Task
    batches: int = DEFAULT_VALIDATION_BATCHES
    schedule: ValidationSchedule | None = None

    def __post_init__(self) -> None:
        if self.batches < 0:
            raise ValueError(f"validation batches must be >= 0, got {self.batches}")
        self.schedule = self.schedule or ValidationSchedule()
        self._held_out: list[Any] | None = None

    @property
    def enabled(self) -> bool:
        return self.batches > 0

    def held_out(self) -> list[Any]:
        """The task's `eval_batches(batches)`, the same every call (blocking: not on the loop)."""
        if self._held_out is None:
            self._held_out = list(self.task.eval_batches(self.batches))
        return self._held_out
