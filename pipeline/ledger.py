"""Which stage step includes each microbatch: a trainer's accounting, exactly once.

Sans-I/O. A backward answer says which peer applied it and the epoch (stage
version) whose step its gradients go into. The trainer keeps the backward's
inputs until it learns, from the step logs stage peers attach to their
answers, that the step from that epoch committed: with that peer among its
members the microbatch counted; without it (the peer died, stalled, or was
behind and dropped its gradients) the backward must be replayed on another
peer. A peer that stepped has given its gradients to the step, so its death
afterwards loses nothing.

Unless every peer of the stage dies: the stage then goes back to the newest
checkpoint a returning peer holds (`peer.stage_checkpoints`), and its steps
after that are gone with the microbatches they counted. So where the stage's
peers checkpoint, a counted entry is kept until a checkpoint of every such peer
holds its step (`release`); when a peer restores the stage at version `v`
(`lost`), the entries of steps from `v` on, counted or not, are replayed.
What is kept is bounded (KEEP_VERSIONS behind the stage, KEEP_BYTES in all):
beyond it the oldest entries are let go, as without checkpoints.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass

import torch

__all__ = ["Applied", "MicrobatchLedger"]

# How many versions past its epoch an entry waits for the step's log before it is
# assumed counted (stage peers keep the last 8 steps; memory must stay bounded).
GIVE_UP_VERSIONS = 8
KEEP_VERSIONS = 256  # counted entries kept at most this far behind the stage's version
KEEP_BYTES = 256 * 2**20  # and at most this much of their tensors, all stages together


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
        # Counted, in a step no checkpoint is known to hold yet (stages that checkpoint).
        self._kept: list[dict[str, Applied]] = [{} for _ in range(stages)]
        self._kept_bytes = 0
        self.counted = [0] * stages  # samples known to be in a committed step, per stage
        self.replayed = [0] * stages  # samples sent again because their step went without them
        self.assumed = [0] * stages  # samples whose step was never seen (assumed counted)
        self.restored = [0] * stages  # samples replayed because their stage was restored

    def applied(self, entry: Applied) -> None:
        self._open[entry.stage][entry.key] = entry

    def open(self, stage: int) -> list[Applied]:
        """Backwards of `stage` whose step is not known yet."""
        return list(self._open[stage].values())

    def open_samples(self, stage: int) -> int:
        return sum(e.samples for e in self._open[stage].values())

    def resolve(
        self,
        stage: int,
        steps: Iterable[tuple[int, frozenset[Hashable]]],
        version: int,
        durable: int | None = None,
    ) -> list[Applied]:
        """Given a stage peer's log of committed steps (version stepped from, members)
        and the stage's version: settle what they settle; the entries to replay.
        `durable`: the version every checkpointing peer of the stage has saved (None:
        they do not checkpoint): counted entries of later steps are kept."""
        log = dict(steps)
        replay = []
        for key, entry in list(self._open[stage].items()):
            members = log.get(entry.epoch)
            if members is not None:
                del self._open[stage][key]
                if entry.peer in members:
                    self.counted[stage] += entry.samples
                    if durable is not None and entry.epoch >= durable:
                        self._keep(entry)
                else:
                    self.replayed[stage] += entry.samples
                    replay.append(entry)
            elif version - entry.epoch > GIVE_UP_VERSIONS:
                del self._open[stage][key]
                self.assumed[stage] += entry.samples
        return replay

    def _keep(self, entry: Applied) -> None:
        self._let_go(self._kept[entry.stage].get(entry.key, entry))  # (a replay's again)
        self._kept[entry.stage][entry.key] = entry
        self._kept_bytes += _nbytes(entry)
        while self._kept_bytes > KEEP_BYTES:  # the oldest go first
            oldest = min((e for kept in self._kept for e in kept.values()), key=lambda e: e.epoch)
            self._let_go(oldest)

    def _let_go(self, entry: Applied) -> None:
        kept = self._kept[entry.stage].pop(entry.key, None)
        if kept is not None:
            self._kept_bytes -= _nbytes(kept)

    def kept_samples(self, stage: int) -> int:
        return sum(e.samples for e in self._kept[stage].values())

    def release(self, stage: int, durable: int, version: int) -> None:
        """A checkpoint of every checkpointing peer of `stage` holds its steps before
        `durable`: what they counted is safe. (And the bound: KEEP_VERSIONS.)"""
        for entry in list(self._kept[stage].values()):
            if entry.epoch < durable or version - entry.epoch > KEEP_VERSIONS:
                self._let_go(entry)

    def lost(self, stage: int, restored: int) -> list[Applied]:
        """Every peer of `stage` died and one restored it at version `restored`: what
        its steps from there on counted, and what the dead peers held for steps to
        come, is gone. The entries to replay (open ones of earlier epochs wait for
        the restored peer's step log, which its checkpoint kept)."""
        replay = []
        for entry in list(self._kept[stage].values()):
            if entry.epoch >= restored:
                self._let_go(entry)
                self.counted[stage] -= entry.samples
                replay.append(entry)
        for key, entry in list(self._open[stage].items()):
            if entry.epoch >= restored:
                del self._open[stage][key]
                replay.append(entry)
        self.restored[stage] += sum(e.samples for e in replay)
        self.replayed[stage] += sum(e.samples for e in replay)
        return replay


def _nbytes(entry: Applied) -> int:
    return entry.inputs.nbytes + entry.grad_outputs.nbytes
