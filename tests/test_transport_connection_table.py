"""The host's table of connections: which one a peer's streams go to, and which one takes
over when it closes (sans-I/O: connections stand in as plain objects)."""

from __future__ import annotations

from collections import Counter
from typing import Any, cast

from shoal.transport.connection import Connection
from shoal.transport.connection_table import ConnectionTable
from shoal.transport.identity import Identity, PeerID


class _Conn:
    """What the table reads of a connection."""

    def __init__(self, peer: PeerID, *, kind: str = "direct", initiator: bool = True) -> None:
        self.remote_peer = peer
        self.kind = kind
        self.initiator = initiator
        self.is_open = True
        self.superseded = False
        self.bytes_sent = self.bytes_received = 0
        self.sent_by_protocol: Counter[str] = Counter()

    @property
    def accepting_streams(self) -> bool:
        return self.is_open and not self.superseded

    def retire(self, grace: float) -> None:
        self.superseded = True

    def close(self, table: ConnectionTable) -> None:
        self.is_open = False
        assert table.closed(cast(Connection, self))


def _table() -> tuple[ConnectionTable, PeerID, PeerID]:
    return ConnectionTable(Identity.generate().peer_id, 1.0), *(
        Identity.generate().peer_id for _ in range(2)
    )


def _add(table: ConnectionTable, conn: Any) -> Any:
    table.all.add(conn)
    table.register(conn)
    return conn


def test_when_a_peers_connection_closes_its_open_duplicate_takes_over_direct_first() -> None:
    table, peer, other = _table()
    direct = _add(table, _Conn(peer))
    relayed = _add(table, _Conn(peer, kind="relayed"))
    second = _add(table, _Conn(peer))  # (dialed by us again: the older one stays)
    _add(table, _Conn(other))  # (another peer's: never promoted for this one)
    assert table.conns[peer] is direct and relayed.superseded and second.superseded
    direct.close(table)
    assert table.conns[peer] is second and not second.superseded  # the direct one
    second.close(table)
    assert table.conns[peer] is relayed and not relayed.superseded
    relayed.close(table)
    assert peer not in table.conns and len(table.conns) == 1


def test_a_closed_duplicate_is_not_promoted_and_a_new_connection_starts_afresh() -> None:
    table, peer, _ = _table()
    first = _add(table, _Conn(peer))
    duplicate = _add(table, _Conn(peer))
    duplicate.is_open = False  # (closing: its close not yet handled)
    first.close(table)
    assert peer not in table.conns
    duplicate.close(table)
    fresh = _add(table, _Conn(peer))
    assert table.conns[peer] is fresh and not fresh.superseded
    fresh.close(table)
    assert table.conns == {} and table.all == set()


def test_connections_are_listed_in_the_order_they_were_admitted_not_by_address() -> None:
    # The host closes all of them, trims among equally idle ones and promotes a
    # duplicate in this order: in the order of their addresses in memory, two runs of
    # one simulated scenario with one seed diverged.
    table, _, _ = _table()
    peer_ids = [Identity.generate().peer_id for _ in range(40)]
    conns = [_add(table, _Conn(p)) for p in reversed(peer_ids)]
    assert list(table.all) == conns
    for conn in conns[::3]:
        conn.close(table)
    late = _add(table, _Conn(peer_ids[0]))
    assert list(table.all) == [c for i, c in enumerate(conns) if i % 3] + [late]


def test_of_two_direct_duplicates_the_older_one_takes_over_whatever_their_addresses() -> None:
    table, peer, _ = _table()
    first = _add(table, _Conn(peer))
    older, newer = _add(table, _Conn(peer)), _add(table, _Conn(peer))
    first.close(table)
    assert table.conns[peer] is older and newer.superseded
