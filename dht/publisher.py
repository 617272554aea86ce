"""The writing side of a DHT node: records to their closest peers, caching along a
read's path, and the republishing of the records this node wrote."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any, Protocol

from shoal.transport.errors import TransportError
from shoal.transport.identity import PeerID
from shoal.transport.multiaddr import Multiaddr
from shoal.transport.tasks import TaskSet

from .errors import PeerBusy
from .lookup import Candidate, KeyLookup
from .protocol import DHTProtocolError, parse_stored
from .reads import Reader
from .records import Record, RecordError, RecordValidator
from .routing import RoutingTable, key_id
from .storage import LocalStorage, StoredValue

log = logging.getLogger("shoal.dht")

# Rounds of store requests: each replaces the peers that could not be reached.
STORE_ROUNDS = 3


class PublishingNode(Protocol):
    """What the publisher needs of its node (`DHTNode` is one)."""

    k: int
    alpha: int
    replication: int
    store_quorum: int
    storage: LocalStorage
    validator: RecordValidator
    routing_table: RoutingTable
    _tasks: TaskSet

    def count(self, counter: str, n: int = 1) -> int: ...
    def hello(self) -> dict[str, Any]: ...
    async def _request(
        self, peer: PeerID, addrs: Sequence[Multiaddr], method: str, payload: Any
    ) -> Any: ...
    def _on_failure(self, cand: Candidate, exc: BaseException) -> None: ...
    def _blocked(self, peer: PeerID) -> bool: ...
    async def _traverse(
        self, lookups: list[KeyLookup], query: Any, *, skip_blacklisted: bool = True
    ) -> None: ...
    @property
    def _reader(self) -> Reader: ...


class Publisher:
    """Stores records on the `replication` closest peers of their keys and keeps
    the ones this node originated alive until they expire."""

    def __init__(self, node: PublishingNode, republish_interval: float) -> None:
        self.node = node
        self.republish_interval = republish_interval
        # (key, subkey) -> (record, when to republish, UNIX time)
        self.originated: dict[tuple[str, str | None], tuple[Record, float]] = {}

    def originate(self, records: list[Record], now: float) -> None:
        """Remember records we wrote, to republish them until they expire."""
        for r in records:
            ttl = r.expiration - now
            self.originated[(r.key, r.subkey)] = (r, now + min(0.8 * ttl, self.republish_interval))

    def next_due(self) -> float | None:
        """When the next record is due for republishing (UNIX time), if any."""
        return min((t for _, t in self.originated.values()), default=None)

    async def republish(self) -> None:
        now = time.time()
        due = []
        for name, (record, at) in list(self.originated.items()):
            if record.expiration <= now:
                del self.originated[name]
            elif at <= now:
                due.append(record)
                ttl = record.expiration - now
                self.originated[name] = (record, now + min(0.8 * ttl, self.republish_interval))
        if due:
            self.node.count("republished", len(due))
            try:
                await self.store_records(due)
            except Exception as e:  # a failed round is retried at the next due time
                log.warning("republishing %d records failed: %r", len(due), e)

    def cache(self, lk: KeyLookup, merged: StoredValue) -> None:
        """Store what was found at the closest answering peer that lacked it, so
        that the next reader's lookup ends earlier (Kademlia's caching)."""
        holders = {c.peer_id for c in lk.holders}
        lacking = [c for c in lk.closest_answered(self.node.k) if c.peer_id not in holders]
        validator = self.node.validator
        records = [r for r in merged.records() if not validator.is_capped(r, time.time())]
        if lacking and records:
            self.node.count("cached")
            self.node._tasks.spawn(self.send_store(lacking[0], records))

    async def send_store(self, cand: Candidate, records: list[Record]) -> list[bool] | None:
        """Per record, whether `cand` stored it; None when it could not be reached."""
        try:
            reply = await self.node._request(
                cand.peer_id,
                cand.addrs,
                "store",
                {**self.node.hello(), "records": [r.to_wire() for r in records]},
            )
            return parse_stored(reply, len(records))
        except (TransportError, TimeoutError, OSError, DHTProtocolError, PeerBusy) as e:
            self.node._on_failure(cand, e)
            return None

    async def store_records(self, records: list[Record], *, remember: bool = False) -> list[bool]:
        """Send each record to the `replication` closest peers of its key (us included).
        `remember`: the peers that took a key's records become its replica set for
        sampled reads (`ReplicaSets.stored`), when no full read found one lately.

        The lookup settles once the `alpha` closest candidates answered; the
        store requests then go to the closest candidates not known dead, and a
        peer that cannot be reached is replaced by the next closest (up to
        `STORE_ROUNDS` rounds). That saves the lookup's final round, which
        would only have proved the same peers alive. A key whose replicas a
        recent full read found (`replica_reads.ReplicaSets`) has no lookup.
        """
        node = self.node
        by_key: dict[str, list[int]] = {}
        for i, r in enumerate(records):
            by_key.setdefault(r.key, []).append(i)
        lookups = [KeyLookup(key_id(key), key, settle=node.alpha) for key in by_key]
        # A key read with sampled reads has its replicas known from a full read at
        # most REPLICA_SET_TTL_S ago (matchmaking's declarations): no lookup for it.
        now = asyncio.get_running_loop().time()
        sets = node._reader.replica_sets
        known = {key: sets.known(key, now, node._blocked) for key in by_key}
        await node._traverse(
            [lk for lk in lookups if known.get(lk.key or "") is None],
            node._reader.query_find_node,
        )
        counts = [0] * len(records)
        queue: dict[str, list[Candidate]] = {}
        missing: dict[str, int] = {}
        for lk in lookups:
            assert lk.key is not None
            replicas = known[lk.key]
            if replicas is not None:
                target = lk.target
                closest = sorted(replicas, key=lambda c: c.node_id ^ target)
                node.count("stores_to_known_replicas")
            else:
                closest = lk.closest_live(2 * node.replication)
            missing[lk.key] = node.replication
            if self._we_are_near(lk, closest):
                # we are among the closest ourselves: keep a replica
                missing[lk.key] -= 1
                self._store_locally(records, by_key[lk.key], counts)
            queue[lk.key] = closest
        took = await self._store_remotely(records, by_key, queue, missing, counts)
        if remember:
            now = asyncio.get_running_loop().time()
            for key, peers in took.items():
                if known.get(key) is None:
                    sets.stored(key, peers, now)
        return [c >= node.store_quorum for c in counts]

    def _we_are_near(self, lk: KeyLookup, closest: list[Candidate]) -> bool:
        near = closest[: self.node.replication]
        local_id = self.node.routing_table.local_id
        return len(near) < self.node.replication or (local_id ^ lk.target) < (
            near[-1].node_id ^ lk.target
        )

    def _store_locally(self, records: list[Record], idxs: list[int], counts: list[int]) -> None:
        now = time.time()
        for i in idxs:
            try:
                counts[i] += self.node.storage.store(records[i], now)
            except RecordError:
                pass

    async def _store_remotely(
        self,
        records: list[Record],
        by_key: dict[str, list[int]],
        queue: dict[str, list[Candidate]],
        missing: dict[str, int],
        counts: list[int],
    ) -> dict[str, list[Candidate]]:
        """The stores of `_store`; which peers took each key's records."""
        took: dict[str, list[Candidate]] = {}
        for _ in range(STORE_ROUNDS):
            plan: dict[PeerID, tuple[Candidate, list[str]]] = {}
            for key, cands in queue.items():
                take = cands[: max(0, missing[key])]
                del cands[: len(take)]
                for c in take:
                    plan.setdefault(c.peer_id, (c, []))[1].append(key)
            if not plan:
                break
            sends = [
                (c, keys, [i for key in keys for i in by_key[key]]) for c, keys in plan.values()
            ]
            results = await asyncio.gather(
                *(self.send_store(c, [records[i] for i in idxs]) for c, _, idxs in sends)
            )
            for (cand, keys, idxs), oks in zip(sends, results, strict=True):
                if oks is None:
                    continue  # unreachable: the next round asks the next closest
                for key in keys:
                    missing[key] -= 1
                    took.setdefault(key, []).append(cand)
                for i, ok in zip(idxs, oks, strict=True):
                    counts[i] += ok
        return took
