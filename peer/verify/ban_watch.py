"""Enforcing convictions: every `BAN_REFRESH_S` the peer reads its experiment's
convictions from the DHT, checks each offline (`verification.evidence`) and
blocks each convicted peer on its host.

Blocking on the host (a connection gate) refuses the peer everywhere at once:
matchmaking (its joins and its leadership fail and it is set aside), state
sync, the all-reduce and pipelines, with nothing in those layers checking a
list. A peer that finds itself convicted says so in its log and its status.
"""

from __future__ import annotations

import asyncio
import logging
import random

from shoal.dht.node import DHTNode
from shoal.transport.identity import PeerID
from shoal.verification.bans import READ_REPLICAS, BanList, enforce, fetch
from shoal.verification.evidence import Evidence

__all__ = ["BAN_REFRESH_S", "BanWatcher"]

log = logging.getLogger("shoal.peer.bans")

# As often as the peer reports itself (peer/node.py): a conviction is enforced
# by every peer within about one report interval.
BAN_REFRESH_S = 10.0


class BanWatcher:
    """The convictions of one experiment, read from the DHT and enforced on our host."""

    def __init__(
        self,
        dht: DHTNode,
        experiment: str,
        *,
        interval: float = BAN_REFRESH_S,
        read_replicas: int | None = READ_REPLICAS,
    ) -> None:
        self.dht = dht
        self.experiment = experiment
        self.interval = interval
        self.read_replicas = read_replicas  # (None: every replica, each read)
        self.bans = BanList(experiment)
        self.convicted_self = False

    async def refresh(self) -> list[PeerID]:
        """Read and check the published convictions; the peers newly banned."""
        new = []
        for evidence in await fetch(self.dht, self.experiment, sample=self.read_replicas):
            if evidence.prover in self.bans:
                continue
            peer = self.enforce(evidence)
            if peer is not None:
                new.append(peer)
        return new

    def enforce(self, evidence: Evidence) -> PeerID | None:
        """Ban the peer `evidence` convicts, once it checks (refused by our host from
        then on); the peer, or None when the evidence does not check."""
        why = f"convicted in round {evidence.commitment.round}"
        peer, new = enforce(self.bans, evidence, self.dht.host, self.dht.peer_id, why)
        if new and peer == self.dht.peer_id:
            self.convicted_self = True
            log.error(
                "this peer was convicted of cheating in round %d of %s: every other "
                "peer refuses it",
                evidence.commitment.round,
                self.experiment,
            )
        return peer

    async def run(self) -> None:
        """Refresh until cancelled (with jitter, so peers do not read all at once)."""
        while True:
            try:
                await self.refresh()
            except Exception as e:  # the next refresh retries
                log.debug("reading convictions failed: %r", e)
            await asyncio.sleep(self.interval * random.uniform(0.8, 1.2))

    def status(self) -> dict[str, object]:
        """The part of /status about bans."""
        return {
            "banned": sorted(str(p) for p in self.bans.banned),
            "convictions": [c.to_status() for c in self.bans.convictions()],
            "convicted_self": self.convicted_self,
            "rejected_evidence": self.bans.rejected,
        }
