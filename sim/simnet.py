"""An in-memory network of simulated hosts: TCP-like streams with latency, bandwidth, loss,
NAT, partitions and crashes, delivered by the virtual-time loop's timers."""

from __future__ import annotations

import asyncio
import contextvars
import errno
import math
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vtime import VirtualTimeLoop

# The simulated host whose code is running: the source of the connections it opens.
CURRENT_HOST: contextvars.ContextVar[SimHost] = contextvars.ContextVar("sim_host")

# A TCP retransmission after a lost segment: at least this long (Linux's minimum RTO).
MIN_RTO_S = 0.2
SLOTS_PER_S = 1000  # deliveries are rounded up to the millisecond


@dataclass(frozen=True, slots=True)
class Link:
    """A host's access link: bytes per second each way, one-way latency to the core,
    and the probability that a write (a segment) is lost and has to be retransmitted."""

    up_Bps: float
    down_Bps: float
    latency_s: float
    loss: float = 0.0


@dataclass(eq=False)
class SimHost:
    """One simulated machine: its address, link, and whether it accepts inbound
    connections (`nat`: a NAT or firewall drops unsolicited SYNs)."""

    ip: str
    link: Link
    nat: bool = False
    alive: bool = True
    group: int = 0  # partition group: hosts in different groups cannot reach each other
    context: contextvars.Context = field(default_factory=contextvars.Context)
    listeners: dict[int, Callable[[], asyncio.BaseProtocol]] = field(default_factory=dict)
    # Its open transports, in the order they opened (a dict: a set of them would be
    # ordered by their addresses in memory, and `heal` resends in this order).
    transports: dict[SimTransport, None] = field(default_factory=dict)
    up_free_at: float = 0.0  # when the uplink has sent everything queued so far
    down_free_at: float = 0.0
    next_port: int = 40000


@dataclass
class NetStats:
    connects: int = 0
    refused: int = 0
    unreachable: int = 0
    writes: int = 0
    bytes: int = 0
    lost_segments: int = 0
    dropped_writes: int = 0  # to or from a crashed host
    # Writes that waited behind earlier ones in their sender's uplink queue longer than
    # a DHT request's usual deadline, and the longest wait: a congested uplink.
    writes_queued_over_1s: int = 0
    max_uplink_queue_s: float = 0.0


class SimServer:
    """What `loop.create_server` returns: enough of asyncio.Server for the host."""

    class _Sock:
        def __init__(self, ip: str, port: int) -> None:
            self._name = (ip, port)

        def getsockname(self) -> tuple[str, int]:
            return self._name

    def __init__(self, net: SimNetwork, host: SimHost, port: int) -> None:
        self._net, self._host, self._port = net, host, port
        self.sockets = [self._Sock(host.ip, port)]

    def close(self) -> None:
        self._host.listeners.pop(self._port, None)

    async def wait_closed(self) -> None:
        return None

    def is_serving(self) -> bool:
        return self._port in self._host.listeners


class SimNetwork:
    """The hosts and the links between them; connections are pairs of SimTransports."""

    def __init__(self, loop: VirtualTimeLoop, rng: random.Random) -> None:
        self.loop = loop
        self.rng = rng
        self.hosts: dict[str, SimHost] = {}
        self.stats = NetStats()
        # Deliveries due in each millisecond slot, in the order they were sent: one
        # loop timer per slot rather than per segment (the loop's timer heap compares
        # in Python; at thousands of peers its comparisons were the largest cost).
        self._slots: dict[int, list[tuple[SimTransport, str, bytes | None]]] = {}
        self._quiet = contextvars.Context()

    # --- topology ---------------------------------------------------------------------------

    def add_host(self, ip: str, link: Link, *, nat: bool = False) -> SimHost:
        if ip in self.hosts and self.hosts[ip].alive:
            raise ValueError(f"{ip} is in use")
        host = SimHost(ip, link, nat)
        host.context.run(CURRENT_HOST.set, host)
        self.hosts[ip] = host
        return host

    def crash(self, host: SimHost) -> None:
        """The machine stops: it sends nothing more and what reaches it is lost; its
        peers learn it only from their own timeouts, as with a pulled cable."""
        host.alive = False
        host.listeners.clear()

    def partition(self, groups: list[set[str]]) -> None:
        """Hosts in different `groups` (by IP) cannot reach each other; hosts in none
        of them form one more group."""
        for h in self.hosts.values():
            h.group = 0
        for i, ips in enumerate(groups, 1):
            for ip in ips:
                if ip in self.hosts:
                    self.hosts[ip].group = i

    def heal(self) -> None:
        """End every partition: segments held back at the cut are retransmitted now."""
        for h in self.hosts.values():
            h.group = 0
        for h in list(self.hosts.values()):
            for t in list(h.transports):
                t._release_held()

    def reachable(self, a: SimHost, b: SimHost) -> bool:
        return a.alive and b.alive and a.group == b.group

    # --- connections --------------------------------------------------------------------------

    def listen(self, ip: str, port: int, factory: Callable[[], Any]) -> SimServer:
        host = CURRENT_HOST.get()
        if ip not in (host.ip, "0.0.0.0"):
            raise OSError(errno.EADDRNOTAVAIL, f"{ip} is not an address of {host.ip}")
        if port == 0:
            port = host.next_port
            host.next_port += 1
        if port in host.listeners:
            raise OSError(errno.EADDRINUSE, f"{host.ip}:{port} is in use")
        host.listeners[port] = factory
        return SimServer(self, host, port)

    async def connect(
        self, ip: str, port: int, factory: Callable[[], Any]
    ) -> tuple[SimTransport, Any]:
        src = CURRENT_HOST.get()
        dst = self.hosts.get(ip)
        self.stats.connects += 1
        if dst is None or dst.nat or not self.reachable(src, dst):
            # The SYN goes nowhere (no such host, a NAT, a crash, a partition): the
            # caller's timeout decides, as with a real unanswered dial.
            self.stats.unreachable += 1
            await asyncio.Future()
        one_way = src.link.latency_s + dst.link.latency_s
        await asyncio.sleep(2 * one_way)  # SYN, SYN-ACK
        accept = dst.listeners.get(port)
        if accept is None or not self.reachable(src, dst):
            self.stats.refused += 1
            raise ConnectionRefusedError(errno.ECONNREFUSED, f"{ip}:{port} refused")
        local_port = src.next_port
        src.next_port += 1
        ours = SimTransport(self, src, (src.ip, local_port), (ip, port))
        theirs = SimTransport(self, dst, (ip, port), (src.ip, local_port))
        ours.peer, theirs.peer = theirs, ours
        self.loop.call_soon(theirs._accept, accept, context=dst.context)
        protocol = factory()
        ours._start(protocol)
        return ours, protocol

    def deliver_at(self, at: float, to: SimTransport, kind: str, data: bytes | None) -> float:
        """Hand `data` to `to` at time `at` rounded up to the millisecond; that time."""
        slot = math.ceil(at * SLOTS_PER_S)
        due = self._slots.get(slot)
        if due is None:
            due = self._slots[slot] = []
            self.loop.call_at(slot / SLOTS_PER_S, self._deliver, slot, context=self._quiet)
        due.append((to, kind, data))
        return slot / SLOTS_PER_S

    def _deliver(self, slot: int) -> None:
        for to, kind, data in self._slots.pop(slot):
            self.loop.run_as(to.owner.context, to._receive, kind, data)

    def _arrival(self, src: SimHost, dst: SimHost, n: int) -> float:
        """When `n` bytes written now by `src` have reached `dst`: queued behind what
        each end's link already carries, serialised at each end's rate, plus the
        propagation delay; a lost segment waits for its retransmission."""
        now = self.loop.time()
        queued = src.up_free_at - now
        if queued > 1.0:
            self.stats.writes_queued_over_1s += 1
            self.stats.max_uplink_queue_s = max(self.stats.max_uplink_queue_s, queued)
        depart = max(now, src.up_free_at) + n / src.link.up_Bps
        src.up_free_at = depart
        arrive = depart + src.link.latency_s + dst.link.latency_s
        done = max(arrive, dst.down_free_at) + n / dst.link.down_Bps
        dst.down_free_at = done
        loss = max(src.link.loss, dst.link.loss)
        if loss and self.rng.random() < loss:
            self.stats.lost_segments += 1
            done += max(MIN_RTO_S, 2 * (src.link.latency_s + dst.link.latency_s))
        return done


class SimTransport(asyncio.Transport):
    """One end of a simulated TCP connection, for a Protocol or a BufferedProtocol."""

    def __init__(
        self, net: SimNetwork, owner: SimHost, local: tuple[str, int], remote: tuple[str, int]
    ) -> None:
        super().__init__()
        self._net, self.owner = net, owner
        self._local, self._remote = local, remote
        self.peer: SimTransport | None = None
        self._protocol: Any = None
        self._closing = False  # we closed (or were told): no more writes
        self._lost = False  # connection_lost was called
        self._paused = False
        # Arrived, not yet delivered (paused): made when needed, dropped once drained
        # (thousands of peers' idle connections would hold an empty deque each).
        self._inbox: deque[bytes] | None = None
        self._last_arrival = 0.0  # in order: no segment overtakes an earlier one
        self._held: list[tuple[str, Any]] = []  # sent across a partition, not yet arrived
        owner.transports[self] = None

    # --- set-up -------------------------------------------------------------------------------

    def _accept(self, accept: Callable[[], Any]) -> None:
        if not self.owner.alive:
            return
        self._start(accept())

    def _start(self, protocol: Any) -> None:
        self._protocol = protocol
        protocol.connection_made(self)

    # --- asyncio.Transport --------------------------------------------------------------------

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": self._remote, "sockname": self._local}.get(name, default)

    def is_closing(self) -> bool:
        return self._closing

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._protocol = protocol

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._protocol

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass  # the simulated socket buffer is unbounded; the links' queues set the pace

    def get_write_buffer_size(self) -> int:
        return 0

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._closing or not data:
            return
        self._send("data", bytes(data))

    def writelines(self, list_of_data: Any) -> None:
        self.write(b"".join(list_of_data))

    def write_eof(self) -> None:
        self.close()

    def can_write_eof(self) -> bool:
        return True

    def pause_reading(self) -> None:
        self._paused = True

    def resume_reading(self) -> None:
        if self._paused:
            self._paused = False
            self._net.loop.call_soon(self._drain_inbox, context=self.owner.context)

    def is_reading(self) -> bool:
        return not self._paused

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        self._send("fin", None)
        self._net.loop.call_soon(self._finish, None, context=self.owner.context)

    def abort(self) -> None:
        if self._lost:
            return
        self._closing = True
        self._send("rst", None)
        self._net.loop.call_soon(self._finish, None, context=self.owner.context)

    # --- the wire -----------------------------------------------------------------------------

    def _send(self, kind: str, data: bytes | None) -> None:
        net, peer = self._net, self.peer
        if peer is None or not self.owner.alive:
            net.stats.dropped_writes += 1
            return
        if not peer.owner.alive:
            net.stats.dropped_writes += 1  # nobody there: no answer, no reset
            return
        if not net.reachable(self.owner, peer.owner):
            self._held.append((kind, data))  # retransmitted once the partition heals
            return
        n = len(data) if data else 40
        net.stats.writes += 1
        net.stats.bytes += n
        at = max(net._arrival(self.owner, peer.owner, n), self._last_arrival)
        self._last_arrival = net.deliver_at(at, peer, kind, data)

    def _release_held(self) -> None:
        held, self._held = self._held, []
        for kind, data in held:
            self._send(kind, data)

    def _receive(self, kind: str, data: bytes | None) -> None:
        if self._lost or not self.owner.alive:
            return
        if kind == "rst":
            self._inbox = None
            self._closing = True
            self._finish(ConnectionResetError(errno.ECONNRESET, "connection reset by peer"))
            return
        if self._inbox is None:
            self._inbox = deque()
        self._inbox.append(data if kind == "data" else b"")  # b"": end of stream
        if not self._paused:
            self._drain_inbox()

    def _drain_inbox(self) -> None:
        try:
            self._deliver()
        finally:
            if not self._inbox:
                self._inbox = None

    def _deliver(self) -> None:
        protocol = self._protocol
        while self._inbox and not self._paused and not self._lost:
            data = self._inbox.popleft()
            if not data:
                keep_open = protocol.eof_received()
                if not keep_open:
                    self._closing = True
                    self._finish(None)
                return
            if hasattr(protocol, "get_buffer"):
                view = memoryview(data)
                while view and not self._lost:
                    buf = protocol.get_buffer(len(view))
                    n = min(len(buf), len(view))
                    buf[:n] = view[:n]
                    protocol.buffer_updated(n)
                    view = view[n:]
            else:
                protocol.data_received(data)

    def _finish(self, exc: Exception | None) -> None:
        if self._lost:
            return
        self._lost = True
        self._closing = True
        self.owner.transports.pop(self, None)
        if self._protocol is not None:
            self._protocol.connection_lost(exc)
