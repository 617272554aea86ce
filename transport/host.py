"""The host: listens, dials, keeps one connection per peer and routes streams to handlers."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

from .connection import Connection, ConnectionConfig, Stream
from .errors import (
    ConnectionLost,
    DialError,
    HandshakeError,
    LimitExceeded,
    PeerIDMismatch,
    TransportError,
)
from .identity import Identity, PeerID
from .interfaces import local_addresses
from .multiaddr import Multiaddr, MultiaddrError, from_socket_address

log = logging.getLogger("shoal.transport")

StreamHandler = Callable[[Stream], Awaitable[None]]

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
    max_connections: int = 1024
    max_connections_per_ip: int = 32
    close_grace: float = 5.0  # how long shutdown waits for open streams
    connection: ConnectionConfig = field(default_factory=ConnectionConfig)


class Host:
    """A peer's network endpoint: one secure multiplexed connection per remote peer."""

    def __init__(self, identity: Identity, config: HostConfig | None = None) -> None:
        self.identity = identity
        self.peer_id: PeerID = identity.peer_id
        self.config = config or HostConfig()
        self._handlers: dict[str, StreamHandler] = {}
        self._servers: list[asyncio.Server] = []
        self._listen_addrs: list[Multiaddr] = []
        self._conns: dict[PeerID, Connection] = {}
        self._all: set[Connection] = set()  # including handshaking and superseded ones
        self._per_ip: Counter[str] = Counter()
        self._dials: dict[PeerID, asyncio.Future[Connection]] = {}
        self._closing = False
        self._dial_tasks: set[asyncio.Task[Connection]] = set()

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
        for server in self._servers:
            server.close()
        for task in list(self._dial_tasks):
            task.cancel()
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
        """Dialable addresses of this host, each ending in /p2p/<peer id>."""
        if self.config.announce:
            return [Multiaddr(a).with_peer_id(self.peer_id) for a in self.config.announce]
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
        if peer is not None:
            existing = self.connection(peer)
            if existing is not None:
                return existing
            pending = self._dials.get(peer)
            if pending is not None:
                return await asyncio.shield(pending)
        if self._closing:
            raise DialError("host is shutting down")
        if not candidates:
            raise DialError(f"no address known for {peer}")
        timeout = self.config.dial_timeout if timeout is None else timeout
        task = asyncio.get_running_loop().create_task(self._dial_any(peer, candidates, timeout))
        self._dial_tasks.add(task)
        task.add_done_callback(self._dial_tasks.discard)
        if peer is not None:
            self._dials[peer] = task  # type: ignore[assignment]
        try:
            return await asyncio.shield(task)
        finally:
            if peer is not None and self._dials.get(peer) is task:
                del self._dials[peer]

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

    async def disconnect(self, peer: PeerID) -> None:
        conn = self._conns.get(peer)
        if conn is not None:
            await conn.aclose(self.config.close_grace)

    def stats(self) -> dict[str, object]:
        conns = [c for c in self._all if c.is_open]
        return {
            "peer_id": str(self.peer_id),
            "connections": [c.stats() for c in conns],
            "bytes_sent": sum(c.bytes_sent for c in self._all),
            "bytes_received": sum(c.bytes_received for c in self._all),
        }

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
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        for addr in candidates:
            endpoint = addr.tcp_endpoint()
            if endpoint is None:
                errors.append(f"{addr}: not a direct TCP address")
                continue
            expected = addr.peer_id or peer
            remaining = deadline - loop.time()
            if remaining <= 0:
                errors.append(f"{addr}: dial timeout")
                break
            try:
                async with asyncio.timeout(remaining):
                    return await self._dial_one(endpoint, expected)
            except TimeoutError:
                errors.append(f"{addr}: timed out after {timeout:.1f}s")
            except (OSError, TransportError) as e:
                errors.append(f"{addr}: {e}")
                if isinstance(e, PeerIDMismatch):
                    mismatch = e
                elif isinstance(e, HandshakeError):
                    log.info("dial %s failed: %s", addr, e)
        if mismatch is not None and len(errors) == 1:
            raise mismatch
        who = str(peer) if peer is not None else "peer"
        raise DialError(f"could not connect to {who}: " + "; ".join(errors))

    async def _dial_one(self, endpoint: tuple[str, int], expected: PeerID | None) -> Connection:
        if len(self._all) >= self.config.max_connections:
            raise LimitExceeded(f"connection limit ({self.config.max_connections}) reached")
        loop = asyncio.get_running_loop()
        host, port = endpoint
        conn: Connection | None = None

        def factory() -> Connection:
            nonlocal conn
            conn = self._new_connection(initiator=True, expected=expected)
            return conn

        try:
            await loop.create_connection(factory, host, port)
            assert conn is not None
            await asyncio.shield(conn.handshake_done)
        except BaseException:
            if conn is not None:
                conn.abort("dial cancelled or failed")
            raise
        best = self._conns.get(conn.remote_peer)
        return best if best is not None and best.accepting_streams else conn

    def _new_connection(self, *, initiator: bool, expected: PeerID | None = None) -> Connection:
        conn = Connection(
            self.identity,
            initiator=initiator,
            expected_peer=expected,
            config=self.config.connection,
            on_stream=self._on_stream,
            on_closed=self._on_closed,
            admit=self._admit,
        )
        conn.handshake_done.add_done_callback(lambda fut: self._on_handshake(conn, fut))
        return conn

    def _admit(self, conn: Connection) -> str | None:
        ip = conn.remote_address[0] if conn.remote_address else "?"
        if self._closing:
            return "host is shutting down"
        if not conn.initiator:
            if len(self._all) >= self.config.max_connections:
                return f"connection limit ({self.config.max_connections}) reached"
            if self._per_ip[ip] >= self.config.max_connections_per_ip:
                return f"per-IP connection limit ({self.config.max_connections_per_ip}) reached"
        self._all.add(conn)
        self._per_ip[ip] += 1
        return None

    def _on_handshake(self, conn: Connection, fut: asyncio.Future[PeerID]) -> None:
        if fut.cancelled() or fut.exception() is not None:
            return
        peer = conn.remote_peer
        current = self._conns.get(peer)
        if current is None or not current.is_open or current.superseded:
            self._conns[peer] = conn
            return

        # Two connections to one peer (we dialed each other at once). Both sides keep
        # the one dialed by the smaller peer ID, so they agree without talking.
        def dialer(c: Connection) -> PeerID:
            return self.peer_id if c.initiator else peer

        keep, drop = (current, conn) if dialer(current) <= dialer(conn) else (conn, current)
        if dialer(current) == dialer(conn):  # same dialer twice: keep the older one
            keep, drop = current, conn
        self._conns[peer] = keep
        drop.superseded = True
        drop._mux.go_away()
        drop._schedule_flush()
        # The duplicate closes once the streams already on it are done.
        task = asyncio.get_running_loop().create_task(drop.aclose(self.config.close_grace))
        drop._tasks.add(task)  # owned (and cancelled on close) by the dropped connection
        task.add_done_callback(drop._tasks.discard)

    def _on_closed(self, conn: Connection) -> None:
        if conn in self._all:
            self._all.discard(conn)
            ip = conn.remote_address[0] if conn.remote_address else "?"
            self._per_ip[ip] -= 1
            if self._per_ip[ip] <= 0:
                del self._per_ip[ip]
        if conn.remote_peer is not None and self._conns.get(conn.remote_peer) is conn:
            del self._conns[conn.remote_peer]
            # Promote a surviving duplicate, if any, so the peer stays reachable.
            for other in self._all:
                if other.remote_peer == conn.remote_peer and other.is_open:
                    self._conns[conn.remote_peer] = other
                    other.superseded = False
                    break

    def _on_stream(self, stream: Stream) -> None:
        handler = self._handlers.get(stream.protocol)
        conn = stream.connection
        if handler is None or self._closing:
            reason = "host is shutting down" if handler else f"unknown protocol {stream.protocol}"
            conn._mux.reset_stream(stream.id, reason, refused=handler is None)
            conn.streams.pop(stream.id, None)
            conn._schedule_flush()
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
            log.exception("handler %s failed for %s", stream.protocol, stream.remote_peer)
            stream.reset("handler error")
        else:
            await stream.close(discard_input=True)
