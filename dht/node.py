"""The DHT node: Kademlia over the transport's RPC.

`DHTNode` answers ping/find_node/find_value/store (see `protocol`), keeps its
routing table fresh from every request it answers, runs iterative multi-key
lookups (see `lookup`), stores records on the `replication` closest peers,
caches what it reads along the lookup path, and republishes the records it
wrote before they expire. Its background tasks (bucket refresh, republish,
pings of stale contacts, cache stores) are owned by the node and cancelled in
`aclose`.

Clocks: the routing table and blacklist use the loop's monotonic clock;
record expirations are UNIX times (`time.time()`), as in `records`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from shoal.transport.errors import TransportError
from shoal.transport.host import Host
from shoal.transport.identity import PeerID
from shoal.transport.multiaddr import Multiaddr
from shoal.transport.remote_log import RemoteEvents
from shoal.transport.tasks import TaskSet

from .admission import DiversityPolicy, RateLimits, RequestAdmission
from .counted_reads import count_records
from .errors import BootstrapError, DHTError, PeerBusy
from .joining import REJOIN_CHECK_S, Joiner
from .lookup import Candidate, KeyLookup, traverse
from .maintenance import Maintenance
from .protocol import (
    MAX_ADDRS,
    DHTProtocolError,
    parse_addrs,
)
from .publisher import Publisher
from .reads import Reader
from .records import Record, RecordValidator
from .requester import Blacklist, Requester
from .routing import AddResult, AddStatus, RoutingTable, dialable_addrs
from .server import DHTServer
from .storage import LocalStorage, StoredValue

log = logging.getLogger("shoal.dht")

DEFAULT_PROTOCOL = "/shoal/dht/1.0.0"
# The errors live in `errors`; importable from here as before.
__all__ = [
    "DEFAULT_PROTOCOL",
    "BootstrapError",
    "DHTError",
    "DHTNode",
    "DHTValue",
    "LookupResult",
    "PeerBusy",
]

# The counters of `DHTNode.stats`, each from 0.
COUNTERS = (
    "requests_served",
    "requests_sent",
    "requests_failed",
    "garbage_answers",
    "lookups",
    "republished",
    "cached",
    "value_retries",
    "partial_reads",  # reads that ran out of `within` and merged what came
    "sampled_reads",  # latest reads of a few of the replicas a full read found
    "stores_to_known_replicas",  # stores of a key with no lookup: its replicas were known
    "counted_reads",  # reads of how many records a key holds (`count_records`)
    "node_retries",
    "requests_redialed",
    "busy_answers",
    "requests_refused",
)


@dataclass(frozen=True, slots=True)
class DHTValue:
    """What `DHTNode.get` returns.

    Plain value: `value` is the stored object and `subkeys` None. Dictionary:
    `value` maps subkey -> object, `subkeys` maps subkey -> (object, expiration),
    `expiration` is the latest one.
    """

    value: Any
    expiration: float
    subkeys: dict[str, tuple[Any, float]] | None = None


@dataclass(frozen=True, slots=True)
class LookupResult:
    """The outcome of one key of a traversal (for tests and introspection)."""

    target: int
    closest: list[Candidate]
    hops: int


def _pack(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def _unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def _never(peer: PeerID) -> bool:
    return False


def _to_value(stored: StoredValue) -> DHTValue:
    if stored.plain is not None:
        return DHTValue(_unpack(stored.plain.value), stored.plain.expiration)
    subkeys = {sk: (_unpack(r.value), r.expiration) for sk, r in stored.subkeys.items()}
    return DHTValue({sk: v for sk, (v, _) in subkeys.items()}, stored.expiration, subkeys)


class DHTNode:
    """A Kademlia node on `host`. Create with `await DHTNode.create(host, ...)`."""

    def __init__(
        self,
        host: Host,
        *,
        k: int = 20,
        alpha: int = 3,
        replication: int | None = None,
        hop_timeout: float = 1.0,
        stall_after: float | None = None,
        blacklist_for: float = 30.0,
        value_quorum: int = 3,
        store_quorum: int = 1,
        refresh_interval: float = 600.0,
        republish_interval: float = 3600.0,
        rejoin_check: float = REJOIN_CHECK_S,
        cache_along_path: bool = True,
        delta_reads: bool = True,
        storage: LocalStorage | None = None,
        validator: RecordValidator | None = None,
        protocol: str = DEFAULT_PROTOCOL,
        max_connections: int | None = None,
        serves: Callable[[], bool] | None = None,
        addresses: Callable[[], Sequence[Multiaddr]] | None = None,
        diversity: DiversityPolicy | None = None,
        rate_limits: RateLimits | None = None,
    ) -> None:
        """`serves`: whether others may use us as a hop and a replica right now
        (NAT: a private peer does not); while false we are a client: our requests
        say so and carry no addresses, and nobody adds us to a table. `addresses`:
        what we advertise in requests (default: the host's addresses).
        `diversity`, `rate_limits`: the Sybil defences (see `admission`).
        `delta_reads`: a read of a key asks each replica read before only for what
        it stored since (`replica_reads`); False reads everything every time."""
        self.host = host
        self._serves = serves
        self._addresses = addresses or host.addresses
        self.peer_id: PeerID = host.peer_id
        self.k = k
        self.alpha = alpha
        self.replication = replication if replication is not None else k
        self.hop_timeout = hop_timeout
        # A request pending this long no longer holds up the lookup.
        self.stall_after = stall_after if stall_after is not None else min(0.25, hop_timeout)
        self.blacklist_for = blacklist_for
        self.value_quorum = value_quorum
        self.store_quorum = store_quorum
        self.refresh_interval = refresh_interval
        self.republish_interval = republish_interval
        self.rejoin_check = rejoin_check
        self.cache_along_path = cache_along_path
        self.protocol = protocol
        self.validator = validator or (storage.validator if storage else RecordValidator())
        self.storage = storage or LocalStorage(validator=self.validator)
        self.diversity = diversity if diversity is not None else DiversityPolicy()
        self.routing_table = RoutingTable(self.peer_id, k, diversity=self.diversity)
        self.admission = RequestAdmission(rate_limits or RateLimits(), self.diversity)
        self._loop = asyncio.get_running_loop()
        self._blacklisted = Blacklist()
        self._tasks = TaskSet(log, "DHT")
        self._closed = False
        # "answered garbage" is as frequent as a hostile peer wants it to be.
        self._remote_events = RemoteEvents(log)
        self._counters = dict.fromkeys(COUNTERS, 0)
        self._max_hops = 0
        self._hello_cache: tuple[float, dict[str, Any]] | None = None
        self._requester = Requester(
            host, protocol, hop_timeout, max_connections, self._tasks, self.count
        )
        self._publisher = Publisher(self, republish_interval)
        self._reader = Reader(self, delta_reads=delta_reads)
        self._upkeep = Maintenance(
            self.routing_table, self._publisher, self.find_nodes, refresh_interval, serves
        )
        self._joiner = Joiner(
            host, protocol, hop_timeout, self.hello, self._bootstrap_reached, self._fill_table
        )
        self._server = DHTServer(self)

    @property
    def max_connections(self) -> int | None:
        return self._requester.max_connections

    @property
    def _blacklist(self) -> dict[PeerID, float]:
        return self._blacklisted.until

    @property
    def _originated(self) -> dict[tuple[str, str | None], tuple[Record, float]]:
        return self._publisher.originated

    @property
    def _wake(self) -> asyncio.Event:
        return self._upkeep.wake

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    async def create(
        cls,
        host: Host,
        *,
        bootstrap: Iterable[str | Multiaddr] = (),
        bootstrap_attempts: int = 3,
        bootstrap_backoff: float = 0.2,
        start_alone_on_failure: bool = False,
        **options: Any,
    ) -> DHTNode:
        """A started node. With `bootstrap` addresses it joins their network
        (retrying each `bootstrap_attempts` times with exponential backoff) and
        raises BootstrapError when none answers, unless `start_alone_on_failure`;
        with none it starts a new network."""
        node = cls(host, **options)
        try:
            addrs = [str(a) for a in bootstrap]
            if addrs:
                try:
                    await node.bootstrap(
                        addrs, attempts=bootstrap_attempts, backoff=bootstrap_backoff
                    )
                except BootstrapError:
                    if not start_alone_on_failure:
                        raise
                    log.warning("none of the %d bootstrap peers answers: starting cut off, "
                                "joining through them again every %.0fs", len(addrs),
                                node.rejoin_check)  # fmt: skip
            node._tasks.spawn(node._upkeep.run())
            if addrs:
                node._tasks.spawn(
                    node._joiner.rejoin_when_cut_off(addrs, node.rejoin_check, node.routing_table)
                )
        except BaseException:
            await node.aclose()
            raise
        return node

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._server.close()
        await self._tasks.aclose()

    async def __aenter__(self) -> DHTNode:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # ------------------------------------------------------------------ bootstrap

    async def bootstrap(
        self,
        addrs: Sequence[str | Multiaddr],
        *,
        attempts: int = 3,
        backoff: float = 0.2,
        quiet: bool = False,
    ) -> None:
        """Join through `addrs`, then fill the table by looking up our own ID and
        refreshing every bucket (`quiet`: failed attempts at DEBUG, not INFO)."""
        await self._joiner.bootstrap(addrs, attempts=attempts, backoff=backoff, quiet=quiet)

    async def _fill_table(self) -> None:
        """A joiner's table: a lookup of our own ID fills the deep buckets, then one
        random target in every bucket fills the far ones. Without the second, a joiner
        knew nobody in most of the key space for a refresh interval, and a lookup there
        ended at the first peers that answered, none nearer: a 200-peer simulation's
        newcomers stored keys on 20 peers at the far side of the key space, where no
        reader looks (about log2(N) lookups more, sent together, each ending once the
        `alpha` closest answered: contacts in the bucket are what we need, not the k
        closest to a random point of it)."""
        await self.find_nodes([self.routing_table.local_id])
        await self._upkeep.refresh(settle=self.alpha)

    def _bootstrap_reached(self, peer: PeerID, reply: object, addr: Multiaddr) -> None:
        addrs = self._reply_addrs(peer, reply) or (addr,)
        self.add_contact(peer, addrs, replace=True, observed_ip=self._observed_ip(peer))

    # ------------------------------------------------------------------ public API

    async def store(
        self,
        key: str,
        value: Any,
        expiration: float,
        subkey: str | None = None,
        *,
        remember_replicas: bool = False,
    ) -> bool:
        """Store `value` (msgpack-able) under `key` (and `subkey`) until `expiration`
        (UNIX time) on the `replication` closest peers; republished until it expires.
        `remember_replicas`: the peers that took it serve this key's sampled reads
        (`get`'s `sample`) until a full read finds its replicas."""
        (ok,) = await self.store_many(
            [(key, value, expiration, subkey)], remember_replicas=remember_replicas
        )
        return ok

    async def store_many(
        self,
        items: Iterable[tuple[str, Any, float] | tuple[str, Any, float, str | None]],
        *,
        remember_replicas: bool = False,
    ) -> list[bool]:
        """Store several values in one traversal; one success flag per item."""
        records = []
        for item in items:
            key, value, expiration = item[0], item[1], item[2]
            subkey = item[3] if len(item) > 3 else None  # type: ignore[misc]
            record = Record(key, subkey, _pack(value), float(expiration))
            if RecordValidator.required_signer(record) == self.peer_id:
                record = record.sign(self.host.identity)
            records.append(record)
        now = time.time()
        for r in records:
            self.validator.validate(r, now)  # fail early, with the writer's own error
        self._publisher.originate(records, now)
        self._wake.set()
        return await self._publisher.store_records(records, remember=remember_replicas)

    async def get(
        self,
        key: str,
        *,
        latest: bool = False,
        within: float | None = None,
        sample: int | None = None,
    ) -> DHTValue | None:
        """The value of `key` merged from several replicas, or None.

        `latest`: ask every one of the k closest peers instead of stopping at
        `value_quorum` holders (slower, but sees a write that reached few peers).
        `within`: seconds; the lookup stops then and the value is merged from the
        replicas that answered by then (a partial read: a caller that merges
        reads, such as one of owner-signed subkeys, loses nothing by it), where
        a timeout around the call would give nothing at all.
        `sample` (with `latest`): ask that many replicas drawn at random among the
        k that the key's last full latest read found (at most `REPLICA_SET_TTL_S`
        ago; else this read is that full read), for a key read again and again
        (matchmaking's polls): see `replica_reads.ReplicaSets`.
        """
        if latest and sample is not None:
            stored = await self._reader.sampled_value(key, sample, within)
            return _to_value(stored) if stored is not None else None
        return (await self.get_many([key], latest=latest, within=within))[key]

    async def count_records(self, key: str, *, within: float | None = None) -> int | None:
        """How many live records (subkeys) `key` holds, read from its k closest
        replicas without the records: the largest count any that answered by
        `within` seconds claims; 0 when none holds it; None when none answered."""
        return await count_records(self._reader, key, within)

    async def get_many(
        self, keys: Iterable[str], *, latest: bool = False, within: float | None = None
    ) -> dict[str, DHTValue | None]:
        """Several values in one traversal."""
        keys = list(dict.fromkeys(keys))
        found = await self._reader.find_values(keys, latest=latest, within=within)
        return {k: (_to_value(found[k]) if found.get(k) else None) for k in keys}

    async def find_nodes(
        self, targets: Sequence[int], *, settle: int | None = None
    ) -> list[LookupResult]:
        """Iterative lookups of the k closest peers to each 256-bit target, together
        (`settle`: each ends once that many of its closest candidates answered)."""
        lookups = await self._reader.find_nodes(targets, settle=settle)
        return [LookupResult(lk.target, lk.closest_answered(self.k), lk.hops) for lk in lookups]

    async def find_node(self, target: int) -> LookupResult:
        return (await self.find_nodes([target]))[0]

    def stats(self) -> dict[str, Any]:
        now = self._loop.time()
        return {
            "peer_id": self.peer_id.to_base58(),
            "routing_table_size": len(self.routing_table),
            "blacklisted": self._blacklisted.count(now),
            "originated_records": len(self._originated),
            "max_hops": self._max_hops,
            "storage": self.storage.stats(),
            **self._counters,
        }

    def snapshot(self, *, contacts: bool = False) -> dict[str, object]:
        """The routing table for the status endpoint."""
        return self.routing_table.snapshot(self._loop.time(), contacts=contacts)

    # ------------------------------------------------------------------ server side

    def count(self, counter: str, n: int = 1) -> int:
        """Add `n` to one of the `stats` counters; its new value."""
        self._counters[counter] += n
        return self._counters[counter]

    def hello(self) -> dict[str, Any]:
        """What we say of ourselves in every request and answer (addresses, or client)."""
        # Sent with every request: rebuilt at most once a second, not per call.
        now = self._loop.time()
        if self._hello_cache is None or now - self._hello_cache[0] > 1.0:
            if self._serves is not None and not self._serves():
                hello: dict[str, Any] = {"from": [], "client": True}
            else:
                # (Without the trailing /p2p/ of our ID, which the connection proves:
                # 53 bytes of every request's 130 to 430.)
                ours = dialable_addrs(self.peer_id, self._addresses(), MAX_ADDRS)
                hello = {"from": [str(a) for a in ours]}
            self._hello_cache = (now, hello)
        return self._hello_cache[1]

    def _rtt(self, peer: PeerID) -> float | None:
        """Our connection's measured RTT to `peer`; None when not connected or unknown."""
        conn = self.host.connection(peer)
        return None if conn is None else conn.rtt

    def _observed_ip(self, peer: PeerID) -> str | None:
        """The IP our connection to `peer` goes to; None when relayed or not connected."""
        conn = self.host.connection(peer)
        if conn is None or conn.kind == "relayed" or conn.remote_address is None:
            return None
        return conn.remote_address[0]

    def add_contact(
        self,
        peer: PeerID,
        addrs: Sequence[Multiaddr],
        *,
        replace: bool,
        observed_ip: str | None = None,
    ) -> None:
        """`peer` at `addrs` into the routing table (a full bucket pings its oldest)."""
        result: AddResult = self.routing_table.add_or_update(
            peer, addrs, self._loop.time(), replace_addrs=replace, observed_ip=observed_ip
        )
        if result.status is AddStatus.NEEDS_PING and result.needs_ping is not None:
            self._tasks.spawn(self._check_alive(result.needs_ping.peer_id, result.needs_ping.addrs))

    async def _check_alive(self, peer: PeerID, addrs: tuple[Multiaddr, ...]) -> None:
        try:
            await self._request(peer, addrs, "ping", self.hello())
            alive = True
        except PeerBusy:
            alive = True  # throttled us, but it answered
        except (TransportError, TimeoutError, OSError, DHTProtocolError):
            alive = False
        self.routing_table.ping_result(peer, alive, self._loop.time())

    # ------------------------------------------------------------------ client side

    async def _request(
        self, peer: PeerID, addrs: Sequence[Multiaddr], method: str, payload: Any
    ) -> Any:
        return await self._requester.request(peer, addrs, method, payload)

    def _reply_addrs(self, peer: PeerID, reply: object) -> tuple[Multiaddr, ...]:
        if not isinstance(reply, dict):
            raise DHTProtocolError("reply must be a map")
        return parse_addrs(peer, reply.get("from", []))

    def _blocked(self, peer: PeerID) -> bool:
        return self._blacklisted.blocked(peer, self._loop.time())

    def _on_failure(self, cand: Candidate, exc: BaseException) -> None:
        now = self._loop.time()
        if isinstance(exc, PeerBusy):
            # Up, and throttling us: skip it for a moment; no failure in the table.
            self._counters["busy_answers"] += 1
            self._blacklisted.block(cand.peer_id, now + exc.retry_after, now)
            return
        self._counters["requests_failed"] += 1
        if isinstance(exc, DHTProtocolError):
            self._counters["garbage_answers"] += 1
            self._remote_events.info(
                "DHT peer answered garbage",
                cand.peer_id.short(),
                "DHT peer %s answered garbage: %s",
                cand.peer_id.short(),
                exc,
            )
        else:
            log.debug("DHT request to %s failed: %r", cand.peer_id.short(), exc)
        self._blacklisted.block(cand.peer_id, now + self.blacklist_for, now)
        self.routing_table.mark_failed(cand.peer_id, now)

    async def _traverse(
        self, lookups: list[KeyLookup], query: Any, *, skip_blacklisted: bool = True
    ) -> None:
        if not lookups:
            return
        self._counters["lookups"] += len(lookups)
        blocked = self._blocked if skip_blacklisted else _never
        for lk in lookups:
            lk.per_group = self.diversity.lookup_cap
            for c in self.routing_table.nearest(lk.target, self.k):
                if blocked(c.peer_id):
                    lk.skipped[c.peer_id] = c.node_id
                else:
                    lk.add(Candidate(c.peer_id, c.node_id, c.addrs, 0, c.ip_group))
        await traverse(
            lookups,
            query,
            k=self.k,
            alpha=self.alpha,
            stall_after=max(self.stall_after, 2 * self._requester.typical_rtt()),
            on_failure=self._on_failure,
            blocked=blocked,
            max_in_flight=max(self.alpha, min(64, self.alpha * len(lookups))),
            group_of=self.diversity.group_of_addrs,
        )
        for lk in lookups:
            self._max_hops = max(self._max_hops, lk.hops)

    # ------------------------------------------------------------------ writes

    def _cache(self, lk: KeyLookup, merged: StoredValue) -> None:
        self._publisher.cache(lk, merged)

    # ------------------------------------------------------------------ maintenance

    def addresses_changed(self) -> None:
        """What we advertise changed (e.g. NAT traversal found us public): tell the
        peers nearest to us soon, so that they add (or update) us in their tables;
        until our next request nobody would. At most once per `maintenance.ANNOUNCE_INTERVAL`."""
        self._hello_cache = None  # the next request carries the new addresses
        self._upkeep.addresses_changed()
