"""The host: listens, dials, keeps one connection per peer and routes streams to handlers."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

from .access import AccessControl
from .admission import Admission, AdmissionLimits
from .connection import Connection, ConnectionConfig, Stream
from .errors import (
    ConnectionLost,
    DialError,
    HandshakeError,
    LimitExceeded,
    PeerBlocked,
    PeerIDMismatch,
    TransportError,
)
from .identity import Identity, PeerID
from .interfaces import local_addresses
from .multiaddr import Multiaddr, MultiaddrError, from_socket_address
from .remote_log import RemoteEvents
from .tasks import TaskSet
from .version import VersionGate

log = logging.getLogger("shoal.transport")

StreamHandler = Callable[[Stream], Awaitable[None]]
ConnectionCallback = Callable[[Connection], None]
# A dialer for addresses the host cannot dial itself (e.g. /p2p-circuit through a relay):
# dial(address, expected peer or None, timeout) -> an authenticated Connection.
Dialer = Callable[[Multiaddr, "PeerID | None", float], Awaitable[Connection]]

# Listen failures that mean "this address family is not available here", as
# opposed to a real problem such as a port in use, which is always fatal.
_FAMILY_UNAVAILABLE = {errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT, errno.EPROTONOSUPPORT}

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
    # Loopback is exempt from the caps above other than max_connections(_per_ip):
    # tests run whole swarms on 127.0.0.1.
    admission_exempt_loopback: bool = True
    close_grace: float = 5.0  # how long shutdown waits for open streams
    # Dial from the listen port (SO_REUSEPORT on listeners and dialing sockets): the NAT
    # then maps every outgoing connection to one public port, which peers observe and
    # which TCP hole punching relies on. NAT traversal (transport.nat) needs it.
    reuse_port: bool = False
    connection: ConnectionConfig = field(default_factory=ConnectionConfig)


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
        self._handlers: dict[str, StreamHandler] = {}
        self._servers: list[asyncio.Server] = []
        self._listen_addrs: list[Multiaddr] = []
        self._conns: dict[PeerID, Connection] = {}
        self._all: set[Connection] = set()  # including handshaking and superseded ones
        self._blocked: dict[PeerID, str] = {}  # peer -> why (Host.block)
        # Bytes of connections already closed: the totals must not drop when one closes.
        self._closed_bytes_sent = 0
        self._closed_bytes_received = 0
        self.admission = Admission(
            AdmissionLimits(
                max_connections=self.config.max_connections,
                max_connections_per_ip=self.config.max_connections_per_ip,
                max_connections_per_subnet=self.config.max_connections_per_subnet,
                max_pending=self.config.max_pending_handshakes,
                max_pending_per_ip=self.config.max_pending_per_ip,
                max_pending_per_subnet=self.config.max_pending_per_subnet,
                exempt_loopback=self.config.admission_exempt_loopback,
            )
        )
        self._dials: dict[PeerID, asyncio.Future[Connection]] = {}
        self._closing = False
        # Log lines remote ends cause (refusals, handshake timeouts, violations, handler
        # failures), rate-limited and summarized per kind.
        self.remote_events = RemoteEvents(log)
        # Shared by every caller dialing the same peer, who each get its error; logged
        # at debug level only (and retrieved, should every caller have given up).
        self._dial_tasks = TaskSet(log, "dial", logging.DEBUG)
        self._listeners: list[tuple[ConnectionCallback | None, ConnectionCallback | None]] = []
        self._dialers: list[tuple[Callable[[Multiaddr], bool], Dialer]] = []
        self._address_provider: Callable[[], list[Multiaddr]] | None = None
        # Inbound connections we expect from a hole punch: (remote IP, port or None for
        # any) -> (peer, our handshake role). The punch fixes the roles over the relay.
        self._expected_inbound: dict[tuple[str, int | None], tuple[PeerID, bool]] = {}
        # Protocol versions (transport/version.py): the hello on every connection. Made
        # last, so that its connection listener is the first.
        self.versions = VersionGate(self, self._on_stream)

    # --- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        errors = []
        for text in self.config.listen:
            addr = Multiaddr(text)
            endpoint = addr.tcp_endpoint()
            if endpoint is None or addr.is_relayed:
                raise MultiaddrError(f"cannot listen on {text!r}: not a direct TCP address")
            host, port = endpoint
            family = socket.AF_INET6 if addr.family == "ip6" else socket.AF_INET
            try:
                if self.config.reuse_port:
                    server = await loop.create_server(
                        lambda: self._new_connection(initiator=False),
                        sock=_reuse_port_listener(family, host, port),
                        backlog=1024,
                    )
                else:
                    server = await loop.create_server(
                        lambda: self._new_connection(initiator=False),
                        host,
                        port,
                        family=family,
                        reuse_address=True,
                        backlog=1024,
                    )
            except OSError as e:
                if e.errno in _FAMILY_UNAVAILABLE:
                    # e.g. no IPv6 inside a container: serve on the other family.
                    errors.append(f"{text}: {e.strerror or e}")
                    continue
                await self.aclose()
                raise OSError(e.errno, f"cannot listen on {text}: {e.strerror or e}") from None
            self._servers.append(server)
            for sock in server.sockets:
                bound_host, bound_port = sock.getsockname()[:2]
                self._listen_addrs.append(from_socket_address(bound_host, bound_port))
        if not self._servers and self.config.listen:
            raise OSError(f"could not listen on any address: {'; '.join(errors)}")
        for err in errors:
            log.warning("not listening on %s", err)

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
        out: list[Multiaddr] = []
        for addr in self._listen_addrs:
            if addr.is_unspecified:
                _, port = addr.tcp_endpoint()  # type: ignore[misc]
                family = "ip6" if addr.family == "ip6" else "ip4"
                for ip in local_addresses(family):
                    out.append(from_socket_address(ip, port))
            else:
                out.append(addr)
        if not include_loopback:
            out = [a for a in out if not a.is_loopback]
        unique = list(dict.fromkeys(out))
        return [a.with_peer_id(self.peer_id) for a in unique]

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
        entry = (opened, closed)
        self._listeners.append(entry)

        def remove() -> None:
            if entry in self._listeners:
                self._listeners.remove(entry)

        return remove

    def add_dialer(self, can_dial: Callable[[Multiaddr], bool], dial: Dialer) -> None:
        """Dial addresses that are not direct TCP (e.g. relayed ones) with `dial`."""
        self._dialers.append((can_dial, dial))

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
            return await self._dial_one(
                endpoint, peer, initiator=initiator, kind=kind, reuse="require"
            )

    def expect_inbound(
        self, ip: str, peer: PeerID, *, initiator: bool, port: int | None = None
    ) -> Callable[[], None]:
        """Until the returned function is called, an inbound connection from `ip` (and
        `port`, when given: peers behind one address are told apart by it) is taken as
        a hole punch from `peer` in which we play handshake role `initiator`."""
        entry, key = (peer, initiator), (ip, port)
        self._expected_inbound[key] = entry

        def remove() -> None:
            if self._expected_inbound.get(key) == entry:
                del self._expected_inbound[key]

        return remove

    # --- handlers -------------------------------------------------------------------------------

    def set_handler(self, protocol: str, handler: StreamHandler) -> None:
        """Serve `protocol` (e.g. "/shoal/dht/1.0.0") with `handler(stream)`."""
        if not protocol.startswith("/"):
            raise ValueError(f"protocol names look like /shoal/<name>/<version>, got {protocol!r}")
        self._handlers[protocol] = handler

    def remove_handler(self, protocol: str) -> None:
        self._handlers.pop(protocol, None)

    @property
    def protocols(self) -> list[str]:
        return sorted(self._handlers)

    # --- connections ----------------------------------------------------------------------------

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
        peer, candidates = self._resolve(target, addrs)
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
        conn = await self._dial_any(peer, candidates, timeout)
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
        }

    @property
    def bytes_sent(self) -> int:
        """Bytes written to the network since start (every connection, closed ones too)."""
        return self._closed_bytes_sent + sum(c.bytes_sent for c in self._all)

    @property
    def bytes_received(self) -> int:
        return self._closed_bytes_received + sum(c.bytes_received for c in self._all)

    # --- internals ------------------------------------------------------------------------------

    def _resolve(
        self, target: PeerID | Multiaddr | str, addrs: Iterable[Multiaddr | str]
    ) -> tuple[PeerID | None, list[Multiaddr]]:
        candidates = [a if isinstance(a, Multiaddr) else Multiaddr(a) for a in addrs]
        if isinstance(target, PeerID):
            peer: PeerID | None = target
        else:
            addr = target if isinstance(target, Multiaddr) else Multiaddr(target)
            peer = addr.peer_id
            candidates.insert(0, addr)
        if peer == self.peer_id:
            raise DialError("refusing to dial ourselves")
        return peer, candidates

    async def _dial_any(
        self, peer: PeerID | None, candidates: list[Multiaddr], timeout: float
    ) -> Connection:
        errors = []
        mismatch: PeerIDMismatch | None = None
        typed: DialError | None = None  # e.g. a relay's refusal: clearer as itself
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        # Direct addresses first: a relay is the way of last resort.
        ordered = [a for a in candidates if not a.is_relayed] + [
            a for a in candidates if a.is_relayed
        ]
        for addr in ordered:
            endpoint = addr.tcp_endpoint()
            dialer = None
            if endpoint is None:
                dialer = next((d for can, d in self._dialers if can(addr)), None)
                if dialer is None:
                    errors.append(f"{addr}: not a direct TCP address")
                    continue
            expected = addr.peer_id or peer
            remaining = deadline - loop.time()
            if remaining <= 0:
                errors.append(f"{addr}: dial timeout")
                break
            try:
                async with asyncio.timeout(remaining):
                    if dialer is not None:
                        return await dialer(addr, expected, remaining)
                    assert endpoint is not None
                    return await self._dial_one(endpoint, expected)
            except TimeoutError:
                errors.append(f"{addr}: timed out after {timeout:.1f}s")
            except (OSError, TransportError) as e:
                errors.append(f"{addr}: {e}")
                if isinstance(e, PeerIDMismatch):
                    mismatch = e
                elif isinstance(e, DialError):
                    typed = e
                elif isinstance(e, HandshakeError):
                    # (the remote end of a dial we chose to make; its answer, our log)
                    self.remote_events.info("dial failed", str(addr), "dial %s failed: %s", addr, e)
        if mismatch is not None and len(errors) == 1:
            raise mismatch
        if typed is not None and len(errors) == 1:
            raise typed
        who = str(peer) if peer is not None else "peer"
        raise DialError(f"could not connect to {who}: " + "; ".join(errors))

    async def _dial_one(
        self,
        endpoint: tuple[str, int],
        expected: PeerID | None,
        *,
        initiator: bool = True,
        kind: str = "direct",
        reuse: str = "auto",
    ) -> Connection:
        """One TCP dial and handshake. `reuse`: "auto" dials from the listen port when
        reuse_port is on (another port if that one cannot be used), "require" only from
        the listen port, "never" from an ephemeral port."""
        if self.admission.established_count >= self.config.max_connections:
            raise LimitExceeded(f"connection limit ({self.config.max_connections}) reached")
        loop = asyncio.get_running_loop()
        host, port = endpoint
        conn: Connection | None = None

        def factory() -> Connection:
            nonlocal conn
            conn = self._new_connection(
                initiator=initiator, expected=expected, kind=kind, outbound=True
            )
            return conn

        local = self._listen_port_for(host) if reuse != "never" else None
        if reuse == "require" and (local is None or not self.config.reuse_port):
            raise DialError("dialing from the listen port needs HostConfig(reuse_port=True)")
        try:
            sock = None
            if local is not None and self.config.reuse_port:
                try:
                    sock = await _connect_from(local, (host, port))
                except OSError as e:
                    # The 4-tuple is taken (a connection to the same endpoint, or one in
                    # TIME_WAIT): dial from an ephemeral port, unless we must punch.
                    if reuse == "require" or e.errno not in _TUPLE_TAKEN:
                        raise
            if sock is not None:
                await loop.create_connection(factory, sock=sock)
            else:
                await loop.create_connection(factory, host, port)
            assert conn is not None
            await asyncio.shield(conn.handshake_done)
        except BaseException as e:
            if conn is not None:
                conn.abort("dial cancelled or failed")
            if (
                sock is not None
                and reuse == "auto"
                and isinstance(e, HandshakeError)
                and not isinstance(e, PeerIDMismatch)
                and conn is not None
                and conn.bytes_received
            ):
                # Both peers dialed each other from their listen ports at the same moment
                # and the kernel made one connection of the two (simultaneous open), so
                # both took the initiator role. Dialing from another port cannot collide.
                log.debug("dial to %s:%d met a simultaneous open; redialing", host, port)
                return await self._dial_one(endpoint, expected, reuse="never")
            raise
        if conn.remote_peer in self._blocked:  # dialed by address, and it named a blocked peer
            raise PeerBlocked(f"{conn.remote_peer.short()} is blocked")
        best = self._conns.get(conn.remote_peer)
        return best if best is not None and best.accepting_streams else conn

    def _listen_port_for(self, host: str) -> tuple[str, int] | None:
        """The (ip, port) our listener of `host`'s family is bound to, for dialing from it."""
        try:
            family = "ip6" if ipaddress.ip_address(host).version == 6 else "ip4"
        except ValueError:
            return None  # a DNS name: dial normally
        for addr in self._listen_addrs:
            if addr.family == family:
                return addr.tcp_endpoint()
        return None

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
        )
        conn.handshake_done.add_done_callback(lambda fut: self._on_handshake(conn, fut))
        return conn

    def _admit(self, conn: Connection) -> str | None:
        ip = self._ip_key(conn)
        if self._closing:
            return "host is shutting down"
        verdict = self.admission.admit(
            conn, ip, inbound=not conn.outbound, now=asyncio.get_running_loop().time()
        )
        if verdict.refusal is not None:
            return verdict.refusal
        for old in verdict.evict:
            assert isinstance(old, Connection)
            old.abort("half-open connection evicted: handshake slots full")
        if not conn.outbound and conn.kind == "direct" and conn.remote_address is not None:
            ip, port = conn.remote_address
            expected = self._expected_inbound.get((ip, port)) or self._expected_inbound.get(
                (ip, None)
            )
            if expected is not None:
                peer, initiator = expected
                conn.set_role(initiator, peer)
                conn.kind = "hole-punched"
        self._all.add(conn)
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
        refusal = self.admission.established(conn)
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
        self._register(conn)
        for opened, _ in list(self._listeners):
            if opened is not None:
                try:
                    opened(conn)
                except Exception:
                    log.exception("connection listener failed")

    def _register(self, conn: Connection) -> None:
        peer = conn.remote_peer
        current = self._conns.get(peer)
        if current is None or not current.is_open or current.superseded:
            self._conns[peer] = conn
            return

        # Two connections to one peer. A direct one beats a relayed one (both sides see
        # which is which). Otherwise (we dialed each other at once) both sides keep the
        # one dialed by the smaller peer ID, so they agree without talking.
        def dialer(c: Connection) -> PeerID:
            return self.peer_id if c.initiator else peer

        current_relayed, new_relayed = current.kind == "relayed", conn.kind == "relayed"
        if current_relayed != new_relayed:
            keep, drop = (conn, current) if current_relayed else (current, conn)
        elif dialer(current) == dialer(conn):  # same dialer twice: keep the older one
            keep, drop = current, conn
        else:
            keep, drop = (current, conn) if dialer(current) <= dialer(conn) else (conn, current)
        self._conns[peer] = keep
        drop.retire(self.config.close_grace)

    def _on_closed(self, conn: Connection) -> None:
        if conn in self._all:
            self._all.discard(conn)
            self._closed_bytes_sent += conn.bytes_sent
            self._closed_bytes_received += conn.bytes_received
            self.admission.closed(conn)
        if conn.remote_peer is not None and self._conns.get(conn.remote_peer) is conn:
            del self._conns[conn.remote_peer]
            # Promote a surviving duplicate, if any, so the peer stays reachable.
            survivors = [o for o in self._all if o.remote_peer == conn.remote_peer and o.is_open]
            survivors.sort(key=lambda o: o.kind == "relayed")  # direct ones first
            if survivors:
                self._conns[conn.remote_peer] = survivors[0]
                survivors[0].superseded = False
        hs = conn.handshake_done
        if hs.done() and not hs.cancelled() and hs.exception() is None:
            for _, closed in list(self._listeners):
                if closed is not None:
                    try:
                        closed(conn)
                    except Exception:
                        log.exception("connection listener failed")

    def _on_stream(self, stream: Stream) -> None:
        if self.versions.hold(stream):  # the hello, or a stream waiting for it
            return
        handler = self._handlers.get(stream.protocol)
        conn = stream.connection
        if handler is None or self._closing:
            reason = "host is shutting down" if handler else f"unknown protocol {stream.protocol}"
            conn.refuse_stream(stream, reason, unknown_protocol=handler is None)
            return
        conn.spawn(self._run_handler(handler, stream), stream)

    async def _run_handler(self, handler: StreamHandler, stream: Stream) -> None:
        try:
            await handler(stream)
        except asyncio.CancelledError:
            stream.reset("handler cancelled")
            raise
        except TransportError as e:
            log.debug("handler %s for %s: %s", stream.protocol, stream.remote_peer.short(), e)
            stream.reset(type(e).__name__)
        except Exception:
            # A bug here, but a remote peer may trigger it at will: the first few with
            # their traceback, then a count.
            self.remote_events.error(
                f"handler {stream.protocol} failed",
                stream.connection.remote_key(),
                "handler %s failed for %s",
                stream.protocol,
                stream.remote_peer,
                exc_info=True,
            )
            stream.reset("handler error")
        else:
            await stream.close(discard_input=True)


# connect() errors meaning "this (local, remote) 4-tuple is in use": dial from another port.
_TUPLE_TAKEN = {errno.EADDRINUSE, errno.EADDRNOTAVAIL}


def _reuse_port_listener(family: int, host: str, port: int) -> socket.socket:
    """A bound listening socket that dialing sockets may share its port with.

    Bound *before* SO_REUSEPORT is set, so that a port already in use (by anyone,
    another shoal included) still fails the bind, as without reuse_port.
    """
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind((host, port))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


async def _connect_from(local: tuple[str, int], remote: tuple[str, int]) -> socket.socket:
    """A socket connected to `remote` from the local (ip, port) our listener uses."""
    family = socket.AF_INET6 if ":" in remote[0] else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(local)
        await asyncio.get_running_loop().sock_connect(sock, remote)
    except BaseException:
        sock.close()
        raise
    return sock
