"""The DHT's client side of one request (dial or reuse, redial, deadline, busy
answers, idle-connection pruning) and the blacklist of peers that failed us."""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from shoal.transport import rpc
from shoal.transport.connection import Connection
from shoal.transport.errors import ConnectionLost, ProtocolNotSupported, StreamReset
from shoal.transport.host import Host
from shoal.transport.identity import PeerID
from shoal.transport.multiaddr import Multiaddr
from shoal.transport.tasks import TaskSet

from .errors import busy_from

# A request's deadline on a far link, in RTTs of the link: on a connection (a stream,
# its protocol, the answer, with room for queueing) and with a dial first (TCP and
# Noise too); never past MAX_HOP_TIMEOUT, never under `hop_timeout`.
REQUEST_RTTS = 4
DIAL_RTTS = 8
MAX_HOP_TIMEOUT = 10.0
# The median RTT is computed again at most this often: a node dials new peers by
# the dozen a second, and each computation sorts the RTTs of all its connections
# (hundreds), which moves by little in a second.
TYPICAL_RTT_TTL_S = 1.0
# The blacklist drops its expired entries past this many.
_BLACKLIST_BOUND = 4096


class Blacklist:
    """Peers skipped by lookups until a time of the loop's clock (sans-I/O: the
    caller passes `now`)."""

    def __init__(self) -> None:
        self.until: dict[PeerID, float] = {}

    def blocked(self, peer: PeerID, now: float) -> bool:
        until = self.until.get(peer)
        if until is None:
            return False
        if until <= now:
            del self.until[peer]
            return False
        return True

    def block(self, peer: PeerID, until: float, now: float) -> None:
        self.until[peer] = until
        if len(self.until) > _BLACKLIST_BOUND:  # bounded: drop expired entries
            self.until = {p: t for p, t in self.until.items() if t > now}

    def count(self, now: float) -> int:
        return sum(1 for t in self.until.values() if t > now)


class Requester:
    """Sends one DHT request to a peer over `host`, dialing it first when needed."""

    def __init__(
        self,
        host: Host,
        protocol: str,
        hop_timeout: float,
        max_connections: int | None,
        tasks: TaskSet,
        count: Callable[[str], int],
    ) -> None:
        self.host = host
        self.protocol = protocol
        self.hop_timeout = hop_timeout
        # Connections this node dialed, least recently used first; with
        # `max_connections` the idle ones beyond it are closed, so that many
        # peers in one process (or a big network) do not exhaust descriptors.
        self.max_connections = max_connections
        self.dialed: dict[PeerID, None] = {}
        self._tasks = tasks
        self._count = count
        self._typical: tuple[float, float] | None = None  # (loop time, median RTT)
        # The addresses (`from`) each connection's remote has taken from us: a request
        # over that connection leaves them out while they are still ours.
        self._said: weakref.WeakKeyDictionary[Connection, list[str]] = weakref.WeakKeyDictionary()

    def _over(self, conn: Connection | None, payload: Any) -> tuple[Any, list[str] | None]:
        """`payload` as it goes over `conn`, and the addresses it tells the remote (None:
        none new). Addresses once per connection (docs/architecture/dht.md): a request
        leaves out the `from` that this connection's remote answered a request with
        before, so a round's dozens of small requests do not each carry 30 to 60 bytes
        the remote holds already. A new connection, or addresses that changed, get it."""
        if not isinstance(payload, dict) or payload.get("client") is True:
            return payload, None
        said = payload.get("from")
        if not said:
            return payload, None
        if conn is not None and self._said.get(conn) == said:
            return {k: v for k, v in payload.items() if k != "from"}, None
        return payload, said

    async def _call(self, peer: PeerID, method: str, payload: Any, timeout: float) -> Any:
        conn = self.host.connection(peer)
        sent, said = self._over(conn, payload)
        reply = await rpc.call(self.host, peer, self.protocol, method, sent, timeout=timeout)
        if said is not None and conn is not None and busy_from(peer, reply) is None:
            # (A busy answer came before the request was read: it took nothing.)
            self._said[conn] = said
        return reply

    async def request(
        self, peer: PeerID, addrs: Sequence[Multiaddr], method: str, payload: Any
    ) -> Any:
        self._count("requests_sent")
        hop = self.hop_timeout_for(peer)
        async with asyncio.timeout(hop):
            reused = self.host.connection(peer) is not None
            if not reused:
                await self.host.connect(peer, addrs, timeout=hop)
            if self.max_connections is not None:
                self.dialed.pop(peer, None)
                self.dialed[peer] = None
                self._prune_connections()
            try:
                reply = await self._call(peer, method, payload, hop)
            except (ConnectionLost, StreamReset) as e:
                if not reused or isinstance(e, ProtocolNotSupported):
                    raise
                # The idle connection we reused was being closed by either side
                # (connection pruning) as the request went out. That says nothing
                # about the peer, and every DHT request is idempotent: ask again on
                # a fresh connection, within the same deadline.
                self._count("requests_redialed")
                await self.host.connect(peer, addrs, timeout=hop)
                reply = await self._call(peer, method, payload, hop)
        busy = busy_from(peer, reply)
        if busy is not None:
            raise busy
        return reply

    def hop_timeout_for(self, peer: PeerID) -> float:
        """`hop_timeout`, or longer for a far peer: a request on a connection takes a
        few RTTs (a stream, its protocol, the answer), a dial a few more (TCP, Noise).
        The RTT is the connection's, else the median of our other connections' (our
        own access link is usually what makes everyone far)."""
        conn = self.host.connection(peer)
        rtt = conn.rtt if conn is not None else None
        if rtt is None:
            rtt = self.typical_rtt()
        rtts = REQUEST_RTTS if conn is not None else DIAL_RTTS
        return min(max(self.hop_timeout, rtts * rtt + 0.25), MAX_HOP_TIMEOUT)

    def typical_rtt(self) -> float:
        """The median RTT of our connections (0 before any is measured), as of at most
        `TYPICAL_RTT_TTL_S` ago."""
        now = asyncio.get_running_loop().time()
        if self._typical is not None and now - self._typical[0] < TYPICAL_RTT_TTL_S:
            return self._typical[1]
        known = sorted(c.rtt for c in self.host.connections.values() if c.rtt is not None)
        if not known:
            return 0.0
        self._typical = (now, known[len(known) // 2])
        return self._typical[1]

    def _prune_connections(self) -> None:
        assert self.max_connections is not None
        excess = len(self.dialed) - self.max_connections
        for peer in list(self.dialed):
            if excess <= 0:
                break
            del self.dialed[peer]
            excess -= 1
            conn = self.host.connection(peer)
            if conn is not None and not conn.streams:
                self._tasks.spawn(self.host.disconnect(peer))
