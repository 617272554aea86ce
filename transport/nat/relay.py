"""Circuit relay (v2-like): the relay's side.

Protocol ``/shoal/relay/hop/1.0.0`` (client -> relay) starts with one of::

    {"type": "reserve"}                 -> {"status": "ok", "ttl": s, "addrs": [addr]}
                                           then {"type": "refresh"} -> {"status": "ok", ...}
                                           on the same stream while the reservation lasts
    {"type": "connect", "peer": id}     -> {"status": "ok", "limits": {...}}, then raw bytes

and ``/shoal/relay/stop/1.0.0`` (relay -> reserved target)::

    {"type": "connect", "peer": source id, "limits": {"duration": s, "bytes": n}}
                                        -> {"status": "ok"}, then raw bytes

Refusals are ``{"status": "refused", "error": str}``. A reservation lives as long
as its stream (and at most `reservation_ttl` past the last refresh). After the
two "ok"s the relay splices the source's hop stream and the target's stop
stream and only counts bytes: what flows is the end-to-end Noise session. A
circuit that exceeds its byte or duration limit is reset on both ends with a
reason starting with ``relay limit exceeded``.

`RelayBook` is the bookkeeping (reservations, circuits, limits) without I/O.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from ..connection import Connection, Stream
from ..errors import ProtocolViolation, TransportError
from ..host import Host
from ..identity import PeerID
from ..multiaddr import Multiaddr
from . import wire
from .config import RelayLimits
from .relayed_connection import LIMIT_RESET_PREFIX

log = logging.getLogger("shoal.transport.nat")

HOP_PROTOCOL = "/shoal/relay/hop/1.0.0"
STOP_PROTOCOL = "/shoal/relay/stop/1.0.0"
_SPLICE_CHUNK = 256 * 1024


def parse_hop_kind(msg: dict[str, object]) -> str:
    """The kind of a hop request ("reserve", "connect" or another a handler refuses)."""
    return wire.get_str(msg, "type", 16)


def parse_hop_connect(msg: dict[str, object]) -> PeerID:
    """The destination of a hop "connect" request."""
    return wire.get_peer(msg, "peer")


def parse_refresh(msg: dict[str, object]) -> None:
    """A reservation holder's message on its open hop stream: a refresh, or a violation."""
    if wire.get_str(msg, "type", 16) != "refresh":
        raise ProtocolViolation("relay: expected a refresh")


@dataclass(slots=True)
class Reservation:
    peer: PeerID
    ip: str
    expires: float
    conn: Connection | None = None


@dataclass(slots=True)
class Circuit:
    id: int
    src: PeerID
    dst: PeerID
    started: float
    max_bytes: int
    deadline: float
    bytes_src_to_dst: int = 0
    bytes_dst_to_src: int = 0
    ended: str | None = None

    @property
    def bytes(self) -> int:
        return self.bytes_src_to_dst + self.bytes_dst_to_src


@dataclass(slots=True)
class RelayBook:
    """Reservations and circuits of one relay, with its limits (sans-IO)."""

    limits: RelayLimits
    reservations: dict[PeerID, Reservation] = field(default_factory=dict)
    circuits: dict[int, Circuit] = field(default_factory=dict)
    refused: Counter[str] = field(default_factory=Counter)
    finished: list[Circuit] = field(default_factory=list)  # the last few, for status
    _ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))

    def reserve(self, peer: PeerID, ip: str, now: float) -> Reservation | str:
        """A new or refreshed reservation, or the reason for refusing it."""
        self.expire(now)
        lim = self.limits
        existing = self.reservations.get(peer)
        if existing is None:
            if len(self.reservations) >= lim.max_reservations:
                return self._refuse(f"reservation limit ({lim.max_reservations}) reached")
            same_ip = sum(1 for r in self.reservations.values() if r.ip == ip)
            if same_ip >= lim.max_reservations_per_ip:
                return self._refuse(
                    f"per-IP reservation limit ({lim.max_reservations_per_ip}) reached"
                )
            existing = Reservation(peer, ip, 0.0)
            self.reservations[peer] = existing
        existing.expires = now + lim.reservation_ttl
        return existing

    def release(self, peer: PeerID, reservation: Reservation | None = None) -> None:
        if reservation is None or self.reservations.get(peer) is reservation:
            self.reservations.pop(peer, None)

    def expire(self, now: float) -> list[PeerID]:
        gone = [p for p, r in self.reservations.items() if r.expires <= now]
        for p in gone:
            del self.reservations[p]
        return gone

    def open_circuit(self, src: PeerID, dst: PeerID, now: float) -> Circuit | str:
        self.expire(now)
        lim = self.limits
        if dst not in self.reservations:
            return self._refuse(f"{dst.short()} has no reservation on this relay")
        if src == dst:
            return self._refuse("a peer cannot relay to itself")
        if len(self.circuits) >= lim.max_circuits:
            return self._refuse(f"relayed connection limit ({lim.max_circuits}) reached")
        for p in (src, dst):
            n = sum(1 for c in self.circuits.values() if p in (c.src, c.dst))
            if n >= lim.max_circuits_per_peer:
                return self._refuse(
                    f"{p.short()} has {n} relayed connections (limit {lim.max_circuits_per_peer})"
                )
        circuit = Circuit(
            next(self._ids), src, dst, now, lim.circuit_bytes, now + lim.circuit_duration
        )
        self.circuits[circuit.id] = circuit
        return circuit

    def account(self, circuit: Circuit, n: int, from_src: bool) -> str | None:
        """Count `n` relayed bytes; the reason to cut the circuit when over its limit."""
        if from_src:
            circuit.bytes_src_to_dst += n
        else:
            circuit.bytes_dst_to_src += n
        if circuit.bytes > circuit.max_bytes:
            return f"{LIMIT_RESET_PREFIX}: more than {circuit.max_bytes} bytes relayed"
        return None

    def close_circuit(self, circuit: Circuit, reason: str) -> None:
        if self.circuits.pop(circuit.id, None) is not None:
            circuit.ended = reason
            self.finished.append(circuit)
            del self.finished[:-32]

    def _refuse(self, reason: str) -> str:
        self.refused[reason.split(" (", maxsplit=1)[0]] += 1
        return reason


class RelayService:
    """The relay on `host`: serves reservations and splices circuits.

    `accepting()` says whether to serve at all (a relay must be publicly reachable);
    `addresses()` are the relay's own addresses, returned with a reservation.
    """

    def __init__(
        self,
        host: Host,
        limits: RelayLimits,
        *,
        accepting: Callable[[], bool],
        addresses: Callable[[], list[Multiaddr]],
    ) -> None:
        self.host = host
        self.limits = limits
        self.book = RelayBook(limits)
        self._accepting = accepting
        self._addresses = addresses
        self._loop = asyncio.get_running_loop()
        self._streams: set[Stream] = set()  # reservation and circuit streams, reset on close
        self._closed = False
        # A test hook: called with every spliced chunk (the relay sees only ciphertext).
        self.tap: Callable[[Circuit, bytes], None] | None = None

    def start(self) -> None:
        self.host.set_handler(HOP_PROTOCOL, self._serve_hop)

    def close(self) -> None:
        self._closed = True
        self.host.remove_handler(HOP_PROTOCOL)
        for stream in list(self._streams):
            stream.reset("relay shutting down")
        self._streams.clear()

    def status(self) -> dict[str, object]:
        now = self._loop.time()
        self.book.expire(now)
        return {
            "reservations": [
                {"peer": str(r.peer), "expires_in": round(r.expires - now, 1)}
                for r in self.book.reservations.values()
            ],
            "circuits": [_circuit_status(c, now) for c in self.book.circuits.values()],
            "finished": [_circuit_status(c, now) for c in self.book.finished],
            "refused": dict(self.book.refused),
        }

    # --- hop -----------------------------------------------------------------------------------

    async def _serve_hop(self, stream: Stream) -> None:
        conn = stream.connection
        ms = wire.messages(stream)
        async with asyncio.timeout(self.limits.connect_timeout):
            msg = await wire.recv_map(ms, "relay hop")
        kind = parse_hop_kind(msg)
        refusal = None
        if self._closed or not self._accepting():
            refusal = "this relay is not publicly reachable"
        elif conn.kind == "relayed":
            refusal = "relaying through relays is not supported"
        if refusal is not None:
            self.book.refused[refusal] += 1
            await ms.send({"status": "refused", "error": refusal})
            return
        if kind == "reserve":
            await self._reservation(stream, ms)
        elif kind == "connect":
            await self._connect(stream, ms, parse_hop_connect(msg))
        else:
            raise ProtocolViolation(f"relay hop: unknown request {kind!r}")

    async def _reservation(self, stream: Stream, ms: wire.MessageStream) -> None:
        conn = stream.connection
        peer = conn.remote_peer
        ip = conn.remote_address[0] if conn.remote_address else "?"
        result = self.book.reserve(peer, ip, self._loop.time())
        if isinstance(result, str):
            await ms.send({"status": "refused", "error": result})
            return
        reservation = result
        reservation.conn = conn
        self._streams.add(stream)
        try:
            while True:
                await ms.send(
                    {
                        "status": "ok",
                        "ttl": self.limits.reservation_ttl,
                        "addrs": [str(a) for a in self._addresses()][: wire.MAX_ADDRS],
                    }
                )
                remaining = reservation.expires - self._loop.time()
                try:
                    async with asyncio.timeout(max(remaining, 0.0)):
                        msg = await wire.recv_map(ms, "relay refresh")
                except TimeoutError:
                    await ms.send({"status": "expired", "error": "reservation expired"})
                    return
                except EOFError:
                    return  # the client released it
                parse_refresh(msg)
                again = self.book.reserve(peer, ip, self._loop.time())
                if isinstance(again, str):
                    await ms.send({"status": "refused", "error": again})
                    return
                reservation = again
                reservation.conn = conn
        finally:
            self._streams.discard(stream)
            self.book.release(peer, reservation)

    async def _connect(self, src_stream: Stream, ms: wire.MessageStream, dst: PeerID) -> None:
        src = src_stream.connection.remote_peer
        now = self._loop.time()
        result = self.book.open_circuit(src, dst, now)
        if isinstance(result, str):
            await ms.send({"status": "refused", "error": result})
            return
        circuit = result
        reason = "cancelled"
        dst_stream: Stream | None = None
        try:
            reservation = self.book.reservations[dst]
            dst_conn = reservation.conn
            if dst_conn is None or not dst_conn.is_open:
                reason = f"{dst.short()} is not connected to the relay"
                await ms.send({"status": "refused", "error": reason})
                return
            limits = {"duration": self.limits.circuit_duration, "bytes": self.limits.circuit_bytes}
            try:
                async with asyncio.timeout(self.limits.connect_timeout):
                    dst_stream = await dst_conn.open_stream(STOP_PROTOCOL)
                    dms = wire.messages(dst_stream)
                    await dms.send({"type": "connect", "peer": src.to_bytes(), "limits": limits})
                    answer = await wire.recv_map(dms, "relay stop")
            except (TransportError, TimeoutError, EOFError) as e:
                reason = f"{dst.short()} did not accept: {type(e).__name__}: {e}"
                await ms.send({"status": "refused", "error": reason[:500]})
                return
            if answer.get("status") != "ok":
                error = str(answer.get("error", "refused"))[:200]
                reason = f"{dst.short()} refused: {error}"
                await ms.send({"status": "refused", "error": reason})
                return
            await ms.send({"status": "ok", "limits": limits})
            reason = "cancelled"
            reason = await self._splice(circuit, src_stream, dst_stream)
        finally:
            self.book.close_circuit(circuit, reason)
            if dst_stream is not None and reason != "finished":
                dst_stream.reset(reason[:200])

    async def _splice(self, circuit: Circuit, src: Stream, dst: Stream) -> str:
        """Pump bytes both ways until both ends close; the reason the circuit ended."""
        self._streams.update((src, dst))
        cut: list[str] = []

        async def pump(a: Stream, b: Stream, from_src: bool) -> None:
            buf = bytearray(_SPLICE_CHUNK)
            view = memoryview(buf)
            while True:
                n = await a.readinto(view)
                if n == 0:
                    await b.close()
                    return
                over = self.book.account(circuit, n, from_src)
                if over is not None:
                    cut.append(over)
                    raise _Cut(over)
                if self.tap is not None:
                    self.tap(circuit, bytes(view[:n]))
                await b.write(view[:n])

        try:
            remaining = circuit.deadline - self._loop.time()
            async with asyncio.timeout(remaining):
                async with asyncio.TaskGroup() as tg:
                    tg.create_task(pump(src, dst, True))
                    tg.create_task(pump(dst, src, False))
            return "finished"
        except TimeoutError:
            reason = f"{LIMIT_RESET_PREFIX}: duration {self.limits.circuit_duration:g}s reached"
        except BaseExceptionGroup as eg:
            if cut:
                reason = cut[0]
            else:
                errors = [e for e in eg.exceptions if isinstance(e, TransportError)]
                if len(errors) != len(eg.exceptions):
                    raise
                reason = f"circuit broken: {errors[0]}"
        finally:
            self._streams.difference_update((src, dst))
        log.info(
            "relay: circuit %s -> %s ended: %s", circuit.src.short(), circuit.dst.short(), reason
        )
        src.reset(reason[:200])
        dst.reset(reason[:200])
        return reason


class _Cut(Exception):
    pass


def _circuit_status(c: Circuit, now: float) -> dict[str, object]:
    return {
        "src": str(c.src),
        "dst": str(c.dst),
        "bytes": c.bytes,
        "bytes_src_to_dst": c.bytes_src_to_dst,
        "bytes_dst_to_src": c.bytes_dst_to_src,
        "age_s": round(now - c.started, 3),
        "ended": c.ended,
    }
