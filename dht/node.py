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

from shoal.transport import rpc
from shoal.transport.errors import (
    ConnectionLost,
    PeerIDMismatch,
    ProtocolNotSupported,
    StreamReset,
    TransportError,
)
from shoal.transport.host import Host
from shoal.transport.identity import PeerID
from shoal.transport.multiaddr import Multiaddr
from shoal.transport.remote_log import RemoteEvents
from shoal.transport.tasks import TaskSet
from shoal.transport.version import IncompatibleProtocol

from .admission import DiversityPolicy, RateLimits, RequestAdmission
from .lookup import ANSWERED, FAILED, Candidate, KeyLookup, traverse
from .protocol import (
    ID_BYTES,
    DHTProtocolError,
    WireContact,
    parse_addrs,
    parse_nearest,
    parse_stored,
    parse_values,
)
from .records import Record, RecordError, RecordValidator
from .routing import AddResult, AddStatus, RoutingTable, key_id
from .server import DHTServer
from .storage import LocalStorage, StoredValue, merge_records

log = logging.getLogger("shoal.dht")

DEFAULT_PROTOCOL = "/shoal/dht/1.0.0"
# Rounds of store requests: each replaces the peers that could not be reached.
_STORE_ROUNDS = 3
# A peer whose addresses changed re-announces itself at most this often (seconds).
ANNOUNCE_INTERVAL = 5.0
# A node with fewer live contacts than this (contacts whose last RPC did not fail)
# joins again through its bootstrap peers, checked every REJOIN_CHECK_S (`rejoin_check`).
REJOIN_BELOW = 2
REJOIN_CHECK_S = 30.0
# A request's deadline on a far link, in RTTs of the link: on a connection (a stream,
# its protocol, the answer, with room for queueing) and with a dial first (TCP and
# Noise too); never past MAX_HOP_TIMEOUT, never under `hop_timeout`.
REQUEST_RTTS = 4
DIAL_RTTS = 8
MAX_HOP_TIMEOUT = 10.0


def _reason(e: BaseException) -> str:
    chain: BaseException | None = e
    while chain is not None:
        if isinstance(chain, ConnectionRefusedError):
            return "connection refused (nothing listens there yet?)"
        chain = chain.__cause__ or chain.__context__
    if "[Errno 111]" in str(e):  # a DialError that kept only the message of the refusal
        return "connection refused (nothing listens there yet?)"
    if isinstance(e, TimeoutError):
        return "no answer"
    return f"{type(e).__name__}: {e}"[:200]


class DHTError(Exception):
    """Base class of DHT errors."""


class BootstrapError(DHTError):
    """None of the bootstrap peers could be reached."""


class PeerBusy(DHTError):
    """The peer refused a request by its rate limits ("busy"): it is up and honest
    as far as we know, so it is neither garbage nor a failure in the table."""

    def __init__(self, peer: PeerID, retry_after: float) -> None:
        super().__init__(f"{peer.short()} is busy; retry after {retry_after:.1f}s")
        self.retry_after = retry_after


# A busy answer's retry_after is bounded, so a peer cannot make itself skipped for long
# (nor ask to be asked again at once).
_BUSY_BLOCK = (0.1, 10.0)


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
        `diversity`, `rate_limits`: the Sybil defences (see `admission`)."""
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
        self._blacklist: dict[PeerID, float] = {}
        # (key, subkey) -> (record, when to republish, UNIX time)
        self._originated: dict[tuple[str, str | None], tuple[Record, float]] = {}
        self._tasks = TaskSet(log, "DHT")
        self._announce_due = False
        self._announced_at = -ANNOUNCE_INTERVAL
        self._wake = asyncio.Event()
        self._closed = False
        # "answered garbage" is as frequent as a hostile peer wants it to be.
        self._remote_events = RemoteEvents(log)
        self._counters = {
            "requests_served": 0,
            "requests_sent": 0,
            "requests_failed": 0,
            "garbage_answers": 0,
            "lookups": 0,
            "republished": 0,
            "cached": 0,
            "value_retries": 0,
            "partial_reads": 0,  # reads that ran out of `within` and merged what came
            "node_retries": 0,
            "requests_redialed": 0,
            "busy_answers": 0,
            "requests_refused": 0,
        }
        self._max_hops = 0
        self._hello_cache: tuple[float, dict[str, Any]] | None = None
        # Connections this node dialed, least recently used first; with
        # `max_connections` the idle ones beyond it are closed, so that many
        # peers in one process (or a big network) do not exhaust descriptors.
        self.max_connections = max_connections
        self._dialed: dict[PeerID, None] = {}
        self._server = DHTServer(self)

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
            node._tasks.spawn(node._maintenance())
            if addrs:
                node._tasks.spawn(node._rejoin_when_cut_off(addrs))
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
        results = await asyncio.gather(
            *(self._bootstrap_one(Multiaddr(str(a)), attempts, backoff, quiet) for a in addrs)
        )
        errors = [r for r in results if r is not None]
        if len(errors) == len(results):
            raise BootstrapError(
                f"could not reach any of {len(addrs)} bootstrap peers after "
                f"{attempts} attempts each: " + "; ".join(errors)
            )
        # Our own ID fills the deep buckets; the far ones fill from the traffic
        # we answer and from the periodic refresh. Refreshing every bucket here
        # would make each joiner talk to most of a small network.
        await self.find_nodes([self.routing_table.local_id])

    async def _rejoin_when_cut_off(self, addrs: list[str]) -> None:
        """Join again through the bootstrap peers while fewer than REJOIN_BELOW contacts
        are live. The table keeps contacts that fail (stale) when nothing replaces
        them, and most come back by themselves after an outage; this is for those
        that do not (a NATed contact whose relay address changed meanwhile)."""
        while True:
            await asyncio.sleep(self.rejoin_check)
            live = sum(1 for c in self.routing_table if c.failures == 0)
            if live >= REJOIN_BELOW:
                continue
            try:
                await self.bootstrap(addrs, attempts=1, quiet=True)
            except BootstrapError as e:
                log.debug("rejoining through the bootstrap peers: %s", e)
                continue
            log.info("%d live DHT contacts: joined again through the bootstrap peers "
                     "(%d contacts now)", live, len(self.routing_table))  # fmt: skip

    async def _bootstrap_one(
        self, addr: Multiaddr, attempts: int, backoff: float, quiet: bool = False
    ) -> str | None:
        error = ""
        for attempt in range(attempts):
            if attempt:
                await asyncio.sleep(backoff * 2 ** (attempt - 1))
            try:
                async with asyncio.timeout(self.hop_timeout * 2):
                    conn = await self.host.connect(addr, timeout=self.hop_timeout)
                    peer = conn.remote_peer
                    reply = await rpc.call(
                        self.host,
                        peer,
                        self.protocol,
                        "ping",
                        self.hello(),
                        timeout=self.hop_timeout,
                    )
                addrs = self._reply_addrs(peer, reply) or (addr,)
                self.add_contact(peer, addrs, replace=True, observed_ip=self._observed_ip(peer))
                return None
            except (TransportError, TimeoutError, OSError, DHTProtocolError, PeerBusy) as e:
                error = f"{addr}: {type(e).__name__}: {e}"
                # Another peer answers there, or one whose protocol we cannot speak:
                # retrying cannot help.
                hopeless = isinstance(e, PeerIDMismatch | IncompatibleProtocol)
                final = attempt + 1 == attempts or hopeless
                # Said while it happens: a joiner must not sit silent for half a minute.
                log.log(
                    logging.DEBUG if quiet else logging.INFO,
                    "bootstrap peer %s: %s (attempt %d of %d%s)",
                    addr,
                    _reason(e),
                    attempt + 1,
                    attempts,
                    "" if final else f", next in {backoff * 2**attempt:.0f}s",
                )
                if hopeless:
                    break
        return error

    # ------------------------------------------------------------------ public API

    async def store(
        self, key: str, value: Any, expiration: float, subkey: str | None = None
    ) -> bool:
        """Store `value` (msgpack-able) under `key` (and `subkey`) until `expiration`
        (UNIX time) on the `replication` closest peers; republished until it expires."""
        (ok,) = await self.store_many([(key, value, expiration, subkey)])
        return ok

    async def store_many(
        self, items: Iterable[tuple[str, Any, float] | tuple[str, Any, float, str | None]]
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
            ttl = r.expiration - now
            self._originated[(r.key, r.subkey)] = (r, now + min(0.8 * ttl, self.republish_interval))
        self._wake.set()
        return await self._store_records(records)

    async def get(
        self, key: str, *, latest: bool = False, within: float | None = None
    ) -> DHTValue | None:
        """The value of `key` merged from several replicas, or None.

        `latest`: ask every one of the k closest peers instead of stopping at
        `value_quorum` holders (slower, but sees a write that reached few peers).
        `within`: seconds; the lookup stops then and the value is merged from the
        replicas that answered by then (a partial read: a caller that merges
        reads, such as one of owner-signed subkeys, loses nothing by it), where
        a timeout around the call would give nothing at all.
        """
        return (await self.get_many([key], latest=latest, within=within))[key]

    async def get_many(
        self, keys: Iterable[str], *, latest: bool = False, within: float | None = None
    ) -> dict[str, DHTValue | None]:
        """Several values in one traversal."""
        keys = list(dict.fromkeys(keys))
        found = await self._find_values(keys, latest=latest, within=within)
        return {k: (_to_value(found[k]) if found.get(k) else None) for k in keys}

    async def find_nodes(self, targets: Sequence[int]) -> list[LookupResult]:
        """Iterative lookups of the k closest peers to each 256-bit target, together."""
        lookups = [KeyLookup(t) for t in dict.fromkeys(targets)]
        await self._traverse(lookups, self._query_find_node)
        # Fewer than k peers answered and at least as many failed: more like a burst
        # of timeouts on our side (a loaded machine, a GC pause), which blacklists a
        # whole neighbourhood at once, than like dead peers. Look once more, asking
        # the peers the blacklist would skip, and keep the answers of both. A healthy
        # lookup, or a small network with a dead peer, still costs one traversal.
        retry = {id(lk): KeyLookup(lk.target) for lk in lookups if self._mostly_failed(lk)}
        if retry:
            self._counters["node_retries"] += len(retry)
            await self._traverse(
                list(retry.values()), self._query_find_node, skip_blacklisted=False
            )
        results = []
        for lk in lookups:
            again = retry.get(id(lk))
            if again is not None:
                seen = {c.peer_id for c in lk.answered}
                lk.answered += [c for c in again.answered if c.peer_id not in seen]
                lk.hops = max(lk.hops, again.hops)
            results.append(LookupResult(lk.target, lk.closest_answered(self.k), lk.hops))
        return results

    def _mostly_failed(self, lk: KeyLookup) -> bool:
        # Failed, or still pending when the lookup ended (stalled): not answered.
        unanswered = sum(1 for state in lk.state.values() if state != ANSWERED)
        if not lk.answered and self._skipped_all(lk):
            return True
        return unanswered > 0 and len(lk.answered) <= unanswered and len(lk.answered) < self.k

    def _skipped_all(self, lk: KeyLookup) -> bool:
        """No peer answered `lk`, and known peers near its target are blacklisted."""
        if lk.answered:
            return False
        nearest = self.routing_table.nearest(lk.target, self.k)
        return any(self._blocked(c.peer_id) for c in nearest)

    async def find_node(self, target: int) -> LookupResult:
        return (await self.find_nodes([target]))[0]

    def stats(self) -> dict[str, Any]:
        now = self._loop.time()
        return {
            "peer_id": self.peer_id.to_base58(),
            "routing_table_size": len(self.routing_table),
            "blacklisted": sum(1 for t in self._blacklist.values() if t > now),
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
                hello = {"from": [str(a) for a in self._addresses()]}
            self._hello_cache = (now, hello)
        return self._hello_cache[1]

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
        self._counters["requests_sent"] += 1
        hop = self._hop_timeout(peer)
        async with asyncio.timeout(hop):
            reused = self.host.connection(peer) is not None
            if not reused:
                await self.host.connect(peer, addrs, timeout=hop)
            if self.max_connections is not None:
                self._dialed.pop(peer, None)
                self._dialed[peer] = None
                self._prune_connections()
            try:
                reply = await rpc.call(self.host, peer, self.protocol, method, payload, timeout=hop)
            except (ConnectionLost, StreamReset) as e:
                if not reused or isinstance(e, ProtocolNotSupported):
                    raise
                # The idle connection we reused was being closed by either side
                # (connection pruning) as the request went out. That says nothing
                # about the peer, and every DHT request is idempotent: ask again on
                # a fresh connection, within the same deadline.
                self._counters["requests_redialed"] += 1
                await self.host.connect(peer, addrs, timeout=hop)
                reply = await rpc.call(self.host, peer, self.protocol, method, payload, timeout=hop)
        if isinstance(reply, dict) and reply.get("busy") is True:
            retry = reply.get("retry_after")
            retry = float(retry) if isinstance(retry, int | float) else 1.0
            raise PeerBusy(peer, min(max(retry, _BUSY_BLOCK[0]), _BUSY_BLOCK[1]))
        return reply

    def _hop_timeout(self, peer: PeerID) -> float:
        """`hop_timeout`, or longer for a far peer: a request on a connection takes a
        few RTTs (a stream, its protocol, the answer), a dial a few more (TCP, Noise).
        The RTT is the connection's, else the median of our other connections' (our
        own access link is usually what makes everyone far)."""
        conn = self.host.connection(peer)
        rtt = conn.rtt if conn is not None else None
        if rtt is None:
            rtt = self._typical_rtt()
        rtts = REQUEST_RTTS if conn is not None else DIAL_RTTS
        return min(max(self.hop_timeout, rtts * rtt + 0.25), MAX_HOP_TIMEOUT)

    def _typical_rtt(self) -> float:
        """The median RTT of our connections (0 before any is measured)."""
        known = sorted(c.rtt for c in self.host.connections.values() if c.rtt is not None)
        return known[len(known) // 2] if known else 0.0

    def _prune_connections(self) -> None:
        assert self.max_connections is not None
        excess = len(self._dialed) - self.max_connections
        for peer in list(self._dialed):
            if excess <= 0:
                break
            del self._dialed[peer]
            excess -= 1
            conn = self.host.connection(peer)
            if conn is not None and not conn.streams:
                self._tasks.spawn(self.host.disconnect(peer))

    def _reply_addrs(self, peer: PeerID, reply: object) -> tuple[Multiaddr, ...]:
        if not isinstance(reply, dict):
            raise DHTProtocolError("reply must be a map")
        return parse_addrs(peer, reply.get("from", []))

    def _blocked(self, peer: PeerID) -> bool:
        until = self._blacklist.get(peer)
        if until is None:
            return False
        if until <= self._loop.time():
            del self._blacklist[peer]
            return False
        return True

    def _on_failure(self, cand: Candidate, exc: BaseException) -> None:
        now = self._loop.time()
        if isinstance(exc, PeerBusy):
            # Up, and throttling us: skip it for a moment; no failure in the table.
            self._counters["busy_answers"] += 1
            self._blacklist[cand.peer_id] = now + exc.retry_after
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
        self._blacklist[cand.peer_id] = now + self.blacklist_for
        self.routing_table.mark_failed(cand.peer_id, now)
        if len(self._blacklist) > 4096:  # bounded: drop expired entries
            self._blacklist = {p: t for p, t in self._blacklist.items() if t > now}

    def _answered(self, cand: Candidate) -> None:
        # We reached it at these addresses: it is a verified contact, and its group
        # is that of the IP we reached, whatever it was advertised with.
        ip = self._observed_ip(cand.peer_id)
        if ip is not None:
            cand.group = self.diversity.group_of_ip(ip)
        self.add_contact(cand.peer_id, cand.addrs, replace=False, observed_ip=ip)

    async def _query_find_node(
        self, cand: Candidate, lookups: list[KeyLookup]
    ) -> list[list[WireContact]]:
        ids = [lk.target.to_bytes(ID_BYTES, "big") for lk in lookups]
        reply = await self._request(
            cand.peer_id, cand.addrs, "find_node", {**self.hello(), "ids": ids}
        )
        _, per_key = parse_nearest(
            reply, len(ids), self.k, local=self.peer_id, responder=cand.peer_id
        )
        self._answered(cand)
        return per_key

    async def _query_find_value(
        self, cand: Candidate, lookups: list[KeyLookup]
    ) -> list[list[WireContact]]:
        keys = [lk.key for lk in lookups]
        assert all(k is not None for k in keys)
        reply = await self._request(
            cand.peer_id, cand.addrs, "find_value", {**self.hello(), "keys": keys}
        )
        response, per_key = parse_nearest(
            reply, len(keys), self.k, local=self.peer_id, responder=cand.peer_id
        )
        values = parse_values(response, keys)  # type: ignore[arg-type]
        self._answered(cand)
        for lk in lookups:
            records = values.get(lk.key)  # type: ignore[arg-type]
            if records:
                lk.records.extend(records)
                lk.holders.append(cand)
        return per_key

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
            stall_after=max(self.stall_after, 2 * self._typical_rtt()),
            on_failure=self._on_failure,
            blocked=blocked,
            max_in_flight=max(self.alpha, min(64, self.alpha * len(lookups))),
            group_of=self.diversity.group_of_addrs,
        )
        for lk in lookups:
            self._max_hops = max(self._max_hops, lk.hops)

    async def _find_values(
        self, keys: list[str], *, latest: bool, within: float | None = None
    ) -> dict[str, StoredValue]:
        until = None if within is None else self._loop.time() + within
        now = time.time()
        local = self.storage.get_many(keys, now)
        lookups = []
        for key in keys:
            lk = KeyLookup(key_id(key), key, quorum=None if latest else self.value_quorum)
            held = local.get(key)
            if held is not None:
                lk.records.extend(held.records())
                lk.holders.append(Candidate(self.peer_id, self.routing_table.local_id, (), 0))
            lookups.append(lk)
        if not await self._traverse_until(until, lookups, self._query_find_value):
            return self._merge_found(lookups)  # out of time: what answered so far
        # A key found nowhere while some of the peers asked for it failed (a timeout
        # on a loaded machine, a GC pause): look once more, asking peers that the
        # blacklist would skip. A miss is where a second try is worth its cost; in a
        # healthy network a missing key still costs one traversal.
        # So is one that skipped blacklisted peers nearer the key than the ones that
        # answered: after one timeout, a peer that knows only its bootstrap peer
        # would see nothing for `blacklist_for` seconds (a joiner then finds no
        # experiment); after a stall that timed out a lookup's final round (k
        # requests at once), the key's holders are all blacklisted, and the lookup
        # converges on the peers just past them, which hold nothing.
        retry = [
            KeyLookup(lk.target, lk.key, quorum=lk.quorum)
            for lk in lookups
            if not lk.records
            and (any(st == FAILED for st in lk.state.values()) or lk.skipped_near(self.k))
        ]
        if retry:
            self._counters["value_retries"] += len(retry)
            lookups += retry
            await self._traverse_until(until, retry, self._query_find_value, skip_blacklisted=False)
        return self._merge_found(lookups)

    async def _traverse_until(
        self, until: float | None, lookups: list[KeyLookup], query: Any, **kw: Any
    ) -> bool:
        """`_traverse`, stopped at loop time `until` (None: never); whether it ended
        before then. What the lookups gathered stays in them either way."""
        if until is None:
            await self._traverse(lookups, query, **kw)
            return True
        try:
            async with asyncio.timeout_at(until):
                await self._traverse(lookups, query, **kw)
        except TimeoutError:
            self._counters["partial_reads"] += 1
            return False
        return True

    def _merge_found(self, lookups: list[KeyLookup]) -> dict[str, StoredValue]:
        now = time.time()
        out: dict[str, StoredValue] = {}
        for lk in lookups:
            assert lk.key is not None
            merged = merge_records(lk.key, lk.records, now, self.validator)
            if merged is None:
                continue
            out[lk.key] = merged
            if self.cache_along_path:
                self._cache(lk, merged)
        return out

    def _cache(self, lk: KeyLookup, merged: StoredValue) -> None:
        """Store what was found at the closest answering peer that lacked it, so
        that the next reader's lookup ends earlier (Kademlia's caching)."""
        holders = {c.peer_id for c in lk.holders}
        lacking = [c for c in lk.closest_answered(self.k) if c.peer_id not in holders]
        records = [r for r in merged.records() if not self.validator.is_capped(r, time.time())]
        if lacking and records:
            self._counters["cached"] += 1
            self._tasks.spawn(self._send_store(lacking[0], records))

    async def _send_store(self, cand: Candidate, records: list[Record]) -> list[bool] | None:
        """Per record, whether `cand` stored it; None when it could not be reached."""
        try:
            reply = await self._request(
                cand.peer_id,
                cand.addrs,
                "store",
                {**self.hello(), "records": [r.to_wire() for r in records]},
            )
            return parse_stored(reply, len(records))
        except (TransportError, TimeoutError, OSError, DHTProtocolError, PeerBusy) as e:
            self._on_failure(cand, e)
            return None

    async def _store_records(self, records: list[Record]) -> list[bool]:
        """Send each record to the `replication` closest peers of its key (us included).

        The lookup settles once the `alpha` closest candidates answered; the
        store requests then go to the closest candidates not known dead, and a
        peer that cannot be reached is replaced by the next closest (up to
        `_STORE_ROUNDS` rounds). That saves the lookup's final round, which
        would only have proved the same peers alive.
        """
        by_key: dict[str, list[int]] = {}
        for i, r in enumerate(records):
            by_key.setdefault(r.key, []).append(i)
        lookups = [KeyLookup(key_id(key), key, settle=self.alpha) for key in by_key]
        await self._traverse(lookups, self._query_find_node)
        local_id = self.routing_table.local_id
        counts = [0] * len(records)
        now = time.time()
        queue: dict[str, list[Candidate]] = {}
        missing: dict[str, int] = {}
        for lk in lookups:
            assert lk.key is not None
            idxs = by_key[lk.key]
            closest = lk.closest_live(2 * self.replication)
            missing[lk.key] = self.replication
            near = closest[: self.replication]
            if len(near) < self.replication or (local_id ^ lk.target) < (
                near[-1].node_id ^ lk.target
            ):
                # we are among the closest ourselves: keep a replica
                missing[lk.key] -= 1
                for i in idxs:
                    try:
                        counts[i] += self.storage.store(records[i], now)
                    except RecordError:
                        pass
            queue[lk.key] = closest
        for _ in range(_STORE_ROUNDS):
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
                *(self._send_store(c, [records[i] for i in idxs]) for c, _, idxs in sends)
            )
            for (_, keys, idxs), oks in zip(sends, results, strict=True):
                if oks is None:
                    continue  # unreachable: the next round asks the next closest
                for key in keys:
                    missing[key] -= 1
                for i, ok in zip(idxs, oks, strict=True):
                    counts[i] += ok
        return [c >= self.store_quorum for c in counts]

    # ------------------------------------------------------------------ maintenance

    def addresses_changed(self) -> None:
        """What we advertise changed (e.g. NAT traversal found us public): tell the
        peers nearest to us soon, so that they add (or update) us in their tables;
        until our next request nobody would. At most once per ANNOUNCE_INTERVAL."""
        self._announce_due = True
        self._hello_cache = None  # the next request carries the new addresses
        self._wake.set()

    async def _announce(self) -> None:
        self._announce_due = False
        self._announced_at = self._loop.time()
        if self._serves is not None and not self._serves():
            return  # a client is in nobody's table
        try:
            await self.find_nodes([self.routing_table.local_id])
        except Exception as e:
            log.debug("announcing our new addresses failed: %r", e)

    async def _maintenance(self) -> None:
        """Refresh stale buckets, republish our own records and announce new addresses
        when due."""
        next_refresh = self._loop.time() + self.refresh_interval
        while True:
            now_wall = time.time()
            due_republish = min((t for _, t in self._originated.values()), default=None)
            wait = next_refresh - self._loop.time()
            if due_republish is not None:
                wait = min(wait, due_republish - now_wall)
            if self._announce_due:
                announce_at = self._announced_at + ANNOUNCE_INTERVAL
                if announce_at <= self._loop.time():
                    await self._announce()
                    continue
                wait = min(wait, announce_at - self._loop.time())
            if wait > 0:
                self._wake.clear()
                try:
                    async with asyncio.timeout(wait):
                        await self._wake.wait()
                    continue  # something changed: recompute
                except TimeoutError:
                    pass
            await self._republish()
            if self._loop.time() >= next_refresh:
                await self._refresh()
                next_refresh = self._loop.time() + self.refresh_interval

    async def _republish(self) -> None:
        now = time.time()
        due = []
        for name, (record, at) in list(self._originated.items()):
            if record.expiration <= now:
                del self._originated[name]
            elif at <= now:
                due.append(record)
                ttl = record.expiration - now
                self._originated[name] = (record, now + min(0.8 * ttl, self.republish_interval))
        if due:
            self._counters["republished"] += len(due)
            try:
                await self._store_records(due)
            except Exception as e:  # a failed round is retried at the next due time
                log.warning("republishing %d records failed: %r", len(due), e)

    async def _refresh(self) -> None:
        now = self._loop.time()
        targets = self.routing_table.buckets_to_refresh(now, self.refresh_interval)
        if not targets:
            return
        try:
            await self.find_nodes(targets)
        except Exception as e:
            log.warning("bucket refresh failed: %r", e)
            return
        now = self._loop.time()
        for t in targets:
            self.routing_table.touch_bucket_for(t, now)
