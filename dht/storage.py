"""Bounded local storage of DHT records, and merging of the values several replicas return.

Per key, storage holds either one plain record (subkey None) or a dictionary
of subkey records. For one (key, subkey), a record replaces the stored one only
if its signed expiration is strictly later: that is how a replay of an older
signed record is refused (`LocalStorage.store` returns False).

Plain values and dictionaries under one key (applications should keep one kind
per key; a schema validator can enforce it):

- a plain record is refused while the key holds any live subkey, so one
  writer's plain value cannot wipe subkeys owned and signed by other peers;
- a subkey record replaces a live plain value only if it expires later than it
  (the "later expiration wins" rule, so an old replay cannot displace it);
- `merge` of replica answers prefers a dictionary over a plain value, for the
  same reason as the first rule: a plain value must not hide owned subkeys.

Bounds: at most `max_entries` records and `max_bytes` accounted bytes (payload
plus a fixed per-record overhead). Expired records are purged on every call, so
nothing dead is ever returned.

Quotas per origin: a record stored over the network is charged to the peer
that sent it and to that peer's IP group (`admission.ip_group`; exempt
addresses have none). A peer may hold `peer_share` of either bound and a group
`group_share`; past its quota an origin's own soonest-expiring records make
room. When the storage is full, the records evicted are the soonest-expiring
ones of the origin holding the largest share, not the soonest-expiring overall:
otherwise a flood of long-lived junk would evict the short-lived records honest
peers depend on (30 s matchmaking declarations).
"""

from __future__ import annotations

import heapq
import itertools
import os
from collections.abc import Hashable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from shoal.dht.records import Record, RecordError, RecordValidator

DEFAULT_MAX_ENTRIES = 100_000
DEFAULT_MAX_BYTES = 256 * 1024 * 1024
# Rough Python cost of one stored record beyond its payload (Record, slot, dict
# entry, heap entry); it makes max_bytes a bound on real memory, not just payload.
RECORD_OVERHEAD_BYTES = 256
# Quotas of one origin: a peer (2 % = 2,000 records or 5 MiB by default) and an
# IP group (5 %). An honest peer stores its own few records and caches what it
# reads; far below either.
DEFAULT_PEER_SHARE = 0.02
DEFAULT_GROUP_SHARE = 0.05
EPOCH_BYTES = 8  # `LocalStorage.epoch`
_LOCAL: tuple[str] = ("local",)  # the account of records stored without an origin

# Who stored a record: (peer, IP group or None); None for the node's own records.
Origin = tuple[Hashable, str | None]


@dataclass(frozen=True, slots=True)
class StoredValue:
    """What a key holds: one plain record, or a dictionary of live subkey records."""

    key: str
    plain: Record | None = None
    subkeys: Mapping[str, Record] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if (self.plain is None) == (not self.subkeys):
            raise ValueError("a StoredValue holds either a plain record or subkeys, not both")

    @property
    def is_dictionary(self) -> bool:
        return self.plain is None

    @property
    def expiration(self) -> float:
        """The latest expiration among its records."""
        if self.plain is not None:
            return self.plain.expiration
        return max(r.expiration for r in self.subkeys.values())

    def records(self) -> list[Record]:
        if self.plain is not None:
            return [self.plain]
        return list(self.subkeys.values())


class _Slot:
    __slots__ = ("accounts", "expires", "record", "seq", "size")

    def __init__(
        self, record: Record, expires: float, size: int, seq: int, accounts: tuple[Hashable, ...]
    ) -> None:
        self.record = record
        self.expires = expires  # effective (capped) expiration
        self.size = size
        self.seq = seq  # tells a live heap entry from a stale one
        # ("p", peer) and ("g", group) of the origin, or (_LOCAL,); the first is the
        # one the global eviction charges (the group if any, else the peer)
        self.accounts = accounts


class _Account:
    __slots__ = ("entries", "heap", "nbytes")

    def __init__(self) -> None:
        self.entries = 0
        self.nbytes = 0
        self.heap: list[tuple[float, int, str, str | None]] = []


def _accounts(origin: Origin | None) -> tuple[Hashable, ...]:
    if origin is None:
        return (_LOCAL,)
    peer, group = origin
    if group is None:
        return (("p", peer),)
    return (("g", group), ("p", peer))


class LocalStorage:
    """This node's share of the DHT: validated, bounded, expiring records."""

    def __init__(
        self,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        max_bytes: int = DEFAULT_MAX_BYTES,
        validator: RecordValidator | None = None,
        *,
        peer_share: float = DEFAULT_PEER_SHARE,
        group_share: float = DEFAULT_GROUP_SHARE,
    ) -> None:
        if max_entries <= 0 or max_bytes <= 0:
            raise ValueError("max_entries and max_bytes must be positive")
        if not (0 < peer_share <= 1 and 0 < group_share <= 1):
            raise ValueError("peer_share and group_share must be in (0, 1]")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        # (entries, bytes) one origin may hold; at least one record of the largest size
        self.peer_quota = (
            max(1, int(max_entries * peer_share)),
            max(int(max_bytes * peer_share), 64 * 1024 + RECORD_OVERHEAD_BYTES),
        )
        self.group_quota = (
            max(1, int(max_entries * group_share)),
            max(int(max_bytes * group_share), 64 * 1024 + RECORD_OVERHEAD_BYTES),
        )
        self._accounts: dict[Hashable, _Account] = {}
        self.validator = validator if validator is not None else RecordValidator()
        self._keys: dict[str, dict[str | None, _Slot]] = {}
        # (effective expiration, seq, key, subkey); entries of replaced records stay
        # until popped or compacted (lazy deletion).
        self._heap: list[tuple[float, int, str, str | None]] = []
        self._seq = itertools.count(1)
        self.last_seq = 0  # the seq of the latest store: a reader's cursor (`changed_since`)
        # Names this storage's seq numbering: a reader's cursor from another numbering
        # (this node restarted) is not comparable, and gets a full answer.
        self.epoch = os.urandom(EPOCH_BYTES)
        self._entries = 0
        self._bytes = 0
        self._counters = {
            "stored": 0,
            "refused": 0,
            "evicted": 0,
            "expired": 0,
            "over_quota": 0,
        }

    def __len__(self) -> int:
        return self._entries

    @property
    def nbytes(self) -> int:
        return self._bytes

    def store(self, record: Record, now: float, origin: Origin | None = None) -> bool:
        """Validate and store `record`, charged to `origin` (peer, IP group) when it
        came over the network (None: our own, charged to no quota).

        Raises RecordError if the record is invalid. Returns False, storing
        nothing, when an equal-or-later record for the same (key, subkey) is
        already held, when a plain record meets a live dictionary, or when the
        record cannot fit (it would be the first evicted).
        """
        self.validator.validate(record, now)
        self.purge(now)
        size = record.nbytes + RECORD_OVERHEAD_BYTES
        if size > self.max_bytes:
            self._counters["refused"] += 1
            return False
        slots = self._keys.get(record.key)
        if slots:
            plain = slots.get(None)
            if record.subkey is None and plain is None:
                self._counters["refused"] += 1  # a live dictionary wins over a plain value
                return False
            current = plain if plain is not None else slots.get(record.subkey)
            if current is not None:
                if current.record.expiration >= record.expiration:
                    self._counters["refused"] += 1
                    return False
                self._remove(record.key, current.record.subkey)
        slot = _Slot(
            record,
            self.validator.effective_expiration(record, now),
            size,
            self._next_seq(),
            _accounts(origin),
        )
        self._keys.setdefault(record.key, {})[record.subkey] = slot
        self._entries += 1
        self._bytes += size
        entry = (slot.expires, slot.seq, record.key, record.subkey)
        heapq.heappush(self._heap, entry)
        for name in slot.accounts:
            account = self._accounts.get(name)
            if account is None:
                account = self._accounts[name] = _Account()
            account.entries += 1
            account.nbytes += size
            heapq.heappush(account.heap, entry)
        if origin is not None:
            self._enforce_quotas(slot.accounts)
        self._enforce_bounds()
        self._compact_accounts(slot.accounts)
        stored = self._keys.get(record.key, {}).get(record.subkey) is slot
        if stored:
            self._counters["stored"] += 1
        return stored

    def get(self, key: str, now: float) -> StoredValue | None:
        """The live value of `key`, or None."""
        self.purge(now)
        return self._value(key)

    def get_many(self, keys: Iterable[str], now: float) -> dict[str, StoredValue]:
        """The live values of those `keys` that have one."""
        self.purge(now)
        found = {}
        for key in keys:
            value = self._value(key)
            if value is not None:
                found[key] = value
        return found

    def changed_since(self, key: str, since: int, now: float) -> list[Record]:
        """The live records of `key` stored after seq `since` (a cursor this storage
        gave as `last_seq`): what a reader holding the rest lacks. Records that
        expired or were evicted since are not reported; a reader drops them by
        their expiration, or keeps a record still valid that another replica holds."""
        self.purge(now)
        slots = self._keys.get(key)
        if not slots:
            return []
        return [slot.record for slot in slots.values() if slot.seq > since]

    def _next_seq(self) -> int:
        self.last_seq = next(self._seq)
        return self.last_seq

    def values(self, now: float) -> Iterator[StoredValue]:
        """All live values (e.g. for republishing); do not store while iterating."""
        self.purge(now)
        for key in list(self._keys):
            value = self._value(key)
            if value is not None:
                yield value

    def purge(self, now: float) -> int:
        """Drop every record whose effective expiration is <= now; return how many."""
        removed = 0
        heap = self._heap
        while heap and heap[0][0] <= now:
            _, seq, key, subkey = heapq.heappop(heap)
            if self._is_live(seq, key, subkey):
                self._remove(key, subkey)
                removed += 1
        self._counters["expired"] += removed
        return removed

    def usage(self, origin: Origin | None) -> tuple[int, int]:
        """(records, bytes) charged to `origin`'s peer (or to our own records)."""
        account = self._accounts.get(_accounts(origin)[-1])
        return (0, 0) if account is None else (account.entries, account.nbytes)

    def group_usage(self, group: str) -> tuple[int, int]:
        """(records, bytes) charged to an IP group."""
        account = self._accounts.get(("g", group))
        return (0, 0) if account is None else (account.entries, account.nbytes)

    def stats(self) -> dict[str, int]:
        """Counters for the status endpoint."""
        return {
            "origins": len(self._accounts),
            "keys": len(self._keys),
            "entries": self._entries,
            "bytes": self._bytes,
            "max_entries": self.max_entries,
            "max_bytes": self.max_bytes,
            **self._counters,
        }

    def _value(self, key: str) -> StoredValue | None:
        slots = self._keys.get(key)
        if not slots:
            return None
        plain = slots.get(None)
        if plain is not None:
            return StoredValue(key, plain=plain.record)
        return StoredValue(key, subkeys={sk: s.record for sk, s in slots.items() if sk is not None})

    def _is_live(self, seq: int, key: str, subkey: str | None) -> bool:
        slot = self._keys.get(key, {}).get(subkey)
        return slot is not None and slot.seq == seq

    def _remove(self, key: str, subkey: str | None) -> None:
        slots = self._keys[key]
        slot = slots.pop(subkey)
        if not slots:
            del self._keys[key]
        self._entries -= 1
        self._bytes -= slot.size
        for name in slot.accounts:
            account = self._accounts[name]
            account.entries -= 1
            account.nbytes -= slot.size
            if account.entries == 0:
                del self._accounts[name]

    def _compact_accounts(self, names: tuple[Hashable, ...]) -> None:
        # Replaced and expired records leave stale entries in their origin's heap.
        for name in names:
            account = self._accounts.get(name)
            if account is not None and len(account.heap) > 2 * account.entries + 64:
                account.heap = [e for e in account.heap if self._is_live(e[1], e[2], e[3])]
                heapq.heapify(account.heap)

    def _quota(self, name: Hashable) -> tuple[int, int] | None:
        if name == _LOCAL:
            return None
        return self.group_quota if name[0] == "g" else self.peer_quota  # type: ignore[index]

    def _enforce_quotas(self, names: tuple[Hashable, ...]) -> None:
        """An origin past its quota makes room from its own soonest-expiring records."""
        for name in names:
            quota = self._quota(name)
            account = self._accounts.get(name)
            while (
                quota is not None
                and account is not None
                and (account.entries > quota[0] or account.nbytes > quota[1])
            ):
                if not self._evict_from(account):
                    break
                self._counters["over_quota"] += 1
                account = self._accounts.get(name)

    def _evict_from(self, account: _Account) -> bool:
        """Remove the soonest-expiring live record of `account`."""
        heap = account.heap
        while heap:
            _, seq, key, subkey = heapq.heappop(heap)
            if self._is_live(seq, key, subkey):
                self._remove(key, subkey)
                return True
        return False

    def _largest_account(self) -> _Account | None:
        # The origin (an IP group, a peer, or our own records) holding the largest
        # share of either bound goes first; a group holds at least what each of its
        # peers does, so Sybils of one /24 are charged together.
        best, best_share = None, -1.0
        for account in self._accounts.values():
            share = max(account.entries / self.max_entries, account.nbytes / self.max_bytes)
            if share > best_share:
                best, best_share = account, share
        return best

    def _enforce_bounds(self) -> None:
        while self._entries > self.max_entries or self._bytes > self.max_bytes:
            account = self._largest_account()
            if account is None or not self._evict_from(account):
                break
            self._counters["evicted"] += 1
        heap = self._heap
        # Replacements leave stale heap entries behind; rebuild before they
        # outnumber the live ones, so the heap stays O(entries).
        if len(heap) > 2 * self._entries + 1024:
            self._heap = [
                (s.expires, s.seq, k, sk)
                for k, slots in self._keys.items()
                for sk, s in slots.items()
            ]
            heapq.heapify(self._heap)


def newer(a: Record, b: Record) -> bool:
    # Later expiration wins; ties are broken by content so that every reader
    # merging the same answers picks the same record.
    return (a.expiration, a.value, a.signature or b"") > (b.expiration, b.value, b.signature or b"")


def merge_records(
    key: str,
    records: Iterable[Record],
    now: float,
    validator: RecordValidator | None = None,
) -> StoredValue | None:
    """Combine records for `key` returned by several replicas.

    Drops records for other keys, expired ones, and (with a validator) invalid
    ones; keeps the latest record per subkey. A dictionary wins over a plain
    value. None when nothing live remains.
    """
    plain: Record | None = None
    subkeys: dict[str, Record] = {}
    for record in records:
        if record.key != key or record.expiration <= now:
            continue
        if validator is not None:
            try:
                validator.validate(record, now)
            except RecordError:
                continue
        if record.subkey is None:
            if plain is None or newer(record, plain):
                plain = record
        else:
            current = subkeys.get(record.subkey)
            if current is None or newer(record, current):
                subkeys[record.subkey] = record
    if subkeys:
        return StoredValue(key, subkeys=subkeys)
    if plain is not None:
        return StoredValue(key, plain=plain)
    return None


def merge(
    values: Iterable[StoredValue | None],
    now: float,
    validator: RecordValidator | None = None,
) -> StoredValue | None:
    """Combine the values several replicas returned for one key (Nones are skipped).

    Plain values: the latest expiration wins. Dictionaries: the union of live
    subkeys, the latest record per subkey.
    """
    present = [v for v in values if v is not None]
    if not present:
        return None
    keys = {v.key for v in present}
    if len(keys) != 1:
        raise ValueError(f"cannot merge values of different keys: {sorted(keys)[:3]}")
    return merge_records(present[0].key, (r for v in present for r in v.records()), now, validator)
