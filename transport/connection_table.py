"""The host's connections: every one it holds, the one per peer that streams go to,
which of two duplicates to keep, and the byte totals that outlive them."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, MutableSet
from typing import TypeVar

from .connection import Connection
from .identity import PeerID

log = logging.getLogger("shoal.transport")

ConnectionCallback = Callable[[Connection], None]
T = TypeVar("T")


class OrderedSet(MutableSet[T]):
    """A set that iterates in the order its items were added. A set of connections
    iterates in the order of their addresses in memory, and the host acts on them in
    that order (closing all of them, trimming among equally idle ones, promoting a
    duplicate): two runs of the simulator with one seed diverged where a host closed
    its 40 connections in another order (moshpit_256_slots_churn), and a real peer's
    behaviour followed its heap's history."""

    __slots__ = ("_items",)

    def __init__(self, items: Iterable[T] = ()) -> None:
        self._items: dict[T, None] = dict.fromkeys(items)

    def __contains__(self, item: object) -> bool:
        return item in self._items

    def __iter__(self) -> Iterator[T]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def add(self, item: T) -> None:
        self._items[item] = None

    def discard(self, item: T) -> None:
        self._items.pop(item, None)

    def __repr__(self) -> str:
        return f"OrderedSet({list(self._items)!r})"


class ConnectionTable:
    """`conns`: the connection per peer; `all`: every connection, handshaking and
    superseded ones included (sans-I/O: the host feeds it its events)."""

    def __init__(self, local_peer: PeerID, close_grace: float) -> None:
        self.local_peer = local_peer
        self.close_grace = close_grace
        self.conns: dict[PeerID, Connection] = {}
        self.all: OrderedSet[Connection] = OrderedSet()
        # The registered connections of each peer (duplicates included): whom to promote
        # when its connection closes, without a scan of `all` (hundreds of connections,
        # closed by the dozen a second on a busy DHT node).
        self._of_peer: dict[PeerID, OrderedSet[Connection]] = {}
        # Bytes of connections already closed: the totals must not drop when one closes.
        self.closed_bytes_sent = 0
        self.closed_bytes_received = 0
        self.closed_sent_by_protocol: Counter[str] = Counter()
        self._listeners: list[tuple[ConnectionCallback | None, ConnectionCallback | None]] = []

    def add_listener(
        self, opened: ConnectionCallback | None, closed: ConnectionCallback | None
    ) -> Callable[[], None]:
        """See `Host.add_connection_listener`; the function that removes them."""
        entry = (opened, closed)
        self._listeners.append(entry)

        def remove() -> None:
            if entry in self._listeners:
                self._listeners.remove(entry)

        return remove

    def notify(self, conn: Connection, *, opened: bool) -> None:
        """Tell the listeners that `conn` opened (its handshake done) or closed."""
        for entry in list(self._listeners):
            callback = entry[0] if opened else entry[1]
            if callback is not None:
                try:
                    callback(conn)
                except Exception:
                    log.exception("connection listener failed")

    def register(self, conn: Connection) -> None:
        """A connection whose handshake named its peer: the peer's connection, unless a
        better one is there (the other is retired)."""
        peer = conn.remote_peer
        self._of_peer.setdefault(peer, OrderedSet()).add(conn)
        current = self.conns.get(peer)
        if current is None or not current.accepting_streams:
            # (none, closed, retired, or going away: an idle one that we or the remote
            # closed while the other side dialed again, its last streams still served)
            self.conns[peer] = conn
            return

        # Two connections to one peer. A direct one beats a relayed one (both sides see
        # which is which). Otherwise (we dialed each other at once) both sides keep the
        # one dialed by the smaller peer ID, so they agree without talking.
        def dialer(c: Connection) -> PeerID:
            return self.local_peer if c.initiator else peer

        current_relayed, new_relayed = current.kind == "relayed", conn.kind == "relayed"
        if current_relayed != new_relayed:
            keep, drop = (conn, current) if current_relayed else (current, conn)
        elif dialer(current) == dialer(conn):  # same dialer twice: keep the older one
            keep, drop = current, conn
        else:
            keep, drop = (current, conn) if dialer(current) <= dialer(conn) else (conn, current)
        self.conns[peer] = keep
        drop.retire(self.close_grace)

    def closed(self, conn: Connection) -> bool:
        """Forget a closed connection; whether it was one of ours (admitted)."""
        ours = conn in self.all
        if ours:
            self.all.discard(conn)
            self.closed_bytes_sent += conn.bytes_sent
            self.closed_bytes_received += conn.bytes_received
            self.closed_sent_by_protocol.update(conn.sent_by_protocol)
        peer = conn.remote_peer
        if peer is None:
            return ours
        of_peer = self._of_peer.get(peer)
        if of_peer is not None:
            of_peer.discard(conn)
            if not of_peer:
                del self._of_peer[peer]
        if self.conns.get(peer) is conn:
            del self.conns[peer]
            # Promote a surviving duplicate, if any, so the peer stays reachable.
            survivors = [o for o in of_peer or () if o.is_open and o in self.all]
            survivors.sort(key=lambda o: o.kind == "relayed")  # direct ones first
            if survivors:
                self.conns[peer] = survivors[0]
                survivors[0].superseded = False
        return ours

    def bytes_sent(self) -> int:
        return self.closed_bytes_sent + sum(c.bytes_sent for c in self.all)

    def bytes_received(self) -> int:
        return self.closed_bytes_received + sum(c.bytes_received for c in self.all)

    def sent_by_protocol(self) -> dict[str, int]:
        total = self.closed_sent_by_protocol.copy()
        for c in self.all:
            total.update(c.sent_by_protocol)
        return dict(total)


class ExpectedPunches:
    """Inbound connections we expect from a hole punch: (remote IP, port or None for
    any) -> (peer, our handshake role). The punch fixes the roles over the relay."""

    def __init__(self) -> None:
        self.expected: dict[tuple[str, int | None], tuple[PeerID, bool]] = {}

    def expect(
        self, ip: str, peer: PeerID, *, initiator: bool, port: int | None = None
    ) -> Callable[[], None]:
        entry, key = (peer, initiator), (ip, port)
        self.expected[key] = entry

        def remove() -> None:
            if self.expected.get(key) == entry:
                del self.expected[key]

        return remove

    def claim(self, conn: Connection) -> None:
        """An inbound direct connection from an expected address becomes the punch's."""
        if not conn.outbound and conn.kind == "direct" and conn.remote_address is not None:
            ip, port = conn.remote_address
            expected = self.expected.get((ip, port)) or self.expected.get((ip, None))
            if expected is not None:
                peer, initiator = expected
                conn.set_role(initiator, peer)
                conn.kind = "hole-punched"
