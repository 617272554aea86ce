"""DHT wire messages: building and validating them. No I/O.

Every request is a msgpack map carrying ``"from"``: the sender's dialable
addresses (strings), so that the receiver can put the sender in its table; once
the connection's remote answered a request that carried them, later requests over
that connection leave them out while they do not change (the receiver uses what the
connection carried last; docs/architecture/dht.md, "Addresses once per connection").

- ``ping``       {from}                    -> {from}
- ``find_node``  {from, ids: [32 bytes]}    -> {peers, nearest}
- ``find_value`` {from, keys: [str], since?, known?, contacts?} -> {peers, nearest,
                                               values: {index: [record]}, cursors?, had?}
- ``find_value`` {from, keys: [str], count: true} -> {peers, nearest, counts: {index: int}}
- ``store``      {from, records: [record]}  -> {stored: [bool]}

Delta reads: ``cursors`` (``{index: [epoch, seq]}``, from replicas that support them)
name the point of the responder's storage that its answer is complete up to; an asker
that keeps what it read sends them back as ``since`` (same shape) on its next read
of those keys, and gets only the records stored after them (a key's record set
unchanged: none). A cursor of another epoch (the responder restarted) gets a full
answer. Older peers ignore ``since`` and send no ``cursors``: a full answer, as
before.

Known records: ``known`` (``{index: [tag]}``, each tag `Record.tag`'s 8 bytes) names
records the asker already holds for a key, from another replica's answer; the
responder leaves those out of ``values`` and lists them in ``had`` (same shape), so
the asker still knows this replica's whole record set. A latest read of a few
replicas asks one first and the others with what it answered (dht/reads.py): each
change comes once, not once from every replica. Older peers ignore ``known`` and
send the records; older askers send no ``known``.

A read of replicas already found (a sampled read) sends ``contacts: false``: the
answer's ``peers`` and ``nearest`` are then empty (older peers fill them anyway).

Counted reads (``count: true``) ask how many live records each key holds, not the
records: how many peers announced under a key, where the records of hundreds of
peers, sent by every replica to every asker at once, would fill the replicas'
uplinks. Older peers ignore ``count`` and send ``values``: the asker counts those.

``peers`` is a list of contacts ``[peer_id_bytes, [addr strings]]`` shared by
all requested keys; ``nearest[i]`` lists indexes into ``peers`` for the i-th
key. Everything that comes back is checked here (types, lengths, counts) so
that a peer answering garbage costs one failed request and one log line.
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, Final

from shoal.transport.identity import PeerID
from shoal.transport.multiaddr import Multiaddr

from .records import TAG_BYTES, Record, RecordError
from .routing import dialable_addrs

ID_BYTES: Final = 32
MAX_KEYS_PER_REQUEST: Final = 256
MAX_RECORDS_PER_REQUEST: Final = 4096
MAX_ADDRS: Final = 8
MAX_ADDR_CHARS: Final = 512
# Records per key in one find_value answer (subkeys of a dictionary).
MAX_RECORDS_PER_KEY: Final = 4096
MAX_EPOCH_BYTES: Final = 16  # a storage epoch in a delta read's cursor


class DHTProtocolError(ValueError):
    """A DHT message that is malformed: wrong shape, too large, or self-contradictory."""


@dataclass(frozen=True, slots=True)
class WireContact:
    peer_id: PeerID
    addrs: tuple[Multiaddr, ...]


@functools.lru_cache(maxsize=65536)
def _peer_id(raw: bytes) -> PeerID:
    # Interned: the same peers come back in every answer, and a PeerID caches
    # its base58 form, which address checks compare against.
    return PeerID(raw)


def addrs_to_wire(addrs: list[Multiaddr]) -> list[str]:
    return [str(a) for a in addrs]


def parse_addrs(peer: PeerID, raw: object) -> tuple[Multiaddr, ...]:
    """The dialable addresses in an untrusted list of address strings."""
    if not isinstance(raw, list):
        raise DHTProtocolError("addresses must be a list")
    if len(raw) > MAX_ADDRS * 4:
        raise DHTProtocolError(f"{len(raw)} addresses, limit {MAX_ADDRS * 4}")
    ok = tuple(a for a in raw if isinstance(a, str) and len(a) <= MAX_ADDR_CHARS)
    return _dialable_cached(peer, ok)


@functools.lru_cache(maxsize=16384)
def _dialable_cached(peer: PeerID, addrs: tuple[str, ...]) -> tuple[Multiaddr, ...]:
    # The same contacts come back in most answers: check each list once.
    return dialable_addrs(peer, addrs, MAX_ADDRS)


def contact_to_wire(peer_id: PeerID, addrs: tuple[Multiaddr, ...] | list[Multiaddr]) -> list[Any]:
    return [peer_id.to_bytes(), [str(a) for a in addrs]]


def parse_ids(raw: object) -> list[int]:
    if not isinstance(raw, list) or not raw or len(raw) > MAX_KEYS_PER_REQUEST:
        raise DHTProtocolError("ids must be a non-empty list of bounded length")
    out = []
    for item in raw:
        if not isinstance(item, bytes) or len(item) != ID_BYTES:
            raise DHTProtocolError("every id must be 32 bytes")
        out.append(int.from_bytes(item, "big"))
    return out


def parse_keys(raw: object) -> list[str]:
    if not isinstance(raw, list) or not raw or len(raw) > MAX_KEYS_PER_REQUEST:
        raise DHTProtocolError("keys must be a non-empty list of bounded length")
    if not all(isinstance(k, str) and 0 < len(k) <= 512 for k in raw):
        raise DHTProtocolError("every key must be a non-empty string of at most 512 chars")
    return raw


def parse_records(raw: object, limit: int = MAX_RECORDS_PER_REQUEST) -> list[Record]:
    """Records in wire form; malformed ones make the whole message malformed."""
    if not isinstance(raw, list) or len(raw) > limit:
        raise DHTProtocolError(f"records must be a list of at most {limit}")
    try:
        return [Record.from_wire(r) for r in raw]
    except RecordError as e:
        raise DHTProtocolError(f"bad record: {e}") from None


def parse_nearest(
    response: object,
    n_keys: int,
    k: int,
    *,
    local: PeerID,
    responder: PeerID,
) -> tuple[dict[str, Any], list[list[WireContact]]]:
    """Validate a find_node/find_value answer for `n_keys` keys: the contacts per key.

    At most `k` contacts per key and `k * n_keys` distinct peers in all;
    contacts naming us or the responder are dropped (they are no news, but a
    few are normal), duplicates are dropped, contacts with no dialable
    address are dropped. Anything beyond the bounds is an error.
    """
    if not isinstance(response, dict):
        raise DHTProtocolError("response must be a map")
    peers_raw = response.get("peers")
    nearest_raw = response.get("nearest")
    if not isinstance(peers_raw, list) or len(peers_raw) > k * n_keys:
        raise DHTProtocolError(f"peers must be a list of at most {k * n_keys}")
    if not isinstance(nearest_raw, list) or len(nearest_raw) != n_keys:
        raise DHTProtocolError(f"nearest must list contacts for each of {n_keys} keys")
    peers: list[WireContact | None] = []
    seen: set[PeerID] = set()
    for item in peers_raw:
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], bytes)):
            raise DHTProtocolError("a contact must be [peer_id_bytes, [addrs]]")
        try:
            pid = _peer_id(item[0])
        except ValueError:
            raise DHTProtocolError("a contact has an invalid peer ID") from None
        if pid in seen:
            raise DHTProtocolError(f"peer {pid.short()} listed twice")
        seen.add(pid)
        if pid in (local, responder):
            peers.append(None)
            continue
        addrs = parse_addrs(pid, item[1])
        peers.append(WireContact(pid, addrs) if addrs else None)
    per_key: list[list[WireContact]] = []
    for idxs in nearest_raw:
        if not isinstance(idxs, list) or len(idxs) > k:
            raise DHTProtocolError(f"at most {k} contacts per key")
        out: list[WireContact] = []
        used: set[int] = set()
        for i in idxs:
            if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < len(peers):
                raise DHTProtocolError("contact index out of range")
            if i in used:
                raise DHTProtocolError("contact index repeated")
            used.add(i)
            c = peers[i]
            if c is not None:
                out.append(c)
        per_key.append(out)
    return response, per_key


def build_nearest(per_key: list[list[tuple[PeerID, tuple[Multiaddr, ...]]]]) -> dict[str, Any]:
    """The {peers, nearest} part of an answer, each peer sent once."""
    index: dict[PeerID, int] = {}
    peers: list[list[Any]] = []
    nearest: list[list[int]] = []
    for contacts in per_key:
        idxs = []
        for pid, addrs in contacts:
            i = index.get(pid)
            if i is None:
                i = index[pid] = len(peers)
                peers.append(contact_to_wire(pid, addrs))
            idxs.append(i)
        nearest.append(idxs)
    return {"peers": peers, "nearest": nearest}


def parse_values(response: dict[str, Any], keys: list[str]) -> dict[str, list[Record]]:
    """The records a find_value answer holds, by key; records for other keys are an error."""
    raw = response.get("values", {})
    if not isinstance(raw, dict) or len(raw) > len(keys):
        raise DHTProtocolError("values must be a map of at most one entry per key")
    out: dict[str, list[Record]] = {}
    for i, records_raw in raw.items():
        if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < len(keys):
            raise DHTProtocolError("value index out of range")
        records = parse_records(records_raw, MAX_RECORDS_PER_KEY)
        if any(r.key != keys[i] for r in records):
            raise DHTProtocolError("a record answers a key that was not asked for")
        if records:
            out[keys[i]] = records
    return out


def parse_counts(response: dict[str, Any], n_keys: int) -> dict[int, int]:
    """The record counts of a counted find_value answer, by key index: each a claim
    of the responder, bounded by what one answer could hold."""
    raw = response.get("counts", {})
    if not isinstance(raw, dict) or len(raw) > n_keys:
        raise DHTProtocolError("counts must be a map of at most one entry per key")
    out: dict[int, int] = {}
    for i, n in raw.items():
        if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < n_keys:
            raise DHTProtocolError("count index out of range")
        if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= MAX_RECORDS_PER_KEY:
            raise DHTProtocolError(f"a count must be an int in [0, {MAX_RECORDS_PER_KEY}]")
        out[i] = n
    return out


Cursor = tuple[bytes, int]  # (storage epoch, seq): see the module docstring


def cursors_to_wire(cursors: dict[int, Cursor]) -> dict[int, list[Any]]:
    return {i: [epoch, seq] for i, (epoch, seq) in cursors.items()}


def parse_cursors(raw: object, n_keys: int, field_name: str = "cursors") -> dict[int, Cursor]:
    """`since` of a request or `cursors` of an answer: at most one (epoch, seq) per
    requested key; absent is none. Anything else is malformed."""
    if raw is None:
        return {}
    if not isinstance(raw, dict) or len(raw) > n_keys:
        raise DHTProtocolError(f"{field_name} must be a map of at most one entry per key")
    out: dict[int, Cursor] = {}
    for i, item in raw.items():
        if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < n_keys:
            raise DHTProtocolError(f"{field_name} index out of range")
        if not (isinstance(item, list) and len(item) == 2):
            raise DHTProtocolError(f"{field_name} entries must be [epoch, seq]")
        epoch, seq = item
        if not isinstance(epoch, bytes) or len(epoch) > MAX_EPOCH_BYTES:
            raise DHTProtocolError(f"{field_name} epoch must be at most {MAX_EPOCH_BYTES} bytes")
        if not isinstance(seq, int) or isinstance(seq, bool) or not 0 <= seq < 1 << 63:
            raise DHTProtocolError(f"{field_name} seq must be an int in [0, 2**63)")
        out[i] = (epoch, seq)
    return out


def tags_to_wire(tags: Mapping[int, Collection[bytes]]) -> dict[int, list[bytes]]:
    return {i: list(t) for i, t in tags.items() if t}


def parse_tags(raw: object, n_keys: int, field_name: str) -> dict[int, set[bytes]]:
    """`known` of a request or `had` of an answer: per requested key, at most
    MAX_RECORDS_PER_KEY record tags of TAG_BYTES each; absent is none."""
    if raw is None:
        return {}
    if not isinstance(raw, dict) or len(raw) > n_keys:
        raise DHTProtocolError(f"{field_name} must be a map of at most one entry per key")
    out: dict[int, set[bytes]] = {}
    for i, tags in raw.items():
        if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < n_keys:
            raise DHTProtocolError(f"{field_name} index out of range")
        if not isinstance(tags, list) or len(tags) > MAX_RECORDS_PER_KEY:
            raise DHTProtocolError(f"{field_name} must list at most {MAX_RECORDS_PER_KEY} tags")
        if not all(isinstance(t, bytes) and len(t) == TAG_BYTES for t in tags):
            raise DHTProtocolError(f"{field_name} tags must be {TAG_BYTES} bytes")
        out[i] = set(tags)
    return out


def parse_stored(response: object, n: int) -> list[bool]:
    if not isinstance(response, dict):
        raise DHTProtocolError("response must be a map")
    stored = response.get("stored")
    if not isinstance(stored, list) or len(stored) != n:
        raise DHTProtocolError(f"stored must list {n} booleans")
    return [s is True for s in stored]
