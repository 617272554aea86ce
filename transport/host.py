"""The host: listens, dials, keeps one connection per peer and routes streams to handlers."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from .access import AccessControl
from .admission import Admission, AdmissionLimits
from .connection import Connection, ConnectionConfig, Stream
from .connection_table import ConnectionCallback, ConnectionTable, ExpectedPunches, OrderedSet
from .dialing import Dialer, TcpDialer, resolve
from .errors import (
    ConnectionLost,
    DialError,
    PeerBlocked,
)
from .handlers import StreamHandler, StreamRouter
from .identity import Identity, PeerID
from .listening import ListenFailed, interface_addresses, listen
from .multiaddr import Multiaddr
from .remote_log import RemoteEvents
from .tasks import TaskSet
from .trimming import Trimmer, TrimPolicy
from .version import VersionGate

log = logging.getLogger("shoal.transport")


DEFAULT_PORT = 31337
DEFAULT_LISTEN = (f"/ip4/0.0.0.0/tcp/{DEFAULT_PORT}", f"/ip6/::/tcp/{DEFAULT_PORT}")


@dataclass(frozen=True, slots=True)
class HostConfig:
    listen: tuple[str, ...] = DEFAULT_LISTEN
    announce: tuple[str, ...] = ()  # advertised instead of the detected addresses
    dial_timeout: float = 10.0
    max_connections: int = 1024  # established (authenticated) ones; see transport/admission.py
    max_connections_per_ip: int = 32
    max_connections_per_subnet: int = 256  # inbound, per /24 (IPv4) or /48 (IPv6)
    # Half-open (handshaking) inbound connections have slots of their own, so a flood
    # of them cannot lock honest peers out of the established ones.
    max_pending_handshakes: int = 256
    max_pending_per_ip: int = 16
    max_pending_per_subnet: int = 64
    # At max_connections, handshakes still run in case their peer is a round's member
    # (`protecting`), established past the limit only if it is (transport/admission.py).
    max_pending_at_limit: int = 8
    # Loopback is exempt from the caps above other than max_connections(_per_ip):
    # tests run whole swarms on 127.0.0.1.
    admission_exempt_loopback: bool = True
    close_grace: float = 5.0  # how long shutdown waits for open streams
    # Dial from the listen port (SO_REUSEPORT on listeners and dialing sockets): the NAT
    # then maps every outgoing connection to one public port, which peers observe and
    # which TCP hole punching relies on. NAT traversal (transport.nat) needs it.
    reuse_port: bool = False
    connection: ConnectionConfig = field(default_factory=ConnectionConfig)
    # Past `trim.high_water` established connections, the ones idle longest (at least
    # `trim.grace` s) are closed down to `trim.low_water` (transport/trimming.py),
    # before `max_connections`, past which everyone is refused. None: from 3/4 of
    # `max_connections` down to half.
    trim: TrimPolicy | None = None

    def __post_init__(self) -> None:
        if self.trim is not None and self.trim.high_water > self.max_connections:
            raise ValueError("trim.high_water must be at most max_connections (0: never trim)")

    @property
    def trim_policy(self) -> TrimPolicy:
        return self.trim or TrimPolicy.for_limit(self.max_connections)


class Host:
    """A peer's network endpoint: one secure multiplexed connection per remote peer."""

    def __init__(
        self,
        identity: Identity,
        config: HostConfig | None = None,
        *,
        access: AccessControl | None = None,
    ) -> None:
        self.identity = identity
        self.peer_id: PeerID = identity.peer_id
        self.config = config or HostConfig()
        # Private swarms (transport/access.py): every connection this host makes or
        # accepts, relayed and hole-punched ones included, is built in _new_connection
        # and so runs the handshake under these rules.
        self.access = access or AccessControl()
        self._router = StreamRouter(lambda: self.remote_events)
        self._servers: list[asyncio.Server] = []
        self._listen_addrs: list[Multiaddr] = []
        self._table = ConnectionTable(self.peer_id, self.config.close_grace)
        self._blocked: dict[PeerID, str] = {}  # peer -> why (Host.block)
        self.admission = _admission_for(self.config)
        self._dials: dict[PeerID, asyncio.Future[Connection]] = {}
        self._closing = False
        self.connections_trimmed = 0  # idle ones closed past the trim policy's high water
        self._trimmer = Trimmer(self.config.trim_policy)
        # Peers whose connections trimming leaves alone (`protecting`): a round's members.
        self._protected: Counter[PeerID] = Counter()
        # Log lines remote ends cause (refusals, handshake timeouts, violations, handler
        # failures), rate-limited and summarized per kind.
        self.remote_events = RemoteEvents(log)
        # Shared by every caller dialing the same peer, who each get its error; logged
        # at debug level only (and retrieved, should every caller have given up).
        self._dial_tasks = TaskSet(log, "dial", logging.DEBUG)
        self._dialer = TcpDialer(
            self.admission,
            self._new_connection,
            self.remote_events,
            max_connections=self.config.max_connections,
            reuse_port=self.config.reuse_port,
            listen_addrs=lambda: self._listen_addrs,
            blocked=self._blocked,
            current=self._table.conns.get,
            make_room=self._make_room,
            # A round's member is dialed past the limit, as it is let in past it.
            may_exceed=lambda peer: peer is not None and peer in self._protected,
        )
        self._address_provider: Callable[[], list[Multiaddr]] | None = None
        self._punches = ExpectedPunches()
        # Protocol versions (transport/version.py): the hello on every connection. Made
        # last, so that its connection listener is the first.
        self.versions = VersionGate(self, self._on_stream)

    # --- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        accept = lambda: self._new_connection(initiator=False)  # noqa: E731
        try:
            cfg = self.config
            await listen(cfg.listen, cfg.reuse_port, accept, self._servers, self._listen_addrs)
        except ListenFailed:
            await self.aclose()
            raise

    async def aclose(self) -> None:
        """Graceful shutdown: stop accepting, let open streams finish, then close."""
        if self._closing:
            return
        self._closing = True
        self.remote_events.flush()  # what was suppressed so far, rather than nothing
        for server in self._servers:
            server.close()
        self._dial_tasks.cancel()
        conns = list(self._all)
        await asyncio.gather(
            *(c.aclose(self.config.close_grace) for c in conns), return_exceptions=True
        )
        for server in self._servers:
            with contextlib.suppress(Exception):
                await server.wait_closed()

    async def __aenter__(self) -> Host:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # --- addresses ------------------------------------------------------------------------------

    @property
    def listen_addrs(self) -> list[Multiaddr]:
        """The addresses actually bound (ports resolved), unspecified hosts included."""
        return list(self._listen_addrs)

    def addresses(self, include_loopback: bool = True) -> list[Multiaddr]:
        """Dialable addresses of this host, each ending in /p2p/<peer id>.

        What peers are told (the DHT advertises these): `announce` when configured,
        else the address provider's (NAT traversal: confirmed public addresses and
        relay addresses) when one is set, else the interface addresses.
        """
        if self.config.announce:
            return [Multiaddr(a).with_peer_id(self.peer_id) for a in self.config.announce]
        if self._address_provider is not None:
            provided = self._address_provider()
            if not include_loopback:
                provided = [a for a in provided if not a.is_loopback]
            return [a.with_peer_id(self.peer_id) for a in dict.fromkeys(provided)]
        return self.interface_addresses(include_loopback)

    def interface_addresses(self, include_loopback: bool = True) -> list[Multiaddr]:
        """The listen addresses with 0.0.0.0/:: expanded to this machine's interface IPs."""
        return interface_addresses(self._listen_addrs, self.peer_id, include_loopback)

    def set_address_provider(self, provider: Callable[[], list[Multiaddr]] | None) -> None:
        """Let `provider()` decide what `addresses()` advertises (None: the default)."""
        self._address_provider = provider

    # --- extension hooks ----------------------------------------------------------------------

    def add_connection_listener(
        self, opened: ConnectionCallback | None = None, closed: ConnectionCallback | None = None
    ) -> Callable[[], None]:
        """Call `opened(conn)` after every successful handshake (duplicates and relayed
        connections included) and `closed(conn)` when such a connection ends. The
        callbacks run synchronously in the event loop and must not block. Returns a
        function that removes them."""
        return self._table.add_listener(opened, closed)

    def add_dialer(self, can_dial: Callable[[Multiaddr], bool], dial: Dialer) -> None:
        """Dial addresses that are not direct TCP (e.g. relayed ones) with `dial`."""
        self._dialer.dialers.append((can_dial, dial))

    def new_connection(
        self,
        *,
        initiator: bool,
        expected: PeerID | None = None,
        kind: str = "direct",
        outbound: bool | None = None,
    ) -> Connection:
        """A Connection wired to this host (handlers, limits, events), for a caller that
        brings its own transport: it calls `conn.connection_made(transport)`."""
        return self._new_connection(
            initiator=initiator, expected=expected, kind=kind, outbound=outbound
        )

    async def dial_from_listen_port(
        self,
        endpoint: tuple[str, int],
        peer: PeerID,
        *,
        initiator: bool,
        kind: str = "hole-punched",
        timeout: float = 5.0,
    ) -> Connection:
        """A TCP connection from our listen port to `endpoint`, with a fixed handshake role.

        Hole punching: both peers dial each other from their listen ports at once; the
        SYNs open the NAT mappings and the kernel makes one connection out of the two
        (TCP simultaneous open), so which side "dialed" is meaningless and the role
        comes from the caller. No fallback to another port: it would not punch.
        """
        async with asyncio.timeout(timeout):
            return await self._dialer.dial_one(
                endpoint, peer, initiator=initiator, kind=kind, reuse="require"
            )

    def expect_inbound(
        self, ip: str, peer: PeerID, *, initiator: bool, port: int | None = None
    ) -> Callable[[], None]:
        """Until the returned function is called, an inbound connection from `ip` (and
        `port`, when given: peers behind one address are told apart by it) is taken as
        a hole punch from `peer` in which we play handshake role `initiator`."""
        return self._punches.expect(ip, peer, initiator=initiator, port=port)

    # --- handlers -------------------------------------------------------------------------------

    def set_handler(self, protocol: str, handler: StreamHandler) -> None:
        """Serve `protocol` (e.g. "/shoal/dht/1.0.0") with `handler(stream)`."""
        if not protocol.startswith("/"):
            raise ValueError(f"protocol names look like /shoal/<name>/<version>, got {protocol!r}")
        self._router.handlers[protocol] = handler

    def remove_handler(self, protocol: str) -> None:
        self._router.handlers.pop(protocol, None)

    @property
    def protocols(self) -> list[str]:
        return sorted(self._router.handlers)

    # --- connections ----------------------------------------------------------------------------

    @property
    def _conns(self) -> dict[PeerID, Connection]:
        return self._table.conns

    @property
    def _all(self) -> OrderedSet[Connection]:
        """Every connection, handshaking and superseded ones included."""
        return self._table.all

    @property
    def connections(self) -> dict[PeerID, Connection]:
        return dict(self._conns)

    def open_connections(self) -> list[Connection]:
        """Every open, authenticated connection, duplicates (e.g. a relayed connection
        being replaced by a direct one) included."""
        return [c for c in self._all if c.is_open]

    def connection(self, peer: PeerID) -> Connection | None:
        conn = self._conns.get(peer)
        return conn if conn is not None and conn.accepting_streams else None

    async def connect(
        self,
        target: PeerID | Multiaddr | str,
        addrs: Iterable[Multiaddr | str] = (),
        *,
        timeout: float | None = None,
    ) -> Connection:
        """A connection to the peer: the existing one, or a new dial.

        `target` is a peer ID (dialed at `addrs`) or an address; an address with
        /p2p/ID is checked against the ID the handshake meets.
        """
        peer, candidates = resolve(target, addrs, self.peer_id)
        if peer is not None and peer in self._blocked:
            raise PeerBlocked(f"{peer.short()} is blocked: {self._blocked[peer]}")
        if peer is not None:
            existing = self.connection(peer)
            if existing is not None:
                wait = self.config.dial_timeout if timeout is None else timeout
                return await self.versions.checked(existing, wait)
            pending = self._dials.get(peer)
            if pending is not None:
                return await asyncio.shield(pending)
        if self._closing:
            raise DialError("host is shutting down")
        if not candidates:
            raise DialError(f"no address known for {peer}")
        timeout = self.config.dial_timeout if timeout is None else timeout
        task = self._dial_tasks.spawn(self._dial_checked(peer, candidates, timeout))
        if peer is not None:
            self._dials[peer] = task  # type: ignore[assignment]
        try:
            return await asyncio.shield(task)
        finally:
            if peer is not None and self._dials.get(peer) is task:
                del self._dials[peer]

    async def _dial_checked(
        self, peer: PeerID | None, candidates: list[Multiaddr], timeout: float
    ) -> Connection:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        conn = await self._dialer.dial_any(peer, candidates, timeout)
        # The remote's protocol version comes one round trip after the handshake: an
        # incompatible peer fails the dial with both versions (IncompatibleProtocol).
        return await self.versions.checked(conn, deadline - loop.time())

    async def open_stream(
        self,
        target: PeerID | Multiaddr | str,
        protocol: str,
        addrs: Iterable[Multiaddr | str] = (),
        *,
        timeout: float | None = None,
    ) -> Stream:
        conn = await self.connect(target, addrs, timeout=timeout)
        return await conn.open_stream(protocol)

    async def ping(self, peer: PeerID, timeout: float = 10.0) -> float:
        conn = self.connection(peer)
        if conn is None:
            raise ConnectionLost(f"not connected to {peer}")
        return await conn.ping(timeout)

    def block(self, peer: PeerID, reason: str) -> None:
        """Refuse every connection with `peer` from now on, both ways (a connection
        gate, as libp2p's): dials raise PeerBlocked, its inbound connections close
        after the handshake names it, and the open one closes now. For peers convicted
        of cheating: nothing built on this host needs to check for them."""
        self._blocked[peer] = reason
        for conn in list(self._all):
            if conn.remote_peer == peer:
                conn.abort(f"peer blocked: {reason}")

    def blocked(self) -> dict[PeerID, str]:
        """The blocked peers and why."""
        return dict(self._blocked)

    async def disconnect(self, peer: PeerID) -> None:
        conn = self._conns.get(peer)
        if conn is not None:
            await conn.aclose(self.config.close_grace)

    def stats(self) -> dict[str, object]:
        conns = [c for c in self._all if c.is_open]
        return {
            "peer_id": str(self.peer_id),
            "connections": [c.stats() for c in conns],
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "connections_trimmed": self.connections_trimmed,
        }

    @property
    def bytes_sent(self) -> int:
        """Bytes written to the network since start (every connection, closed ones too)."""
        return self._table.bytes_sent()

    @property
    def bytes_received(self) -> int:
        return self._table.bytes_received()

    def bytes_sent_by_protocol(self) -> dict[str, int]:
        """Stream payload sent since start, by the protocol each stream was opened for
        (closed connections too). Frame headers, encryption and handshakes are in
        `bytes_sent` only: the two differ by a few percent of small messages."""
        return self._table.sent_by_protocol()

    # --- internals ------------------------------------------------------------------------------

    def _new_connection(
        self,
        *,
        initiator: bool,
        expected: PeerID | None = None,
        kind: str = "direct",
        outbound: bool | None = None,
    ) -> Connection:
        conn = Connection(
            self.identity,
            initiator=initiator,
            expected_peer=expected,
            config=self.config.connection,
            on_stream=self._on_stream,
            on_closed=self._on_closed,
            admit=self._admit,
            outbound=outbound,
            kind=kind,
            remote_events=self.remote_events,
            access=self.access,
            keep_open=self._is_protected,
        )
        conn.handshake_done.add_done_callback(lambda fut: self._on_handshake(conn, fut))
        return conn

    def _admit(self, conn: Connection) -> str | None:
        ip = self._ip_key(conn)
        if self._closing:
            return "host is shutting down"
        if not conn.outbound:
            self._make_room()
        verdict = self.admission.admit(
            conn, ip, inbound=not conn.outbound, now=asyncio.get_running_loop().time()
        )
        if verdict.refusal is not None:
            return verdict.refusal
        for old in verdict.evict:
            assert isinstance(old, Connection)
            old.abort("half-open connection evicted: handshake slots full")
        self._punches.claim(conn)
        self._table.all.add(conn)
        return None

    @staticmethod
    def _ip_key(conn: Connection) -> str | None:
        # Relayed connections all come from the relay: the relay enforces their limits.
        if conn.kind == "relayed":
            return None
        return conn.remote_address[0] if conn.remote_address else "?"

    def _on_handshake(self, conn: Connection, fut: asyncio.Future[PeerID]) -> None:
        if fut.cancelled() or fut.exception() is not None:
            return
        if not conn.outbound:  # (its handshake took a while: the slots may have filled)
            self._make_room()
        refusal = self.admission.established(conn, protected=conn.remote_peer in self._protected)
        if refusal is not None:
            self.remote_events.info(
                "connection refused",
                conn.remote_key(),
                "refusing connection from %s after its handshake: %s",
                conn.remote_peer.short(),
                refusal,
            )
            conn.abort(refusal)
            return
        reason = self._blocked.get(conn.remote_peer)
        if reason is not None:
            conn.abort(f"peer blocked: {reason}")
            return
        self._table.register(conn)
        self._table.notify(conn, opened=True)
        self._trim()

    def _trim(self) -> None:
        """Past the trim policy's high water, close the connections idle longest."""
        now = asyncio.get_running_loop().time()
        for conn in self._trimmer.pick(len(self._all), self._established, now):
            self._close_trimmed(conn, "trimmed")

    def _make_room(self) -> None:
        """At `max_connections`: close the connection idle longest (transport/trimming.py)
        so that the one arriving takes its slot instead of being refused."""
        if self.admission.established_count < self.config.max_connections:
            return
        if not self.admission.can_drain:
            return
        victim = self._trimmer.room(self._established, asyncio.get_running_loop().time())
        if victim is not None:
            self._close_trimmed(victim, "trimmed at the connection limit")

    def _established(self) -> list[Connection]:
        """The connections trimming may close: not those closing already (retired
        duplicates, idle or trimmed ones draining), nor a protected peer's."""
        protected = self._protected
        return [c for c in self._all if c.accepting_streams and c.remote_peer not in protected]

    @contextlib.contextmanager
    def protecting(self, peers: Iterable[PeerID]) -> Iterator[None]:
        """Within this block, trimming (past the high water, or at the limit) and the
        idle close leave the connections to `peers` open even when idle, as libp2p's
        `Protect` does: a
        round's members, whose connections go quiet between its phases (a member
        waits for a slower one's part) and whose redial would abort the round when
        the other end is at its limit. And at `max_connections`, where nothing idle
        makes room, they are still dialed and let in (transport/admission.py): a
        host holds at most its limit plus its rounds' members. Nests; counts per
        peer."""
        held = list(peers)
        self._protected.update(held)
        try:
            yield
        finally:
            self._protected.subtract(held)
            for peer in held:
                if self._protected[peer] <= 0:
                    del self._protected[peer]

    def _is_protected(self, conn: Connection) -> bool:
        return conn.remote_peer is not None and conn.remote_peer in self._protected

    def _close_trimmed(self, conn: Connection, reason: str) -> None:
        self.connections_trimmed += 1
        conn.close_idle(reason)
        self.admission.draining(conn)  # its slot is free for the next one now

    def _on_closed(self, conn: Connection) -> None:
        if self._table.closed(conn):
            self.admission.closed(conn)
        hs = conn.handshake_done
        if hs.done() and not hs.cancelled() and hs.exception() is None:
            self._table.notify(conn, opened=False)

    def _on_stream(self, stream: Stream) -> None:
        if self.versions.hold(stream):  # the hello, or a stream waiting for it
            return
        self._router.route(stream, closing=self._closing)


def _admission_for(config: HostConfig) -> Admission:
    """The connection limits of `config`."""
    return Admission(
        AdmissionLimits(
            max_connections=config.max_connections,
            max_connections_per_ip=config.max_connections_per_ip,
            max_connections_per_subnet=config.max_connections_per_subnet,
            max_pending=config.max_pending_handshakes,
            max_pending_per_ip=config.max_pending_per_ip,
            max_pending_per_subnet=config.max_pending_per_subnet,
            exempt_loopback=config.admission_exempt_loopback,
            max_pending_at_limit=config.max_pending_at_limit,
        )
    )
