"""A stage peer telling trainers of its steps at once.

A trainer waiting for a stage's step (it paces itself by the steps) would
otherwise learn of it from the stage's DHT record, one poll later. A stage
server remembers the trainers that sent it requests lately and, after each
step, sends each its new version and step log (the `stepped` call of
`trainer_protocol`); a trainer takes it from a peer the stage records list
(`PipelineTrainer._stepped`). Best effort: the DHT record stays the fallback.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from shoal.transport import rpc
from shoal.transport.host import Host
from shoal.transport.identity import PeerID
from shoal.transport.tasks import TaskSet

__all__ = ["TRAINER_SEEN_S", "StepPush", "trainer_protocol"]

log = logging.getLogger("shoal.pipeline")

TRAINER_SEEN_S = 30.0  # a trainer silent this long is not told of our steps any more
PUSH_TIMEOUT_S = 2.0


def trainer_protocol(experiment: str) -> str:
    """Where trainers hear of stage steps."""
    return f"/shoal/pipeline-trainer/{experiment}/1.0.0"


class StepPush:
    """The trainers a stage server heard from lately, and the pushes to them."""

    def __init__(self, host: Host, experiment: str) -> None:
        self.host = host
        self.protocol = trainer_protocol(experiment)
        self.trainers: dict[PeerID, float] = {}  # -> when it last sent us a request
        self._tasks = TaskSet(log, "step push")

    def heard_from(self, peer: PeerID) -> None:
        self.trainers[peer] = time.monotonic()

    def push(self, message_for: Callable[[PeerID], dict[str, Any]]) -> None:
        """Send each trainer heard from within TRAINER_SEEN_S its `message_for(trainer)`
        (a step log lists the keys of that trainer's backwards only)."""
        now = time.monotonic()
        for peer, seen in list(self.trainers.items()):
            if now - seen > TRAINER_SEEN_S:
                del self.trainers[peer]
        for peer in self.trainers:
            if peer != self.host.peer_id:  # (our own trainer calls us directly)
                self._tasks.spawn(self._send(peer, message_for(peer)))

    async def _send(self, peer: PeerID, message: dict[str, Any]) -> None:
        with contextlib.suppress(Exception):  # the DHT record is the fallback
            await rpc.call(self.host, peer, self.protocol, "stepped", message,
                           timeout=PUSH_TIMEOUT_S)  # fmt: skip

    def close(self) -> None:
        self._tasks.cancel()
