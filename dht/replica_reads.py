"""What a node last read of a key from each replica, so that its next read of that key
asks the replica only for what changed (delta reads; the wire side is in `protocol`).

A peer in matchmaking reads one key every second or so, and every replica used to
answer with the whole record set: every peer's declaration, most of them unchanged
(about 60% of the DHT bytes of a 4-peer DiLoCo round, and it grows with the swarm).
Here the reader keeps, per (key, replica), the records that replica gave and the
cursor it gave with them; the replica then sends only the records stored after the
cursor, which this merges into what it kept. What comes back from a read is, as
before, each replica's whole record set, so the lookup's merging is unchanged.

Sans-I/O. The records kept are claims like any answer: they are validated again at
every read (`merge_records` with the node's validator), expire by their own
expiration, and are bounded: `max_records` in all (least recently read first out)
and `MAX_RECORDS_PER_KEY` per replica and key, past which nothing is kept for it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from shoal.transport.identity import PeerID

from .protocol import MAX_RECORDS_PER_KEY, Cursor
from .records import Record
from .storage import newer

__all__ = ["DEFAULT_MAX_RECORDS", "ReplicaReads"]

# Records kept in all: about 300 bytes each for a matchmaking declaration.
DEFAULT_MAX_RECORDS = 16_384


@dataclass(slots=True)
class _Kept:
    cursor: Cursor
    records: dict[str | None, Record]  # by subkey (None: a plain value)


class ReplicaReads:
    """The records and cursor of the last answer of each replica, per key."""

    def __init__(self, max_records: int = DEFAULT_MAX_RECORDS) -> None:
        self.max_records = max_records
        self._kept: OrderedDict[tuple[str, PeerID], _Kept] = OrderedDict()
        self._count = 0  # records in _kept

    def __len__(self) -> int:
        return self._count

    def since(self, key: str, replica: PeerID) -> Cursor | None:
        """The cursor to send `replica` when reading `key` (None: ask for everything)."""
        kept = self._kept.get((key, replica))
        return None if kept is None else kept.cursor

    def answered(
        self,
        key: str,
        replica: PeerID,
        sent: Cursor | None,
        cursor: Cursor | None,
        records: list[Record],
        now: float,
    ) -> list[Record]:
        """`replica`'s whole record set for `key` after it answered `records` with
        `cursor` (None: it does not do delta reads) to a read that sent `sent`; kept
        for the next read. The answer is a delta exactly when the replica recognized
        the cursor sent, that is when it answered with a cursor of the same epoch."""
        kept = self._forget(key, replica)
        is_delta = (
            sent is not None and cursor is not None and kept is not None and cursor[0] == sent[0]
        )
        merged: dict[str | None, Record] = dict(kept.records) if is_delta and kept else {}
        for record in records:
            current = merged.get(record.subkey)
            if current is None or newer(record, current):
                merged[record.subkey] = record
        live = {sk: r for sk, r in merged.items() if r.expiration > now}
        if cursor is not None and len(live) <= MAX_RECORDS_PER_KEY:
            self._keep(key, replica, _Kept(cursor, live))
        return list(live.values())

    def _forget(self, key: str, replica: PeerID) -> _Kept | None:
        kept = self._kept.pop((key, replica), None)
        if kept is not None:
            self._count -= len(kept.records)
        return kept

    def _keep(self, key: str, replica: PeerID, kept: _Kept) -> None:
        self._kept[(key, replica)] = kept
        self._count += len(kept.records)
        while self._count > self.max_records and self._kept:
            _, oldest = self._kept.popitem(last=False)
            self._count -= len(oldest.records)
