"""Which stage step includes each microbatch: a trainer's accounting, exactly once.

Sans-I/O. A backward answer says which peer applied it and the epoch (stage
version) whose step its gradients go into. The trainer keeps the backward's
inputs until it learns, from the step logs stage peers attach to their
answers, that the step from that epoch committed: with that peer among its
members the microbatch counted; without it (the peer died, stalled, or was
behind and dropped its gradients) the backward must be replayed on another
peer. A peer that stepped has given its gradients to the step, so its death
afterwards loses nothing.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass

import torch

__all__ = ["Applied", "MicrobatchLedger"]

# How many versions past its epoch an entry waits for the step's log before it is
# assumed counted (stage peers keep the last 8 steps; memory must stay bounded).
GIVE_UP_VERSIONS = 8


@dataclass
class Applied:
    """A backward some peer applied, kept until its step is known."""

    stage: int
    key: str
    peer: Hashable
    epoch: int
    inputs: torch.Tensor
    grad_outputs: torch.Tensor
    samples: int


class MicrobatchLedger:
    def __init__(self, stages: int) -> None:
        self._open: list[dict[str, Applied]] = [{} for _ in range(stages)]
        self.counted = [0] * stages  # samples known to be in a committed step, per stage
        self.replayed = [0] * stages  # samples sent again because their step went without them
        self.assumed = [0] * stages  # samples whose step was never seen (assumed counted)

    def applied(self, entry: Applied) -> None:
        self._open[entry.stage][entry.key] = entry

    def open(self, stage: int) -> list[Applied]:
        """Backwards of `stage` whose step is not known yet."""
        return list(self._open[stage].values())

    def open_samples(self, stage: int) -> int:
        return sum(e.samples for e in self._open[stage].values())

    def resolve(
        self, stage: int, steps: Iterable[tuple[int, frozenset[Hashable]]], version: int
    ) -> list[Applied]:
        """Given a stage peer's log of committed steps (version stepped from, members)
        and the stage's version: settle what they settle; the entries to replay."""
        log = dict(steps)
        replay = []
        for key, entry in list(self._open[stage].items()):
            members = log.get(entry.epoch)
            if members is not None:
                del self._open[stage][key]
                if entry.peer in members:
                    self.counted[stage] += entry.samples
                else:
                    self.replayed[stage] += entry.samples
                    replay.append(entry)
            elif version - entry.epoch > GIVE_UP_VERSIONS:
                del self._open[stage][key]
                self.assumed[stage] += entry.samples
        return replay
