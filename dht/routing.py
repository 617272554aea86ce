"""Kademlia routing table: node IDs, XOR distance, k-buckets. No I/O, no clock.

Layout: one bucket per common prefix length (CPL) with the local ID, created
lazily. Bucket ``i`` holds contacts whose ID shares exactly the first ``i`` bits
with ours, i.e. whose distance ``d`` has ``d.bit_length() == 256 - i``. This is
the fully split Kademlia tree (the paper splits only the bucket holding the
own ID, which ends in the same ranges), without the bookkeeping of splitting.
Only the non-empty part of it is ever allocated: about ``log2(N)`` buckets in a
network of ``N`` peers. The paper's relaxed splitting (more than ``k`` contacts
in unbalanced subtrees near the own ID) is not done; the deep buckets together
already hold everything close to us.

A full bucket never drops a live contact for a newcomer (old contacts that are
still up are the best predictor of future uptime). The table cannot ping, so
`add_or_update` hands the least-recently-seen contact back to the caller, which
pings it and reports with `ping_result`; meanwhile the newcomer waits in the
bucket's bounded replacement cache. A bucket whose every contact was heard from
within `recheck_after` asks for no ping: the newcomer waits all the same.

Time is always passed in (``now``, seconds on any monotonic clock) so that the
driver owns the clock and tests need no sleeps.
"""

from __future__ import annotations

import enum
import functools
import random
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import lru_cache
from hashlib import sha256
from itertools import islice
from typing import Final

from shoal.transport.identity import PeerID
from shoal.transport.multiaddr import Multiaddr, MultiaddrError

from .admission import DiversityPolicy

__all__ = [
    "ID_BITS",
    "AddResult",
    "AddStatus",
    "Contact",
    "RoutingTable",
    "bucket_range",
    "common_prefix_len",
    "dialable_addrs",
    "distance",
    "key_id",
    "node_id",
]

ID_BITS: Final = 256
_HOSTS: Final = frozenset({"ip4", "ip6", "dns", "dns4", "dns6"})
# Addresses come off the network: look at no more than this many per max_addrs
# kept, so a peer advertising thousands of junk addresses costs little.
_SCAN_FACTOR: Final = 4


# ---------------------------------------------------------------- IDs


@lru_cache(maxsize=1 << 16)
@functools.lru_cache(maxsize=65536)
def node_id(peer_id: PeerID) -> int:
    """The 256-bit Kademlia ID of a peer: SHA-256 of its peer ID bytes.

    Hashing (rather than using the key bytes) spreads IDs uniformly, and the
    cache makes repeated lookups of the same peer (every RPC) free.
    """
    return int.from_bytes(sha256(peer_id.to_bytes()).digest(), "big")


def key_id(key: bytes | str) -> int:
    """The 256-bit ID of a DHT key (str is UTF-8 encoded)."""
    if isinstance(key, str):
        key = key.encode()
    return int.from_bytes(sha256(key).digest(), "big")


def distance(a: int, b: int) -> int:
    """XOR distance: a metric (d(a,a)=0, symmetric, triangle inequality) on IDs."""
    return a ^ b


def common_prefix_len(a: int, b: int) -> int:
    """Number of leading bits `a` and `b` share (256 when equal)."""
    return ID_BITS - (a ^ b).bit_length()


def bucket_range(local: int, index: int) -> tuple[int, int]:
    """Inclusive (low, high) of the IDs whose common prefix with `local` is `index` bits."""
    if not 0 <= index < ID_BITS:
        raise ValueError(f"bucket index must be in 0..{ID_BITS - 1}, got {index}")
    shift = ID_BITS - 1 - index
    # same first `index` bits as local, the next bit flipped, anything below
    low = ((local >> shift) ^ 1) << shift
    return low, low | ((1 << shift) - 1)


# ---------------------------------------------------------------- addresses


def _dialable(peer_id: PeerID, addr: object) -> Multiaddr | None:
    """`addr` without its trailing /p2p of `peer_id` when it can be dialed, else None."""
    if not isinstance(addr, Multiaddr):
        try:
            if isinstance(addr, str):
                addr = Multiaddr(addr)
            elif isinstance(addr, bytes | bytearray | memoryview):
                addr = Multiaddr.from_bytes(addr)
            else:
                return None
        except MultiaddrError:
            return None
    comps = addr.components
    if comps[-1][0] == "p2p":
        if len(comps) == 1:
            return None  # /p2p/ID: a name, nothing to dial
        # A trailing /p2p (after /tcp or /p2p-circuit) names the target: it must be
        # the peer these addresses are claimed for, or a third party could point
        # our table at someone else.
        if comps[-1][1] != peer_id.to_base58():
            return None
        # stored without it, so that both spellings deduplicate
        addr = addr.without_peer_id()
        comps = addr.components
    if comps[0][0] in _HOSTS:
        port = comps[1][1]
        if port is None or port == "0" or addr.is_unspecified:
            return None
    if addr.is_relayed:
        if addr.relay_peer_id == peer_id:
            return None  # relaying through itself is no route
        return addr
    return addr if addr.is_direct_tcp else None


def dialable_addrs(
    peer_id: PeerID, addrs: Iterable[Multiaddr | str | bytes], max_addrs: int = 8
) -> tuple[Multiaddr, ...]:
    """The dialable addresses of `peer_id` in `addrs`: in order, deduplicated, at most `max_addrs`.

    Dialable: direct TCP (ip4/ip6/dns*) with a nonzero port and a specified IP,
    or relayed (/p2p-circuit). Garbage, other peers' addresses (/p2p of
    someone else) and bare /p2p/ID are dropped; a trailing /p2p of `peer_id` is
    stripped.
    """
    out: list[Multiaddr] = []
    for raw in islice(addrs, max_addrs * _SCAN_FACTOR):
        addr = _dialable(peer_id, raw)
        if addr is not None and addr not in out:
            out.append(addr)
            if len(out) >= max_addrs:
                break
    return tuple(out)


# ---------------------------------------------------------------- contacts


@dataclass(slots=True, eq=False)
class Contact:
    """A peer in the table (or in a replacement cache). Mutated in place by the table."""

    peer_id: PeerID
    node_id: int
    addrs: tuple[Multiaddr, ...]
    last_seen: float
    failures: int = 0
    # The IP group (/24, /48) the peer was seen from, None when exempt or unknown.
    ip_group: str | None = None

    def __repr__(self) -> str:
        return f"Contact({self.peer_id.short()}, addrs={len(self.addrs)}, failures={self.failures})"


class AddStatus(enum.Enum):
    ADDED = "added"  # new contact, in the table
    UPDATED = "updated"  # already in the table: moved to most-recently-seen
    CACHED = "cached"  # bucket full (a ping pending): newcomer in the replacement cache
    NEEDS_PING = "needs_ping"  # bucket full: ping `needs_ping`, report with ping_result
    IGNORED = "ignored"  # self, or no dialable address


@dataclass(frozen=True, slots=True)
class AddResult:
    status: AddStatus
    # The newcomer's Contact (in the table or its replacement cache), None when ignored.
    contact: Contact | None = None
    # With NEEDS_PING: the least-recently-seen contact of the full bucket.
    needs_ping: Contact | None = None
    reason: str = ""

    @property
    def in_table(self) -> bool:
        return self.status in (AddStatus.ADDED, AddStatus.UPDATED)


class _Bucket:
    __slots__ = ("contacts", "pending", "pending_deadline", "replacements")

    def __init__(self) -> None:
        # least-recently-seen first, most-recently-seen last
        self.contacts: OrderedDict[PeerID, Contact] = OrderedDict()
        # least-recently-seen first; the newest is promoted first
        self.replacements: OrderedDict[PeerID, Contact] = OrderedDict()
        self.pending: PeerID | None = None  # the contact being pinged
        self.pending_deadline = 0.0


def _bucket_entry(
    index: int, bucket: _Bucket, touched: float | None, now: float, contacts: bool
) -> dict[str, object]:
    """One bucket of `RoutingTable.snapshot`."""
    entry: dict[str, object] = {
        "index": index,  # common prefix length with our ID
        "distance_bits": ID_BITS - index,
        "count": len(bucket.contacts),
        "replacements": len(bucket.replacements),
        "ping_pending": bucket.pending is not None and now < bucket.pending_deadline,
        "oldest_seen_age": (
            round(now - min(c.last_seen for c in bucket.contacts.values()), 3)
            if bucket.contacts
            else None
        ),
    }
    entry["last_touched_age"] = None if touched is None else round(now - touched, 3)
    if contacts:
        entry["contacts"] = [
            {
                "peer_id": c.peer_id.to_base58(),
                "addrs": [str(a) for a in c.addrs],
                "seen_age": round(now - c.last_seen, 3),
                "failures": c.failures,
                "ip_group": c.ip_group,
            }
            for c in bucket.contacts.values()
        ]
    return entry


class _GroupCounts:
    """The diversity filter: contacts in the table per IP group, and whether the
    policy leaves room for one more of a group."""

    def __init__(self, policy: DiversityPolicy) -> None:
        self.policy = policy
        self.counts: dict[str, int] = {}

    def fits(self, bucket: _Bucket, contact: Contact) -> bool:
        """Whether the diversity limits leave room for `contact` in `bucket`."""
        group = contact.ip_group
        if group is None:
            return True
        if self.counts.get(group, 0) >= self.policy.per_group_table:
            return False
        in_bucket = sum(1 for c in bucket.contacts.values() if c.ip_group == group)
        return in_bucket < self.policy.per_group_bucket

    def count(self, group: str | None, delta: int) -> None:
        if group is None:
            return
        n = self.counts.get(group, 0) + delta
        if n > 0:
            self.counts[group] = n
        else:
            self.counts.pop(group, None)


# ---------------------------------------------------------------- table


class RoutingTable:
    """k-buckets around `local_peer`. Sans-IO: the DHT node does the pinging.

    `k`: contacts per bucket. `replacement_cache`: newcomers remembered per
    full bucket. `max_addrs`: addresses kept per contact. `max_failures`:
    consecutive failed RPCs that evict a contact. `ping_timeout`: after this,
    a ping that got no `ping_result` no longer blocks a new one in its bucket.
    `recheck_after`: a full bucket asks for a ping of its least-recently-seen
    contact only when that contact has not been heard from for this long (the
    idle close of a connection: 5 minutes); before, the newcomer just waits in the
    replacement cache.
    `diversity`: how many contacts of one IP group a bucket and the table keep
    (see `admission`); a newcomer over the limit waits in the replacement cache.
    """

    def __init__(
        self,
        local_peer: PeerID,
        k: int = 20,
        *,
        replacement_cache: int = 20,
        max_addrs: int = 8,
        max_failures: int = 3,
        ping_timeout: float = 30.0,
        recheck_after: float = 300.0,
        rng: random.Random | None = None,
        diversity: DiversityPolicy | None = None,
    ) -> None:
        if k < 1 or replacement_cache < 0 or max_addrs < 1 or max_failures < 1:
            raise ValueError("k, max_addrs and max_failures must be >= 1, replacement_cache >= 0")
        self.local_peer: Final = local_peer
        self.local_id: Final = node_id(local_peer)
        self.k: Final = k
        self.replacement_cache: Final = replacement_cache
        self.max_addrs: Final = max_addrs
        self.max_failures: Final = max_failures
        self.ping_timeout: Final = ping_timeout
        self.recheck_after: Final = recheck_after
        self._rng = rng if rng is not None else random.Random()
        self.diversity: Final = diversity if diversity is not None else DiversityPolicy()
        self._groups = _GroupCounts(self.diversity)
        self._buckets: dict[int, _Bucket] = {}
        self._index: dict[PeerID, int] = {}  # peer -> bucket, for contacts in the table
        self._touched: dict[int, float] = {}  # bucket -> last update or completed lookup

    # -- lookups of single peers

    def bucket_index(self, target: int) -> int:
        """The bucket an ID falls in (our own ID counts as the deepest bucket)."""
        return min(common_prefix_len(self.local_id, target), ID_BITS - 1)

    def get(self, peer_id: PeerID) -> Contact | None:
        index = self._index.get(peer_id)
        return None if index is None else self._buckets[index].contacts[peer_id]

    def __contains__(self, peer_id: object) -> bool:
        return peer_id in self._index

    def __len__(self) -> int:
        return len(self._index)

    def __iter__(self) -> Iterator[Contact]:
        """All contacts, bucket by bucket (far to near), least-recently-seen first.

        A copy: the table may be changed while iterating.
        """
        out: list[Contact] = []
        for index in sorted(self._buckets):
            out.extend(self._buckets[index].contacts.values())
        return iter(out)

    def replacements(self, target: int) -> list[Contact]:
        """The replacement cache of `target`'s bucket, most recent first."""
        bucket = self._buckets.get(self.bucket_index(target))
        return [] if bucket is None else list(reversed(bucket.replacements.values()))

    # -- updates

    def add_or_update(
        self,
        peer_id: PeerID,
        addrs: Iterable[Multiaddr | str | bytes],
        now: float,
        *,
        replace_addrs: bool = False,
        observed_ip: str | None = None,
    ) -> AddResult:
        """Record that `peer_id` was seen at `now`, reachable at `addrs`.

        New addresses go first and known ones are kept after them (a peer's
        addresses learned from others may be partial); `replace_addrs` drops
        the known ones, for an authoritative list such as the peer's own.
        `observed_ip`: the IP its connection came from, which sets its IP group
        (without it, a new contact's group is that of its first address).
        """
        if peer_id == self.local_peer:
            return AddResult(AddStatus.IGNORED, reason="self")
        new_addrs = dialable_addrs(peer_id, addrs, self.max_addrs)
        nid = node_id(peer_id)
        index = self.bucket_index(nid)
        bucket = self._buckets.get(index)

        if bucket is not None:
            contact = bucket.contacts.get(peer_id)
            if contact is not None:
                # seen again, even without a (new) dialable address: it is up
                self._refresh(contact, new_addrs, now, replace_addrs)
                if observed_ip is not None:
                    self._regroup(contact, self.diversity.group_of_ip(observed_ip))
                contact.failures = 0
                self._touched[index] = now
                bucket.contacts.move_to_end(peer_id)
                return AddResult(AddStatus.UPDATED, contact)

        cached = bucket.replacements.pop(peer_id, None) if bucket is not None else None
        if cached is not None:
            self._refresh(cached, new_addrs, now, replace_addrs)
            if not cached.addrs:
                return AddResult(AddStatus.IGNORED, reason="no dialable address")
            contact = cached
        else:
            if not new_addrs:
                return AddResult(AddStatus.IGNORED, reason="no dialable address")
            contact = Contact(peer_id, nid, new_addrs, now)
        if observed_ip is not None:
            contact.ip_group = self.diversity.group_of_ip(observed_ip)
        elif cached is None:
            contact.ip_group = self.diversity.group_of_addrs(contact.addrs)

        if bucket is None:
            bucket = self._buckets[index] = _Bucket()
        self._touched[index] = now
        if not self._fits(bucket, contact):
            # Its group has its share here: it waits in the replacement cache, and an
            # honest peer of another group still gets the next free slot.
            self._cache(bucket, contact)
            return AddResult(AddStatus.CACHED, contact, reason="ip diversity")
        if len(bucket.contacts) < self.k:
            self._insert(bucket, index, contact)
            return AddResult(AddStatus.ADDED, contact)

        self._cache(bucket, contact)
        if bucket.pending is not None and now < bucket.pending_deadline:
            return AddResult(AddStatus.CACHED, contact)
        lrs = next(iter(bucket.contacts.values()))
        if now - lrs.last_seen < self.recheck_after:
            # Every contact of the bucket was heard from lately: alive, as far as a
            # ping could tell. Pinging anyway cost a dial and a handshake for nothing,
            # and chained: the pinged peer, hearing from a sender its own full bucket
            # did not hold, pinged one of its contacts in turn, and so on through the
            # swarm, one ping a round trip (in a 10,000-peer simulation whose tables
            # were not mutual, nearly all of its wall time).
            return AddResult(AddStatus.CACHED, contact, reason="bucket recently heard from")
        bucket.pending = lrs.peer_id
        bucket.pending_deadline = now + self.ping_timeout
        return AddResult(AddStatus.NEEDS_PING, contact, needs_ping=lrs)

    def ping_result(self, peer_id: PeerID, alive: bool, now: float) -> None:
        """The outcome of a ping asked for by `add_or_update` (or of any liveness check).

        Alive: the contact becomes most-recently-seen and the newcomers stay in
        the replacement cache. Dead: it is evicted and the most recent
        replacement takes its place.
        """
        index = self._index.get(peer_id)
        if index is None:
            index = self.bucket_index(node_id(peer_id))
        bucket = self._buckets.get(index)
        if bucket is None:
            return
        if bucket.pending == peer_id:
            bucket.pending = None
        contact = bucket.contacts.get(peer_id)
        if alive:
            if contact is not None:
                self._seen(bucket, index, contact, now)
            return
        if contact is not None:
            self._evict(bucket, peer_id)
        else:
            # unknown to the table, or waiting as a replacement: don't promote it later
            bucket.replacements.pop(peer_id, None)
        self._fill(bucket, index)

    def mark_seen(self, peer_id: PeerID, now: float) -> bool:
        """A successful exchange with `peer_id`: most-recently-seen, failures reset.

        Returns whether the peer is in the table.
        """
        index = self._index.get(peer_id)
        if index is None:
            return False
        bucket = self._buckets[index]
        self._seen(bucket, index, bucket.contacts[peer_id], now)
        return True

    def mark_failed(self, peer_id: PeerID, now: float) -> bool:
        """A failed RPC to `peer_id`; evicts it after `max_failures` in a row when a
        replacement takes its place. Without one it stays, flagged stale (Kademlia,
        section 4.1): when our own link goes down every contact fails, and evicting
        them all would leave a table that nothing refills once the link is back.

        Returns whether the peer was evicted (a failing replacement candidate is
        simply forgotten: it was never verified).
        """
        index = self._index.get(peer_id)
        if index is None:
            bucket = self._buckets.get(self.bucket_index(node_id(peer_id)))
            if bucket is not None:
                bucket.replacements.pop(peer_id, None)
            return False
        bucket = self._buckets[index]
        contact = bucket.contacts[peer_id]
        contact.failures += 1
        if contact.failures < self.max_failures:
            return False
        size, failures = len(bucket.contacts), contact.failures
        self._evict(bucket, peer_id)
        self._fill(bucket, index)
        if len(bucket.contacts) < size:  # no replacement took its place: it stays, stale
            self._insert(bucket, index, contact)
            contact.failures = failures
            bucket.contacts.move_to_end(peer_id, last=False)  # the least recently seen
            return False
        return True

    def remove(self, peer_id: PeerID) -> Contact | None:
        """Drop `peer_id` (from the table or a replacement cache); a replacement fills its slot."""
        index = self._index.get(peer_id)
        if index is None:
            bucket = self._buckets.get(self.bucket_index(node_id(peer_id)))
            return None if bucket is None else bucket.replacements.pop(peer_id, None)
        bucket = self._buckets[index]
        contact = self._evict(bucket, peer_id)
        self._fill(bucket, index)
        return contact

    # -- closest contacts

    def nearest(
        self, target: int, count: int, exclude: set[PeerID] | frozenset[PeerID] | None = None
    ) -> list[Contact]:
        """Up to `count` contacts closest to `target` by XOR distance, closest first.

        Buckets come in groups of increasing distance from `target` (with `j`
        its bucket): bucket `j`, then every bucket deeper than `j` (all at the
        same top distance bit), then `j-1`, `j-2`, ... So whole groups are
        collected until there are `count` candidates, and only those are sorted.
        """
        if count <= 0 or not self._index:
            return []
        j = common_prefix_len(self.local_id, target)
        buckets = self._buckets
        found: list[Contact] = []

        def take(bucket: _Bucket | None) -> None:
            if bucket is None:
                return
            if exclude:
                found.extend(c for c in bucket.contacts.values() if c.peer_id not in exclude)
            else:
                found.extend(bucket.contacts.values())

        take(buckets.get(j))
        if len(found) < count:
            for index, bucket in buckets.items():
                if index > j:
                    take(bucket)
        if len(found) < count:
            for index in sorted((i for i in buckets if i < j), reverse=True):
                take(buckets[index])
                if len(found) >= count:
                    break
        found.sort(key=lambda c: c.node_id ^ target)
        del found[count:]
        return found

    # -- refresh

    def buckets_to_refresh(
        self, now: float, interval: float = 600.0, rng: random.Random | None = None
    ) -> list[int]:
        """Random lookup targets, one inside each bucket not touched for `interval`.

        Buckets from the farthest down to one past the deepest non-empty one are
        considered (deeper ones are empty space around our own ID, where the
        self-lookup already searches); a bucket never touched counts as stale.
        The caller looks each target up and then calls `touch_bucket_for`.
        """
        rng = rng if rng is not None else self._rng
        deepest = max(self._buckets, default=-1)
        targets: list[int] = []
        for index in range(min(deepest + 1, ID_BITS - 1) + 1):
            touched = self._touched.get(index)
            if touched is not None and now - touched < interval:
                continue
            shift = ID_BITS - 1 - index
            # flip bit `index` of our ID (counting from the top), random below it
            targets.append(self.local_id ^ ((1 << shift) | rng.getrandbits(shift)))
        return targets

    def touch_bucket_for(self, target: int, now: float) -> None:
        """A lookup for `target` completed: its bucket counts as refreshed."""
        self._touched[self.bucket_index(target)] = now

    # -- introspection

    def snapshot(self, now: float, *, contacts: bool = False) -> dict[str, object]:
        """JSON-friendly state for the status endpoint (IDs as hex; ages in seconds).

        `contacts` adds each contact (peer ID, addresses, age, failures).
        """
        buckets = [
            _bucket_entry(index, self._buckets[index], self._touched.get(index), now, contacts)
            for index in sorted(self._buckets)
        ]
        return {
            "local_peer": self.local_peer.to_base58(),
            "local_id": f"{self.local_id:064x}",
            "k": self.k,
            "size": len(self._index),
            "replacements": sum(len(b.replacements) for b in self._buckets.values()),
            "buckets_nonempty": sum(1 for b in self._buckets.values() if b.contacts),
            "ip_groups": len(self._groups.counts),
            "buckets": buckets,
        }

    # -- internals

    def _refresh(
        self, contact: Contact, new_addrs: tuple[Multiaddr, ...], now: float, replace: bool
    ) -> None:
        contact.last_seen = now
        if replace and new_addrs:
            contact.addrs = new_addrs
        elif new_addrs and new_addrs != contact.addrs:
            merged = list(new_addrs)
            merged.extend(a for a in contact.addrs if a not in new_addrs)
            contact.addrs = tuple(merged[: self.max_addrs])

    def _seen(self, bucket: _Bucket, index: int, contact: Contact, now: float) -> None:
        contact.last_seen = now
        contact.failures = 0
        bucket.contacts.move_to_end(contact.peer_id)
        self._touched[index] = now

    def _fits(self, bucket: _Bucket, contact: Contact) -> bool:
        return self._groups.fits(bucket, contact)

    def _regroup(self, contact: Contact, group: str | None) -> None:
        # A contact in the table seen from another IP: counted in its new group (it
        # stays: it proved itself alive; the limits apply to newcomers).
        if group == contact.ip_group:
            return
        if contact.peer_id in self._index:
            self._count(contact.ip_group, -1)
            self._count(group, +1)
        contact.ip_group = group

    def _count(self, group: str | None, delta: int) -> None:
        self._groups.count(group, delta)

    def _insert(self, bucket: _Bucket, index: int, contact: Contact) -> None:
        contact.failures = 0
        bucket.contacts[contact.peer_id] = contact
        self._index[contact.peer_id] = index
        self._count(contact.ip_group, +1)

    def _cache(self, bucket: _Bucket, contact: Contact) -> None:
        if self.replacement_cache == 0:
            return
        bucket.replacements[contact.peer_id] = contact
        bucket.replacements.move_to_end(contact.peer_id)
        while len(bucket.replacements) > self.replacement_cache:
            bucket.replacements.popitem(last=False)  # the stalest newcomer goes

    def _evict(self, bucket: _Bucket, peer_id: PeerID) -> Contact:
        del self._index[peer_id]
        if bucket.pending == peer_id:
            bucket.pending = None
        contact = bucket.contacts.pop(peer_id)
        self._count(contact.ip_group, -1)
        return contact

    def _fill(self, bucket: _Bucket, index: int) -> None:
        # the most recent replacement whose group has room
        for contact in reversed(list(bucket.replacements.values())):
            if len(bucket.contacts) >= self.k:
                break
            if self._fits(bucket, contact):
                del bucket.replacements[contact.peer_id]
                self._insert(bucket, index, contact)
