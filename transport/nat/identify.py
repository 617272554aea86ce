"""Identify: on every new connection each side tells the other who it is and how it sees it.

Protocol ``/shoal/identify/1.0.0``: the opener sends nothing; the handler answers
one map and closes::

    {"v": 1, "agent": str, "protocols": [str], "listen": [addr], "addrs": [addr],
     "observed": addr | None}

``agent`` names the software and its protocol version, e.g. "shoal/0.1.0
protocol/1.0", for people (the NAT status shows it): compatibility is decided by
the hello that every host runs (transport/version.py), not here, as identify
runs only where a NatManager does. ``listen`` are the addresses the sender's
sockets are bound to (interfaces), ``addrs`` what it advertises (confirmed
public and relay addresses), and ``observed`` the address the sender sees the
connection coming from (None for a relayed connection, whose far end is the
relay). Both peers open the stream as soon as the handshake completes, so each
learns the other's view.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from ..connection import Connection, Stream
from ..errors import ProtocolViolation, TransportError
from ..host import Host
from ..multiaddr import Multiaddr, MultiaddrError, from_socket_address
from . import wire

log = logging.getLogger("shoal.transport.nat")

PROTOCOL = "/shoal/identify/1.0.0"
VERSION = 1


@dataclass(frozen=True, slots=True)
class IdentifyInfo:
    agent: str
    protocols: tuple[str, ...]
    listen: tuple[Multiaddr, ...]
    addrs: tuple[Multiaddr, ...]
    observed: Multiaddr | None  # how the remote sees us (our address as it observes it)
    received_at: float = field(default=0.0, compare=False)

    def to_wire(self) -> dict[str, object]:
        return {
            "v": VERSION,
            "agent": self.agent,
            "protocols": list(self.protocols),
            "listen": [str(a) for a in self.listen],
            "addrs": [str(a) for a in self.addrs],
            "observed": str(self.observed) if self.observed is not None else None,
        }

    @classmethod
    def from_wire(cls, msg: dict[str, object], now: float = 0.0) -> IdentifyInfo:
        """Validate an untrusted identify map (ProtocolViolation when malformed)."""
        if msg.get("v") != VERSION:
            raise ProtocolViolation(f"identify: unsupported version {msg.get('v')!r}")
        observed_raw = msg.get("observed")
        observed = None
        if observed_raw is not None:
            if not isinstance(observed_raw, str) or len(observed_raw) > 512:
                raise ProtocolViolation("identify: bad observed address")
            try:
                observed = Multiaddr(observed_raw)
            except MultiaddrError:
                observed = None
            if observed is not None and not observed.is_direct_tcp:
                observed = None
        return cls(
            agent=wire.get_str(msg, "agent", 128, ""),
            protocols=tuple(wire.get_str_list(msg, "protocols", wire.MAX_PROTOCOLS)),
            listen=tuple(wire.get_addrs(msg, "listen")),
            addrs=tuple(wire.get_addrs(msg, "addrs")),
            observed=observed,
            received_at=now,
        )


def observed_address(conn: Connection) -> Multiaddr | None:
    """The remote's address as this connection shows it (None when relayed)."""
    if conn.kind == "relayed" or conn.remote_address is None:
        return None
    try:
        return from_socket_address(*conn.remote_address)
    except (MultiaddrError, TypeError):
        return None


class IdentifyService:
    """Serves identify and runs it on every new connection of `host`.

    `on_identified(conn, info)` is called once per connection whose peer answered.
    """

    def __init__(
        self,
        host: Host,
        *,
        agent: str,
        timeout: float,
        on_identified: Callable[[Connection, IdentifyInfo], None],
    ) -> None:
        self.host = host
        self.agent = agent
        self.timeout = timeout
        self._on_identified = on_identified
        self.infos: dict[Connection, IdentifyInfo] = {}
        self._waiters: dict[Connection, asyncio.Future[IdentifyInfo | None]] = {}
        self._remove_listener: Callable[[], None] | None = None

    def start(self) -> None:
        self.host.set_handler(PROTOCOL, self._serve)
        self._remove_listener = self.host.add_connection_listener(self._opened, self._closed)
        for conn in list(self.host.connections.values()):  # made before we started
            if conn.is_open:
                self._opened(conn)

    def close(self) -> None:
        self.host.remove_handler(PROTOCOL)
        if self._remove_listener is not None:
            self._remove_listener()
        for fut in self._waiters.values():
            if not fut.done():
                fut.set_result(None)
        self._waiters.clear()

    def local_info(self, conn: Connection) -> IdentifyInfo:
        return IdentifyInfo(
            agent=self.agent,
            protocols=tuple(self.host.protocols),
            listen=tuple(self.host.interface_addresses(include_loopback=True)[: wire.MAX_ADDRS]),
            addrs=tuple(self.host.addresses()[: wire.MAX_ADDRS]),
            observed=observed_address(conn),
        )

    async def wait(self, conn: Connection, timeout: float | None = None) -> IdentifyInfo | None:
        """The remote's identify info for `conn` (None if it does not speak identify)."""
        if conn in self.infos:
            return self.infos[conn]
        fut = self._waiters.get(conn)
        if fut is None:
            return None
        try:
            async with asyncio.timeout(timeout if timeout is not None else self.timeout * 2):
                return await asyncio.shield(fut)
        except TimeoutError:
            return None

    # --- driver --------------------------------------------------------------------------------

    def _opened(self, conn: Connection) -> None:
        if conn in self._waiters:
            return
        self._waiters[conn] = asyncio.get_running_loop().create_future()
        conn.spawn(self._identify(conn))  # owned by the connection: cancelled when it ends

    def _closed(self, conn: Connection) -> None:
        self.infos.pop(conn, None)
        fut = self._waiters.pop(conn, None)
        if fut is not None and not fut.done():
            fut.set_result(None)

    async def _identify(self, conn: Connection) -> None:
        info: IdentifyInfo | None = None
        try:
            async with asyncio.timeout(self.timeout):
                stream = await conn.open_stream(PROTOCOL)
                await stream.close()
                msg = await wire.recv_map(wire.messages(stream), "identify")
                info = IdentifyInfo.from_wire(msg, asyncio.get_running_loop().time())
        except (TransportError, TimeoutError, EOFError) as e:
            log.debug("identify with %s failed: %s", conn.remote_peer.short(), e)
        finally:
            fut = self._waiters.get(conn)
            if fut is not None and not fut.done():
                fut.set_result(info)
        if info is not None and conn.is_open:
            self.infos[conn] = info
            self._on_identified(conn, info)

    async def _serve(self, stream: Stream) -> None:
        info = self.local_info(stream.connection)
        await wire.messages(stream).send(info.to_wire())
