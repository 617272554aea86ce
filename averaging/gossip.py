"""Gossip averaging (NoLoCo-style): each round, every peer averages with one partner.

No global group and no barrier: partners follow from a permutation of the
participants seeded by the round number, so two peers that see the same
participant list agree on who pairs with whom without asking anyone. Each
pair runs the same commit-or-abort all-reduce as a group of two: a pair
either both take the mean or both keep their values, so killing a peer
mid-exchange never loses or doubles anything; its partner just keeps its
own value for that round.

Participants announce themselves in the DHT under ``<key>/gossip`` (one
owner-signed subkey each, refreshed while they take part). A peer whose
partner is not looking this round (it left, or sees another list) ends the
exchange at the all-reduce's start timeout and keeps its value.

With `adaptive` deadlines a pair's stall timeout grows with what earlier exchanges
measured of the links (`deadlines.AdaptiveDeadlines`; the configured one is the
floor): on a slow link a partner silent while its half crosses the wire is not
taken for dead.
"""

from __future__ import annotations

import hashlib
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from shoal.dht.node import DHTNode
from shoal.dht.records import RecordError, owner_marker, owner_of
from shoal.transport.identity import PeerID

from .allreduce import AllReduceConfig, AllReduceService
from .deadlines import AdaptiveDeadlines, Deadlines, nbytes
from .group import Group, Member, make_round_id


@dataclass
class GossipConfig:
    allreduce: AllReduceConfig = field(
        default_factory=lambda: AllReduceConfig(stall_timeout=5.0, start_timeout=3.0)
    )
    codec: str = "none"
    announce_ttl: float = 30.0
    # Participants are re-read from the DHT at most this often.
    refresh_interval: float = 2.0
    # The stall timeout is a floor, raised by the links' measured rate and RTT.
    adaptive: bool = False


@dataclass(frozen=True, slots=True)
class GossipResult:
    round: int
    partner: PeerID | None  # None: sat out (odd count) or alone
    committed: bool
    reason: str = ""


def pairing(participants: Sequence[PeerID], key: str, round_number: int) -> dict[PeerID, PeerID]:
    """Who averages with whom in `round_number`: a seeded shuffle, then consecutive pairs.

    Deterministic in (set of participants, key, round): every peer computes the same.
    """
    ordered = sorted(set(participants))
    seed = hashlib.sha256(f"{key}\x00{round_number}".encode()).digest()
    random.Random(seed).shuffle(ordered)
    pairs: dict[PeerID, PeerID] = {}
    for a, b in zip(ordered[0::2], ordered[1::2], strict=False):
        pairs[a], pairs[b] = b, a
    return pairs


class GossipAverager:
    """Averages `tensors` in place with one partner per round."""

    def __init__(
        self,
        dht: DHTNode,
        key: str,
        tensors: Sequence[torch.Tensor],
        *,
        config: GossipConfig | None = None,
        service: AllReduceService | None = None,
    ) -> None:
        self.dht = dht
        self.key = key
        self.tensors = list(tensors)
        self.config = config or GossipConfig()
        self._own_service = service is None
        self._service = service or AllReduceService(dht.host, self.config.allreduce)
        self._participants: list[PeerID] = []
        self._read_at = -1e9
        self._announced_until = 0.0
        self.deadlines: AdaptiveDeadlines | None = None
        if self.config.adaptive:
            stall = self.config.allreduce.stall_timeout
            self.deadlines = AdaptiveDeadlines(
                Deadlines(0.0, 0.0, 0.0, stall, 0.0),
                payload_bytes=nbytes(self.tensors),
                state_bytes=0,  # (a gossip round downloads no state)
                chunk_bytes=self.config.allreduce.chunk_bytes,
            )

    @property
    def stall_timeout(self) -> float:
        """The next exchange's stall timeout."""
        if self.deadlines is None:
            return self.config.allreduce.stall_timeout
        return self.deadlines.deadlines(2).stall_timeout

    async def aclose(self) -> None:
        if self._own_service:
            self._service.close()

    async def announce(self) -> None:
        now = time.time()
        if self._announced_until - now > self.config.announce_ttl / 2:
            return
        until = now + self.config.announce_ttl
        await self.dht.store(f"{self.key}/gossip", 1, until, subkey=owner_marker(self.dht.peer_id))
        self._announced_until = until

    async def participants(self, *, refresh: bool = False) -> list[PeerID]:
        now = time.monotonic()
        if refresh or now - self._read_at >= self.config.refresh_interval:
            found = await self.dht.get(f"{self.key}/gossip", latest=True)
            peers = {self.dht.peer_id}
            for subkey in (found.subkeys or {}) if found is not None else {}:
                try:
                    owner = owner_of(subkey)
                except RecordError:
                    continue
                if owner is not None:
                    peers.add(owner)
            self._participants = sorted(peers)
            self._read_at = now
        return self._participants

    async def step(self, round_number: int, weight: float = 1.0) -> GossipResult:
        await self._service.prepare(self.config.codec)  # before a partner would wait for it
        await self.announce()
        partner = pairing(await self.participants(), self.key, round_number).get(self.dht.peer_id)
        if partner is None:
            return GossipResult(round_number, None, False, "no partner this round")
        pair = sorted([self.dht.peer_id, partner])
        addrs = self.dht.routing_table.get(partner)
        members = tuple(
            Member(p, addrs.addrs if (p == partner and addrs is not None) else ()) for p in pair
        )
        nonce = f"gossip:{round_number}".encode()
        group = Group(self.key, make_round_id(self.key, pair, nonce), members)
        outcome = await self._service.run(
            group, self.tensors, weight, codec=self.config.codec, stall_timeout=self.stall_timeout
        )
        if self.deadlines is not None:
            self.deadlines.observe_transfer(outcome.bytes_received, outcome.busy_seconds)
            connection = self.dht.host.connection(partner)
            self.deadlines.observe_rtt(connection.rtt if connection is not None else None)
        if not outcome.committed:
            # Its declaration may be stale: read the list again next round.
            self._read_at = -1e9
        return GossipResult(round_number, partner, outcome.committed, outcome.reason)
