"""Convictions of stage peers in the DHT, and what every peer does with them.

A conviction (`StageEvidence`) is published under ``<experiment>/stage-convictions``
in a subkey named after the convicted peer and owned by the publisher (nobody
overwrites another's copy). Trainers read them at every refresh of the stage
records and stage peers at every record refresh: each bundle is checked offline
(`StageEvidence.check`) and the convicted peer is blocked on the host
(`Host.block`: no connection with it either way, so no request goes to it, the
requests in flight through it fail and are retried on other peers, and the
stage's matchmaking leaves it out of the all-reduce, which discards its open
round's gradients) and, for a trainer, removed from routing for good.
"""

from __future__ import annotations

from collections.abc import Callable

from shoal.dht.node import DHTNode
from shoal.transport.identity import PeerID
from shoal.verification.bans import BanList, enforce, fetch, publish
from shoal.verification.stage_audit import StageEvidence

__all__ = ["StageBans", "stage_convictions_key"]


def stage_convictions_key(experiment: str) -> str:
    return f"{experiment}/stage-convictions"


class StageBans:
    """The stage peers convicted in `experiment`, as this peer knows them."""

    def __init__(self, dht: DHTNode, experiment: str) -> None:
        self.dht = dht
        self.experiment = experiment
        self.bans = BanList(experiment)
        self.on_ban: Callable[[PeerID], None] | None = None
        self.published = 0

    def __contains__(self, peer: object) -> bool:
        return peer in self.bans

    def __len__(self) -> int:
        return len(self.bans)

    def enforce(self, evidence: StageEvidence) -> PeerID | None:
        """Ban the peer `evidence` convicts once it checks (None when it does not)."""
        why = f"convicted by a stage audit at version {evidence.commitment.version}"
        peer, new = enforce(self.bans, evidence, self.dht.host, self.dht.peer_id, why)
        if new and self.on_ban is not None:
            self.on_ban(peer)  # type: ignore[arg-type]
        return peer

    async def publish(self, evidence: StageEvidence) -> bool:
        """Enforce and store a conviction we assembled."""
        self.enforce(evidence)
        key = stage_convictions_key(self.experiment)
        ok = await publish(self.dht, evidence, key=key)
        self.published += ok
        return ok

    async def refresh(self) -> list[PeerID]:
        """Read the published convictions; the peers newly banned."""
        new = []
        key = stage_convictions_key(self.experiment)
        for evidence in await fetch(self.dht, self.experiment, key=key,
                                    decode=StageEvidence.decode):  # fmt: skip
            if evidence.prover in self.bans:
                continue
            if self.enforce(evidence) is not None:
                new.append(evidence.prover)
        return new
