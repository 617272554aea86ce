"""The host's outgoing TCP dials: the order of a peer's addresses, dialing from the
listen port (for NAT mappings and hole punching), and the errors a dial reports."""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable, Iterable

from .admission import Admission
from .connection import Connection
from .errors import (
    DialError,
    HandshakeError,
    LimitExceeded,
    PeerBlocked,
    PeerIDMismatch,
    TransportError,
)
from .identity import PeerID
from .multiaddr import Multiaddr
from .remote_log import RemoteEvents

log = logging.getLogger("shoal.transport")

# A dialer for addresses the host cannot dial itself (e.g. /p2p-circuit through a relay):
# dial(address, expected peer or None, timeout) -> an authenticated Connection.
Dialer = Callable[[Multiaddr, "PeerID | None", float], Awaitable[Connection]]
# new_connection(initiator=, expected=, kind=, outbound=): a Connection wired to the host.
ConnectionFactory = Callable[..., Connection]


def resolve(
    target: PeerID | Multiaddr | str, addrs: Iterable[Multiaddr | str], local_peer: PeerID
) -> tuple[PeerID | None, list[Multiaddr]]:
    """The peer a dial target names (None: any) and the addresses to try."""
    candidates = [a if isinstance(a, Multiaddr) else Multiaddr(a) for a in addrs]
    if isinstance(target, PeerID):
        peer: PeerID | None = target
    else:
        addr = target if isinstance(target, Multiaddr) else Multiaddr(target)
        peer = addr.peer_id
        candidates.insert(0, addr)
    if peer == local_peer:
        raise DialError("refusing to dial ourselves")
    if peer is not None:
        # A circuit address as records keep it (dht.routing.dialable_addrs strips the
        # target, /p2p/RELAY/p2p-circuit): the target is the peer we dial.
        candidates = [
            a.with_peer_id(peer) if a.components[-1][0] == "p2p-circuit" else a for a in candidates
        ]
    return peer, candidates


class TcpDialer:
    """Dials a peer at its candidate addresses (direct ones first, then the `dialers`
    that handle the others) for the host that `new_connection` wires connections to."""

    def __init__(
        self,
        admission: Admission,
        new_connection: ConnectionFactory,
        remote_events: RemoteEvents,
        *,
        max_connections: int,
        reuse_port: bool,
        listen_addrs: Callable[[], list[Multiaddr]],
        blocked: dict[PeerID, str],
        current: Callable[[PeerID], Connection | None],
        make_room: Callable[[], None] = lambda: None,
        may_exceed: Callable[[PeerID | None], bool] = lambda peer: False,
    ) -> None:
        self.admission = admission
        self.dialers: list[tuple[Callable[[Multiaddr], bool], Dialer]] = []
        self._new_connection = new_connection
        self._remote_events = remote_events
        self.max_connections = max_connections
        self.reuse_port = reuse_port
        self._listen_addrs = listen_addrs
        self._blocked = blocked
        self._current = current
        self._make_room = make_room  # at the limit: close an idle connection first
        self._may_exceed = may_exceed  # peers dialed past the limit (a round's members)

    async def dial_any(
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
                dialer = next((d for can, d in self.dialers if can(addr)), None)
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
                    return await self.dial_one(endpoint, expected)
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
                    self._remote_events.info(
                        "dial failed", str(addr), "dial %s failed: %s", addr, e
                    )
        if mismatch is not None and len(errors) == 1:
            raise mismatch
        if typed is not None and len(errors) == 1:
            raise typed
        who = str(peer) if peer is not None else "peer"
        raise DialError(f"could not connect to {who}: " + "; ".join(errors))

    async def dial_one(
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
        self._make_room()
        if self.admission.established_count >= self.max_connections and not self._may_exceed(
            expected
        ):
            raise LimitExceeded(f"connection limit ({self.max_connections}) reached")
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
        if reuse == "require" and (local is None or not self.reuse_port):
            raise DialError("dialing from the listen port needs HostConfig(reuse_port=True)")
        try:
            sock = None
            if local is not None and self.reuse_port:
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
                return await self.dial_one(endpoint, expected, reuse="never")
            raise
        if conn.remote_peer in self._blocked:  # dialed by address, and it named a blocked peer
            raise PeerBlocked(f"{conn.remote_peer.short()} is blocked")
        best = self._current(conn.remote_peer)
        return best if best is not None and best.accepting_streams else conn

    def _listen_port_for(self, host: str) -> tuple[str, int] | None:
        """The (ip, port) our listener of `host`'s family is bound to, for dialing from it."""
        try:
            family = "ip6" if ipaddress.ip_address(host).version == 6 else "ip4"
        except ValueError:
            return None  # a DNS name: dial normally
        for addr in self._listen_addrs():
            if addr.family == family:
                return addr.tcp_endpoint()
        return None


# connect() errors meaning "this (local, remote) 4-tuple is in use": dial from another port.
_TUPLE_TAKEN = {errno.EADDRINUSE, errno.EADDRNOTAVAIL}


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
