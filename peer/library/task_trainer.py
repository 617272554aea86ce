"""The experiment's own training, a step at a time, in the user's loop.

`Peer.task_trainer()` opens the daemon's session on the experiment the peer found
(`session.open_session`: checkpoints, the verifier of a verified experiment) and
hands out its `Trainer`: each `step` is `shoal run`'s (the task's batches, drawn
for a verified round from the experiment, the peer and the round; the task's loss;
the manifest's inner optimizer), so a referee can re-execute it. It is how a
library peer trains in a verified experiment; `Peer.outer` is for the user's own
batches, which nobody can re-execute.
"""

from __future__ import annotations

import torch

from shoal.averaging.outer import RoundReport

from ..config import Config
from ..daemon import choose_device_of
from ..experiment import Manifest
from ..node import PeerNode
from ..session import Session, open_session
from ..trainer import Trainer
from ..training.outer_loop import TrainerStats
from ..training.task import Task

__all__ = ["TaskTrainer", "open_task_trainer"]


class TaskTrainer:
    """`shoal run`'s training loop, one `step` per call (after `open_task_trainer`)."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self._trainer: Trainer = session.trainer

    async def step(self) -> list[RoundReport]:
        """One inner step on the task's next batch, then the outer part (a round every H
        steps, validation, a checkpoint when due); the reports of the rounds that ended."""
        return await self._trainer.step()

    @property
    def model(self) -> torch.nn.Module:
        return self._trainer.model

    @property
    def verified(self) -> bool:
        """Whether the steps are logged for audits (the experiment verifies work)."""
        return self.session.verifier is not None

    @property
    def outer_steps(self) -> int:
        return self.session.strategy.outer_steps

    @property
    def fingerprint(self) -> str | None:
        return self.session.strategy.committed_fingerprint

    @property
    def stats(self) -> TrainerStats:
        return self._trainer.stats

    async def finish(self) -> None:
        """The round in flight ends (commit or abort), then a checkpoint is written."""
        await self._trainer.end(checkpoint=True)


async def open_task_trainer(
    node: PeerNode,
    config: Config,
    experiment: tuple[Manifest, Task, torch.nn.Module | None, bool],
) -> TaskTrainer:
    """The session of `experiment` (found by `find_experiment`, not pipelined), on the
    device `config` names; SessionError or ConfigError (one line) when it cannot train."""
    device, inventory = choose_device_of(config)
    session = await open_session(
        config, node.identity, node.dht, device=device, inventory=inventory, experiment=experiment
    )
    return TaskTrainer(session)
