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

import logging
import time
from collections.abc import Callable

from shoal.dht.node import DHTError, DHTNode
from shoal.dht.records import RecordError, owner_marker
from shoal.transport.errors import TransportError
from shoal.transport.identity import PeerID
from shoal.verification.bans import BAN_TTL, BanList
from shoal.verification.evidence import EvidenceError
from shoal.verification.stage_audit import StageEvidence

__all__ = ["StageBans", "stage_convictions_key"]

log = logging.getLogger("shoal.pipeline.audit")


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
        known = evidence.prover in self.bans
        peer = self.bans.consider(evidence)  # type: ignore[arg-type]  # (duck-typed)
        if peer is None or known:
            return peer
        if peer != self.dht.peer_id:
            self.dht.host.block(
                peer, f"convicted by a stage audit at version {evidence.commitment.version}"
            )
        if self.on_ban is not None:
            self.on_ban(peer)
        return peer

    async def publish(self, evidence: StageEvidence) -> bool:
        """Enforce and store a conviction we assembled."""
        self.enforce(evidence)
        subkey = f"{evidence.prover.to_base58()}{owner_marker(self.dht.peer_id)}"
        try:
            ok = await self.dht.store(stage_convictions_key(self.experiment), evidence.encode(),
                                      time.time() + BAN_TTL, subkey=subkey)  # fmt: skip
        except (DHTError, TransportError, RecordError, OSError) as e:
            log.info("publishing the conviction of %s failed: %r", evidence.prover.short(), e)
            return False
        self.published += ok
        return ok

    async def refresh(self) -> list[PeerID]:
        """Read the published convictions; the peers newly banned."""
        try:
            value = await self.dht.get(stage_convictions_key(self.experiment), latest=True)
        except (DHTError, TransportError, OSError) as e:
            log.debug("reading stage convictions failed: %r", e)
            return []
        new = []
        for raw, _ in ((value.subkeys or {}) if value is not None else {}).values():
            try:
                evidence = StageEvidence.decode(raw)
            except EvidenceError as e:
                log.info("an undecodable stage conviction: %s", e)
                continue
            if evidence.prover in self.bans:
                continue
            if self.enforce(evidence) is not None:
                new.append(evidence.prover)
        return new
