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
plus a fixed per-record overhead); beyond either, the records that expire
soonest (by effective, i.e. capped, expiration) are evicted first. Expired
records are purged on every call, so nothing dead is ever returned.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from shoal.dht.records import Record, RecordError, RecordValidator

DEFAULT_MAX_ENTRIES = 100_000
DEFAULT_MAX_BYTES = 256 * 1024 * 1024
# Rough Python cost of one stored record beyond its payload (Record, slot, dict
# entry, heap entry); it makes max_bytes a bound on real memory, not just payload.
RECORD_OVERHEAD_BYTES = 256


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
    __slots__ = ("expires", "record", "seq", "size")

    def __init__(self, record: Record, expires: float, size: int, seq: int) -> None:
        self.record = record
        self.expires = expires  # effective (capped) expiration
        self.size = size
        self.seq = seq  # tells a live heap entry from a stale one


class LocalStorage:
    """This node's share of the DHT: validated, bounded, expiring records."""

    def __init__(
        self,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        max_bytes: int = DEFAULT_MAX_BYTES,
        validator: RecordValidator | None = None,
    ) -> None:
        if max_entries <= 0 or max_bytes <= 0:
            raise ValueError("max_entries and max_bytes must be positive")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.validator = validator if validator is not None else RecordValidator()
        self._keys: dict[str, dict[str | None, _Slot]] = {}
        # (effective expiration, seq, key, subkey); entries of replaced records stay
        # until popped or compacted (lazy deletion).
        self._heap: list[tuple[float, int, str, str | None]] = []
        self._seq = itertools.count()
        self._entries = 0
        self._bytes = 0
        self._counters = {"stored": 0, "refused": 0, "evicted": 0, "expired": 0}

    def __len__(self) -> int:
        return self._entries

    @property
    def nbytes(self) -> int:
        return self._bytes

    def store(self, record: Record, now: float) -> bool:
        """Validate and store `record`.

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
            record, self.validator.effective_expiration(record, now), size, next(self._seq)
        )
        self._keys.setdefault(record.key, {})[record.subkey] = slot
        self._entries += 1
        self._bytes += size
        heapq.heappush(self._heap, (slot.expires, slot.seq, record.key, record.subkey))
        self._enforce_bounds()
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

    def stats(self) -> dict[str, int]:
        """Counters for the status endpoint."""
        return {
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

    def _enforce_bounds(self) -> None:
        heap = self._heap
        while heap and (self._entries > self.max_entries or self._bytes > self.max_bytes):
            _, seq, key, subkey = heapq.heappop(heap)
            if self._is_live(seq, key, subkey):
                self._remove(key, subkey)
                self._counters["evicted"] += 1
        # Replacements leave stale heap entries behind; rebuild before they
        # outnumber the live ones, so the heap stays O(entries).
        if len(heap) > 2 * self._entries + 1024:
            self._heap = [
                (s.expires, s.seq, k, sk)
                for k, slots in self._keys.items()
                for sk, s in slots.items()
            ]
            heapq.heapify(self._heap)


def _newer(a: Record, b: Record) -> bool:
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
            if plain is None or _newer(record, plain):
                plain = record
        else:
            current = subkeys.get(record.subkey)
            if current is None or _newer(record, current):
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
