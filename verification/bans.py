"""Convictions in the DHT and the ban list every peer derives from them.

A conviction (`Evidence`) is published under ``<experiment>/convictions``, in
a subkey named after the convicted peer and owned by the publisher (so no one
can overwrite or erase another's copy). Every peer reads them, checks each
offline (`Evidence.check`) and bans the convicted peer: matchmaking, state sync
and pipelines refuse it. Forged or altered bundles are dropped, and so is a
bundle of another experiment.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from shoal.dht.node import DHTError, DHTNode
from shoal.dht.records import RecordError, owner_marker
from shoal.transport.errors import TransportError
from shoal.transport.identity import PeerID

from .evidence import Evidence, EvidenceError

__all__ = [
    "BAN_TTL",
    "BanList",
    "Conviction",
    "convictions_key",
    "enforce",
    "fetch",
    "publish",
]

log = logging.getLogger("shoal.verification.bans")

BAN_TTL = 7 * 24 * 3600.0  # how long a published conviction is kept (capped by the DHT)
# Every peer reads the convictions every few seconds: a read asks this many of the key's
# replicas, drawn at random from those the last full read found (one every
# `REPLICA_SET_TTL_S`), not all k of them after a lookup. At 1,000 peers that is the
# difference between hundreds of requests a second to each replica and a few dozen
# (sim/scenarios/bans_1k.json).
READ_REPLICAS = 3


def convictions_key(experiment: str) -> str:
    return f"{experiment}/convictions"


@dataclass(frozen=True)
class Conviction:
    peer: PeerID
    round: int
    referees: tuple[PeerID, ...]  # who accused
    at: float  # UNIX time we learned of it

    def to_status(self) -> dict[str, object]:
        return {
            "peer": str(self.peer),
            "round": self.round,
            "accusers": [str(r) for r in self.referees],
            "at": round(self.at, 3),
        }


class BanList:
    """The peers this peer refuses, each with the conviction that proves it."""

    def __init__(self, experiment: str) -> None:
        self.experiment = experiment
        self._convictions: dict[PeerID, Conviction] = {}
        self.rejected = 0  # bundles that did not check

    def consider(self, evidence: Evidence, now: float | None = None) -> PeerID | None:
        """Ban the peer `evidence` convicts, once it checks; None (and nothing
        banned) when it does not or belongs to another experiment."""
        if evidence.commitment.experiment != self.experiment:
            self.rejected += 1
            return None
        try:
            peer = evidence.check()
        except EvidenceError as e:
            log.warning("a conviction of %s does not check: %s", evidence.prover.short(), e)
            self.rejected += 1
            return None
        if peer not in self._convictions:
            accusers = tuple(v.verifier for v in evidence.verdicts if v.accuses)
            when = time.time() if now is None else now
            self._convictions[peer] = Conviction(peer, evidence.commitment.round, accusers, when)
            log.warning("%s is banned: convicted by %d referees", peer.short(), len(accusers))
        return peer

    def __contains__(self, peer: object) -> bool:
        return peer in self._convictions

    def __len__(self) -> int:
        return len(self._convictions)

    @property
    def banned(self) -> frozenset[PeerID]:
        return frozenset(self._convictions)

    def convictions(self) -> list[Conviction]:
        return sorted(self._convictions.values(), key=lambda c: c.at)


class Blocking(Protocol):
    """The host a ban is enforced on (`transport.host.Host`)."""

    def block(self, peer: PeerID, reason: str) -> None: ...


def enforce(
    bans: BanList, evidence: Any, host: Blocking, me: PeerID, why: str
) -> tuple[PeerID | None, bool]:
    """Ban the peer `evidence` convicts once it checks, and refuse it on `host` from
    then on (unless it is us): the peer (None when the evidence does not check) and
    whether it is newly banned. What the DiLoCo audit service (`Evidence`) and the
    pipeline's (`StageEvidence`, alike in what `BanList.consider` reads) share."""
    known = evidence.prover in bans
    peer = bans.consider(evidence)
    new = peer is not None and not known
    if new and peer != me:
        host.block(peer, why)  # type: ignore[arg-type]
    return peer, new


async def publish(
    dht: DHTNode, evidence: Any, *, key: str | None = None, ttl: float = BAN_TTL
) -> bool:
    """Store a conviction in the DHT under `key` (default: the experiment's
    convictions), in our own subkey for that peer."""
    key = key or convictions_key(evidence.commitment.experiment)
    subkey = f"{evidence.prover.to_base58()}{owner_marker(dht.peer_id)}"
    try:
        return await dht.store(key, evidence.encode(), time.time() + ttl, subkey=subkey)
    except (DHTError, TransportError, RecordError, OSError) as e:
        log.info("publishing the conviction of %s failed: %r", evidence.prover.short(), e)
        return False


async def fetch(
    dht: DHTNode,
    experiment: str,
    *,
    key: str | None = None,
    decode: Callable[[bytes], Any] = Evidence.decode,
    sample: int | None = READ_REPLICAS,
) -> list[Any]:
    """The convictions published under `key` (default: `experiment`'s) that `decode`
    takes (not yet checked: `BanList.consider` does that). `sample`: replicas asked
    (`DHTNode.get`); None asks all of them."""
    try:
        value = await dht.get(key or convictions_key(experiment), latest=True, sample=sample)
    except (DHTError, TransportError, OSError) as e:
        log.debug("reading convictions failed: %r", e)
        return []
    if value is None or not value.subkeys:
        return []
    out = []
    for raw, _expiration in value.subkeys.values():
        if not isinstance(raw, bytes):
            continue
        try:
            out.append(decode(raw))
        except EvidenceError as e:
            log.info("an undecodable conviction in the DHT: %s", e)
    return out
