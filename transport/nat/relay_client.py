"""Circuit relay: the client's side (reservations, relayed dials, accepting relayed peers).

A private peer keeps a reservation on a few relays: each one is a hop stream
held open (see `relay`), refreshed at half its TTL, and gives the peer an
address ``/ip4/R/tcp/P/p2p/RELAY/p2p-circuit/p2p/SELF``. Dialing such an
address opens a hop stream to the relay and runs an ordinary secure,
multiplexed `Connection` over it (`StreamTransport`), so the relay only ever
splices ciphertext. The target accepts on ``/shoal/relay/stop/1.0.0`` from the
relays it holds reservations on.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from ..connection import Connection, Stream
from ..errors import (
    DialError,
    ProtocolViolation,
    RelayConnectRefused,
    ReservationRefused,
)
from ..host import Host
from ..identity import PeerID
from ..multiaddr import Multiaddr, from_socket_address
from ..tasks import TaskSet
from . import wire
from .config import NatConfig
from .relay import HOP_PROTOCOL, STOP_PROTOCOL
from .relayed_connection import StreamTransport

log = logging.getLogger("shoal.transport.nat")


def parse_reply_status(reply: dict[str, object], relay: PeerID) -> None:
    """A relay's answer: ReservationRefused unless its status is "ok"."""
    status = wire.get_str(reply, "status", 16)
    if status != "ok":
        error = wire.get_str(reply, "error", 1000, status)
        raise ReservationRefused(f"relay {relay.short()} refused: {error}")


def parse_reservation_ttl(reply: dict[str, object]) -> float:
    """A granted (or refreshed) reservation's lifetime in seconds, at most a day."""
    return min(wire.get_number(reply, "ttl"), 24 * 3600.0)


def parse_relay_addrs(reply: dict[str, object]) -> list[Multiaddr]:
    """The direct TCP addresses a relay gives for itself with a reservation."""
    return [a for a in wire.get_addrs(reply, "addrs") if a.is_direct_tcp]


def parse_stop(msg: dict[str, object]) -> PeerID:
    """A relay's stop request (a peer connects through it): the source peer."""
    if wire.get_str(msg, "type", 16) != "connect":
        raise ProtocolViolation("relay stop: expected connect")
    return wire.get_peer(msg, "peer")


@dataclass(slots=True)
class ActiveReservation:
    relay: PeerID
    addrs: list[Multiaddr]  # our circuit addresses through this relay
    expires: float
    stream: Stream


def is_circuit(addr: Multiaddr) -> bool:
    return addr.is_relayed


def relay_part(addr: Multiaddr) -> Multiaddr | None:
    """The relay's own address in a circuit address (None when it has no host part)."""
    comps = addr.components
    idx = next(i for i, (p, _) in enumerate(comps) if p == "p2p-circuit")
    head = comps[:idx]
    if len(head) < 2:  # only /p2p/RELAY
        return None
    return Multiaddr.from_components(head)


class RelayClient:
    def __init__(
        self,
        host: Host,
        config: NatConfig,
        *,
        on_change: Callable[[], None],
        known_addresses: Callable[[PeerID], list[Multiaddr]],
    ) -> None:
        self.host = host
        self.config = config
        self._on_change = on_change
        self._known_addresses = known_addresses
        self.reservations: dict[PeerID, ActiveReservation] = {}
        self._holders: dict[PeerID, asyncio.Task[None]] = {}
        # (A refused or lost reservation is routine: `last_error` keeps why, per relay.)
        self._holding = TaskSet(log, "relay reservation", logging.INFO)
        self._closed = False
        self.last_error: dict[PeerID, str] = {}
        self.accepted = 0

    def start(self) -> None:
        self.host.set_handler(STOP_PROTOCOL, self._serve_stop)
        self.host.add_dialer(is_circuit, self.dial)

    async def aclose(self) -> None:
        self._closed = True
        self.host.remove_handler(STOP_PROTOCOL)
        await self._holding.aclose()

    def circuit_addresses(self) -> list[Multiaddr]:
        return [a for r in self.reservations.values() for a in r.addrs]

    # --- reservations -------------------------------------------------------------------------

    def holding(self) -> set[PeerID]:
        """Relays we hold or are acquiring a reservation on."""
        return set(self._holders)

    async def keep(self, relay: PeerID, addrs: list[Multiaddr], timeout: float = 10.0) -> None:
        """Reserve on `relay` and keep the reservation (refreshed) until `drop` or failure.

        Returns once the reservation is granted; raises ReservationRefused or
        DialError when it is not (and then holds nothing).
        """
        if relay in self._holders or self._closed:
            return
        ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        task = self._holding.spawn(self._hold(relay, addrs, ready, timeout))
        self._holders[relay] = task
        task.add_done_callback(lambda t: self._holder_done(relay, t))
        await asyncio.shield(ready)

    def drop(self, relay: PeerID) -> None:
        task = self._holders.get(relay)
        if task is not None:
            task.cancel()

    def _holder_done(self, relay: PeerID, task: asyncio.Task[None]) -> None:
        if self._holders.get(relay) is task:
            del self._holders[relay]
        if not task.cancelled() and task.exception() is not None:
            self.last_error[relay] = str(task.exception())
            while len(self.last_error) > 64:  # bounded: the oldest go first
                del self.last_error[next(iter(self.last_error))]

    async def _hold(
        self,
        relay: PeerID,
        addrs: list[Multiaddr],
        ready: asyncio.Future[None],
        timeout: float,
    ) -> None:
        loop = asyncio.get_running_loop()
        stream: Stream | None = None
        try:
            async with asyncio.timeout(timeout):
                conn = await self.host.connect(relay, addrs, timeout=timeout)
                if conn.kind == "relayed":
                    raise ReservationRefused(f"{relay.short()} is reachable only through a relay")
                stream = await conn.open_stream(HOP_PROTOCOL)
                ms = wire.messages(stream)
                await ms.send({"type": "reserve"})
                reply = await _reply(ms, relay)
            ttl = parse_reservation_ttl(reply)
            res = ActiveReservation(
                relay, self._circuit_addrs(relay, conn, reply), loop.time() + ttl, stream
            )
            self.reservations[relay] = res
            self.last_error.pop(relay, None)
            if not ready.done():
                ready.set_result(None)
            log.info("reserved a relay slot on %s for %.0fs", relay.short(), ttl)
            self._on_change()
            while True:
                # Wait for half the TTL, or for the relay to end the reservation.
                try:
                    async with asyncio.timeout(max(0.05, (res.expires - loop.time()) / 2)):
                        await stream.wait_readable()
                except TimeoutError:
                    await ms.send({"type": "refresh"})
                    async with asyncio.timeout(self.config.relay_limits.connect_timeout):
                        reply = await _reply(ms, relay)
                    res.expires = loop.time() + parse_reservation_ttl(reply)
                    continue
                await _reply(ms, relay)  # anything unprompted ends the reservation
                raise ReservationRefused(f"relay {relay.short()} ended the reservation")
        except BaseException as e:
            log.debug("reservation on %s: %r", relay.short(), e)
            err: BaseException = e
            if isinstance(e, TimeoutError):
                err = DialError(f"reservation on {relay.short()} timed out")
            elif isinstance(e, EOFError):
                err = ReservationRefused(f"relay {relay.short()} closed the reservation")
            if not ready.done():
                if isinstance(e, asyncio.CancelledError):
                    ready.cancel()
                else:
                    ready.set_exception(err)
                    ready.exception()  # retrieved by keep(), or by nobody after a drop
            if err is not e:
                raise err from None
            raise
        finally:
            if stream is not None:
                stream.reset("reservation released")
            if self.reservations.pop(relay, None) is not None:
                log.info("relay reservation on %s ended", relay.short())
                if not self._closed:
                    self._on_change()

    def _circuit_addrs(
        self, relay: PeerID, conn: Connection, reply: dict[str, object]
    ) -> list[Multiaddr]:
        direct = parse_relay_addrs(reply)
        if not direct and conn.remote_address is not None:
            direct = [from_socket_address(*conn.remote_address)]
        me = self.host.peer_id
        return [a.with_peer_id(relay).encapsulate("/p2p-circuit").with_peer_id(me) for a in direct]

    # --- relayed connections ----------------------------------------------------------------------

    async def dial(self, addr: Multiaddr, expected: PeerID | None, timeout: float) -> Connection:
        relay = addr.relay_peer_id
        target = addr.peer_id
        if relay is None or target is None or target == relay:
            raise DialError(f"{addr}: a circuit address needs /p2p/RELAY/p2p-circuit/p2p/TARGET")
        if expected is not None and expected != target:
            raise DialError(f"{addr} names {target}, not {expected}")
        if relay == self.host.peer_id:
            # (Its circuit through us: were it our client still, it would be connected.)
            raise DialError(f"{target.short()} is not connected to us, the relay it names")
        head = relay_part(addr)
        candidates = [head] if head is not None else []
        candidates += self._known_addresses(relay)
        relay_conn = await self.host.connect(relay, candidates, timeout=timeout)
        if relay_conn.kind == "relayed":
            raise DialError(f"relay {relay.short()} is itself reachable only through a relay")
        stream = await relay_conn.open_stream(HOP_PROTOCOL)
        try:
            ms = wire.messages(stream)
            await ms.send({"type": "connect", "peer": target.to_bytes()})
            try:
                await _reply(ms, relay)
            except ReservationRefused as e:
                raise RelayConnectRefused(
                    f"relay {relay.short()} refused a connection to {target.short()}: "
                    f"{str(e).split(': ', 1)[-1]}"
                ) from None
        except BaseException:
            stream.reset("relay dial failed")
            raise
        conn = self.host.new_connection(
            initiator=True, expected=target, kind="relayed", outbound=True
        )
        conn.relay = relay
        StreamTransport(stream, conn, relay).start()
        try:
            await asyncio.shield(conn.handshake_done)
        except BaseException:
            conn.abort("relayed dial failed or cancelled")
            raise
        best = self.host.connection(target)
        return best if best is not None else conn

    async def _serve_stop(self, stream: Stream) -> None:
        relay_conn = stream.connection
        relay = relay_conn.remote_peer
        ms = wire.messages(stream)
        async with asyncio.timeout(self.config.relay_limits.connect_timeout):
            msg = await wire.recv_map(ms, "relay stop")
            src = parse_stop(msg)
            if relay not in self.reservations or relay_conn.kind == "relayed":
                await ms.send({"status": "refused", "error": "no reservation with you"})
                return
            await ms.send({"status": "ok"})
        conn = self.host.new_connection(
            initiator=False, expected=src, kind="relayed", outbound=False
        )
        conn.relay = relay
        self.accepted += 1
        StreamTransport(stream, conn, relay).start()
        # The stream belongs to this handler: it lives as long as the relayed connection.
        await asyncio.shield(conn.closed)


async def _reply(ms: wire.MessageStream, relay: PeerID) -> dict[str, object]:
    reply = await wire.recv_map(ms, "relay reply")
    parse_reply_status(reply, relay)
    return reply
