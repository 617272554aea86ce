"""What a node knows of a key's replicas from its last reads: what each replica answered,
so that its next read asks the replica only for what changed (delta reads, the wire
side is in `protocol`: `ReplicaReads`), and which replicas its last full read found,
so that a frequent latest read asks a few of them rather than all k (`ReplicaSets`).

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

import random
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from shoal.transport.identity import PeerID

from .lookup import Candidate
from .protocol import MAX_RECORDS_PER_KEY, Cursor
from .records import Record
from .storage import newer

__all__ = ["DEFAULT_MAX_RECORDS", "REPLICA_SET_TTL_S", "ReplicaReads", "ReplicaSets"]

# Records kept in all: about 300 bytes each for a matchmaking declaration.
DEFAULT_MAX_RECORDS = 16_384


@dataclass(slots=True)
class _Kept:
    cursor: Cursor
    records: dict[str | None, Record]  # by subkey (None: a plain value)
    until: float  # when the last of them expires (then nothing of it is worth keeping)


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
            until = max((r.expiration for r in live.values()), default=now)
            self._keep(key, replica, _Kept(cursor, live, until), now)
        return list(live.values())

    def _forget(self, key: str, replica: PeerID) -> _Kept | None:
        kept = self._kept.pop((key, replica), None)
        if kept is not None:
            self._count -= len(kept.records)
        return kept

    def _keep(self, key: str, replica: PeerID, kept: _Kept, now: float) -> None:
        self._kept[(key, replica)] = kept
        self._count += len(kept.records)
        # Least recently read first out: past the bound, and before it whatever has all
        # expired. A Moshpit peer reads a new cell's key every round and never the old
        # ones again: their records, expired, filled the bound (about 5 MB a peer).
        while self._kept:
            oldest = next(iter(self._kept.values()))
            if self._count <= self.max_records and oldest.until > now:
                break
            self._kept.popitem(last=False)
            self._count -= len(oldest.records)


# How long the replicas a full read found serve sampled reads: a key's neighbourhood
# changes with churn, and a full read this often finds the peers that joined it.
REPLICA_SET_TTL_S = 30.0
MAX_REPLICA_SETS = 256  # keys


class ReplicaSets:
    """The replicas of each key that its last full latest read reached (the k closest
    that answered), to draw a sampled read's replicas from.

    Why sampling is sound: every store goes to the k closest, so any replica a write
    reached serves it, and a record a drawn replica lacks is in the next read's draw.
    Why it is needed: matchmaking polls its key about once a second, and a latest read
    of all k replicas delivers every peer's declaration k times over; at 16 peers that
    was 180 KB a peer a round against a 27 KB sparse payload. The lookup that found
    the set capped each IP group's share of it (`admission`), so Sybils next to the
    key hold as few of the draws as they hold of the set.
    """

    def __init__(
        self,
        ttl: float = REPLICA_SET_TTL_S,
        max_keys: int = MAX_REPLICA_SETS,
        rng: random.Random | None = None,
    ) -> None:
        self.ttl = ttl
        self.max_keys = max_keys
        self._rng = rng or random.Random()
        self._sets: OrderedDict[str, tuple[float, list[Candidate]]] = OrderedDict()

    def found(self, key: str, replicas: list[Candidate], now: float) -> None:
        """A full latest read of `key` reached `replicas` (loop time `now`)."""
        self._sets.pop(key, None)
        if replicas:
            self._sets[key] = (now + self.ttl, list(replicas))
            while len(self._sets) > self.max_keys:
                self._sets.popitem(last=False)

    def stored(self, key: str, replicas: list[Candidate], now: float) -> None:
        """A store of `key` reached `replicas` (loop time `now`): they serve sampled
        reads until a full read finds the set, unless a fresh one is known already.
        For a key read once right after its writers stored it (a verified round's
        records): its first read, full, delivered every member's record once per
        replica (`peer.verify.audit_round.gather`). The store's lookup settled on the
        closest it met, so a record stored elsewhere may be missing from them; such a
        reader asks what it lacks of its writers, or reads in full once the set ages."""
        entry = self._sets.get(key)
        if entry is None or entry[0] <= now:
            self.found(key, replicas, now)

    def draw(
        self, key: str, sample: int, now: float, blocked: Callable[[PeerID], bool]
    ) -> list[Candidate] | None:
        """`sample` replicas of `key` at random (all of them when there are fewer),
        none blocked; None when a full read is due (no set, or an expired one)."""
        entry = self._sets.get(key)
        if entry is None or entry[0] <= now:
            return None
        live = [c for c in entry[1] if not blocked(c.peer_id)]
        if not live:
            return None
        self._sets.move_to_end(key)
        return live if len(live) <= sample else self._rng.sample(live, sample)

    def known(
        self, key: str, now: float, blocked: Callable[[PeerID], bool]
    ) -> list[Candidate] | None:
        """Every replica of `key` in its fresh set, none blocked (None: no fresh set):
        where a store can go without a lookup of its own."""
        entry = self._sets.get(key)
        if entry is None or entry[0] <= now:
            return None
        live = [c for c in entry[1] if not blocked(c.peer_id)]
        return live or None

    def failed(self, key: str, peer: PeerID) -> None:
        """`peer` did not answer a read of `key`: not drawn again before the next full
        read; a set left empty makes the next read a full one."""
        entry = self._sets.get(key)
        if entry is None:
            return
        left = [c for c in entry[1] if c.peer_id != peer]
        if left:
            self._sets[key] = (entry[0], left)
        else:
            del self._sets[key]
