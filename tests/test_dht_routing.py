"""The Kademlia routing table, as a specification: IDs, buckets, eviction, addresses, lookups."""

from __future__ import annotations

import gc
import hashlib
import json
import random
import tracemalloc

from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.dht.routing import (
    ID_BITS,
    AddStatus,
    RoutingTable,
    bucket_range,
    common_prefix_len,
    dialable_addrs,
    distance,
    key_id,
    node_id,
)
from shoal.transport.identity import PeerID
from shoal.transport.multiaddr import Multiaddr

ids = st.integers(min_value=0, max_value=(1 << ID_BITS) - 1)
_rng = random.Random(1234)


def make_peer(rng: random.Random = _rng) -> PeerID:
    return PeerID.from_public_key(rng.randbytes(32))


def addr_of(i: int) -> str:
    return f"/ip4/10.{(i >> 16) & 255}.{(i >> 8) & 255}.{i & 255}/tcp/31337"


def peers_in_bucket(table: RoutingTable, index: int, n: int) -> list[PeerID]:
    out: list[PeerID] = []
    while len(out) < n:
        p = make_peer()
        if table.bucket_index(node_id(p)) == index:
            out.append(p)
    return out


def full_bucket(k: int = 4, **kw: object) -> tuple[RoutingTable, list[PeerID]]:
    """A table whose bucket 0 holds k contacts added at t=0..k-1; returns also 4 newcomers.
    (Its contacts count as stale at once, `recheck_after` 0, unless `kw` says otherwise.)"""
    kw.setdefault("recheck_after", 0.0)
    table = RoutingTable(make_peer(), k, **kw)  # type: ignore[arg-type]
    peers = peers_in_bucket(table, 0, k + 4)
    for t, p in enumerate(peers[:k]):
        assert table.add_or_update(p, [addr_of(t)], float(t)).status is AddStatus.ADDED
    return table, peers


# ---------------------------------------------------------------- IDs and the metric


@given(ids, ids, ids)
def test_xor_is_a_metric(a: int, b: int, c: int) -> None:
    assert distance(a, a) == 0
    assert (distance(a, b) == 0) == (a == b)
    assert distance(a, b) == distance(b, a)
    assert distance(a, c) <= distance(a, b) + distance(b, c)
    # unidirectional: exactly one ID lies at a given distance from a point
    assert a ^ distance(a, b) == b


@given(ids, ids)
def test_common_prefix_len_and_bucket_range(a: int, b: int) -> None:
    cpl = common_prefix_len(a, b)
    assert 0 <= cpl <= ID_BITS
    assert (cpl == ID_BITS) == (a == b)
    if a != b:
        low, high = bucket_range(a, cpl)
        assert low <= b <= high
        assert common_prefix_len(a, low) == cpl == common_prefix_len(a, high)


def test_node_and_key_ids() -> None:
    p = make_peer()
    assert node_id(p) == int.from_bytes(hashlib.sha256(p.to_bytes()).digest(), "big")
    assert node_id(PeerID(p.to_bytes())) == node_id(p)
    assert 0 <= node_id(p) < 1 << ID_BITS
    assert key_id("ключ") == key_id("ключ".encode())
    assert key_id(b"a") != key_id(b"b")


# ---------------------------------------------------------------- buckets and eviction


def test_self_is_never_added() -> None:
    me = make_peer()
    table = RoutingTable(me)
    result = table.add_or_update(me, [addr_of(1)], 0.0)
    assert result.status is AddStatus.IGNORED
    assert me not in table
    assert len(table) == 0


def test_up_to_k_per_bucket_then_ping_the_least_recently_seen() -> None:
    table, peers = full_bucket(k=4)
    assert len(table) == 4
    assert [c.peer_id for c in table] == peers[:4]
    result = table.add_or_update(peers[4], [addr_of(4)], 10.0)
    assert result.status is AddStatus.NEEDS_PING
    assert result.needs_ping is not None
    assert result.needs_ping.peer_id == peers[0]
    assert peers[4] not in table
    assert table.replacements(node_id(peers[4]))[0].peer_id == peers[4]


def test_a_full_bucket_heard_from_lately_asks_for_no_ping() -> None:
    """Its least-recently-seen contact was heard from within `recheck_after`: no ping
    (each one costs a dial, and the pinged peer, hearing from a stranger, pinged one of
    its own contacts in turn: a chain through the swarm). The newcomer waits in the
    replacement cache; once the contact is stale, the next newcomer asks for its ping."""
    table, peers = full_bucket(k=4, recheck_after=300.0)  # contacts seen at t = 0..3
    fresh = table.add_or_update(peers[4], [addr_of(4)], 299.0)
    assert fresh.status is AddStatus.CACHED and fresh.needs_ping is None
    assert peers[4] not in table
    assert table.replacements(node_id(peers[4]))[0].peer_id == peers[4]
    stale = table.add_or_update(peers[5], [addr_of(5)], 300.0)
    assert stale.status is AddStatus.NEEDS_PING
    assert stale.needs_ping is not None and stale.needs_ping.peer_id == peers[0]


def test_other_buckets_are_not_affected_by_a_full_one() -> None:
    table, _ = full_bucket(k=4)
    [other] = peers_in_bucket(table, 1, 1)
    assert table.add_or_update(other, [addr_of(99)], 5.0).status is AddStatus.ADDED


def test_ping_alive_keeps_the_old_contact_and_caches_the_newcomer() -> None:
    table, peers = full_bucket(k=4)
    result = table.add_or_update(peers[4], [addr_of(4)], 10.0)
    assert result.needs_ping is not None
    table.ping_result(result.needs_ping.peer_id, alive=True, now=11.0)
    assert [c.peer_id for c in table] == [*peers[1:4], peers[0]]  # moved to the tail
    assert table.get(peers[0]).last_seen == 11.0  # type: ignore[union-attr]
    assert peers[4] not in table
    assert [c.peer_id for c in table.replacements(node_id(peers[4]))] == [peers[4]]
    # the ping is over: the next newcomer triggers a ping of the new LRS contact
    again = table.add_or_update(peers[5], [addr_of(5)], 12.0)
    assert again.status is AddStatus.NEEDS_PING
    assert again.needs_ping is not None and again.needs_ping.peer_id == peers[1]


def test_ping_dead_evicts_and_promotes_the_newcomer() -> None:
    table, peers = full_bucket(k=4)
    result = table.add_or_update(peers[4], [addr_of(4)], 10.0)
    assert result.needs_ping is not None
    table.ping_result(peers[0], alive=False, now=15.0)
    assert peers[0] not in table
    assert peers[4] in table
    assert [c.peer_id for c in table] == [*peers[1:4], peers[4]]
    assert table.replacements(node_id(peers[4])) == []


def test_one_ping_at_a_time_per_bucket_until_it_expires() -> None:
    table, peers = full_bucket(k=4, ping_timeout=5.0)
    first = table.add_or_update(peers[4], [addr_of(4)], 10.0)
    assert first.status is AddStatus.NEEDS_PING
    second = table.add_or_update(peers[5], [addr_of(5)], 11.0)
    assert second.status is AddStatus.CACHED
    assert second.needs_ping is None
    assert table.add_or_update(peers[6], [addr_of(6)], 14.9).status is AddStatus.CACHED
    # no ping_result ever came: after the timeout a new ping may be asked for
    late = table.add_or_update(peers[7], [addr_of(7)], 15.0)
    assert late.status is AddStatus.NEEDS_PING
    # dead: the most recent newcomer takes the slot
    table.ping_result(peers[0], alive=False, now=16.0)
    assert peers[7] in table
    assert [c.peer_id for c in table.replacements(node_id(peers[4]))] == peers[6:3:-1]


def test_seen_updates_least_recently_seen_order() -> None:
    table, peers = full_bucket(k=4)
    assert table.add_or_update(peers[0], [], 5.0).status is AddStatus.UPDATED
    assert table.mark_seen(peers[1], 6.0)
    assert [c.peer_id for c in table] == [peers[2], peers[3], peers[0], peers[1]]
    result = table.add_or_update(peers[4], [addr_of(4)], 7.0)
    assert result.needs_ping is not None and result.needs_ping.peer_id == peers[2]
    assert not table.mark_seen(peers[5], 8.0)  # not in the table: nothing happens
    assert peers[5] not in table


def test_replacement_cache_is_bounded_and_most_recent_first() -> None:
    table = RoutingTable(make_peer(), 2, replacement_cache=3)
    peers = peers_in_bucket(table, 0, 8)
    for t, p in enumerate(peers):
        table.add_or_update(p, [addr_of(t)], float(t))
    target = node_id(peers[0])
    assert [c.peer_id for c in table.replacements(target)] == [peers[7], peers[6], peers[5]]
    # a cached peer heard from again becomes the most recent
    assert table.add_or_update(peers[5], [addr_of(5)], 20.0).status is AddStatus.CACHED
    assert [c.peer_id for c in table.replacements(target)] == [peers[5], peers[7], peers[6]]


def test_without_a_replacement_a_failing_contact_stays_flagged_stale() -> None:
    """Kademlia 4.1: if our own link goes down every contact fails; a table that
    evicted them all would be empty when the link comes back, with nothing to refill it."""
    table, peers = full_bucket(k=4, max_failures=3)
    for t in range(10):  # a partition: every RPC to every contact fails
        for p in peers[:4]:
            assert not table.mark_failed(p, 20.0 + t)
    assert len(table) == 4 and all(table.get(p).failures == 10 for p in peers[:4])  # type: ignore[union-attr]
    table.mark_seen(peers[1], 40.0)  # the link is back
    assert table.get(peers[1]).failures == 0  # type: ignore[union-attr]
    # A newcomer now waits in the cache and takes a stale contact's place at its next failure.
    table.add_or_update(peers[4], [addr_of(4)], 41.0)
    assert table.mark_failed(peers[0], 42.0)
    assert peers[0] not in table and peers[4] in table


def test_failures_evict_and_promote_a_replacement() -> None:
    table, peers = full_bucket(k=4, max_failures=3)
    table.add_or_update(peers[4], [addr_of(4)], 10.0)
    table.ping_result(peers[0], alive=True, now=10.5)  # newcomer stays as a replacement
    table.add_or_update(peers[5], [addr_of(5)], 11.0)
    victim = peers[2]
    assert not table.mark_failed(victim, 12.0)
    assert not table.mark_failed(victim, 13.0)
    assert table.get(victim).failures == 2  # type: ignore[union-attr]
    table.mark_seen(victim, 14.0)  # a success in between resets the count
    assert table.get(victim).failures == 0  # type: ignore[union-attr]
    assert not table.mark_failed(victim, 15.0)
    assert not table.mark_failed(victim, 16.0)
    assert table.mark_failed(victim, 17.0)
    assert victim not in table
    assert peers[5] in table  # the most recent replacement
    assert peers[4] not in table
    assert len(table) == 4


def test_remove_promotes_and_table_protocols() -> None:
    table, peers = full_bucket(k=4)
    table.add_or_update(peers[4], [addr_of(4)], 10.0)
    table.ping_result(peers[0], alive=True, now=10.0)
    removed = table.remove(peers[1])
    assert removed is not None and removed.peer_id == peers[1]
    assert peers[4] in table and len(table) == 4
    assert table.get(peers[1]) is None
    assert table.remove(peers[1]) is None
    contact = table.get(peers[4])
    assert contact is not None and contact.node_id == node_id(peers[4])
    assert {c.peer_id for c in table} == {peers[0], peers[2], peers[3], peers[4]}
    for c in table:  # iterating over a copy: removal while iterating is fine
        table.remove(c.peer_id)
    assert len(table) == 0


# ---------------------------------------------------------------- addresses


def test_only_dialable_addresses_are_kept() -> None:
    table = RoutingTable(make_peer())
    p, other, relay = make_peer(), make_peer(), make_peer()
    bad = [
        "/ip4/0.0.0.0/tcp/31337",
        "/ip6/::/tcp/31337",
        "/ip4/1.2.3.4/tcp/0",
        "not an address",
        "/ip4/1.2.3.4",
        b"\xff\xff\xff",
        12345,
        f"/p2p/{p}",  # a name only
        f"/ip4/1.2.3.4/tcp/5/p2p/{other}",  # someone else's
        f"/p2p/{relay}/p2p-circuit/p2p/{other}",
        f"/ip4/0.0.0.0/tcp/4001/p2p/{relay}/p2p-circuit",
        f"/p2p/{p}/p2p-circuit",  # relayed through itself
    ]
    result = table.add_or_update(p, bad, 0.0)  # type: ignore[arg-type]
    assert result.status is AddStatus.IGNORED
    assert p not in table
    good = [
        "/ip4/1.2.3.4/tcp/5",
        Multiaddr(f"/ip4/1.2.3.4/tcp/5/p2p/{p}"),  # same address, spelled with the ID
        "/ip6/2001:db8::1/tcp/31337",
        "/dns/peer.example.org/tcp/31337",
        f"/ip4/5.6.7.8/tcp/4001/p2p/{relay}/p2p-circuit/p2p/{p}",
        f"/p2p/{relay}/p2p-circuit",
        "/ip4/1.2.3.4/tcp/5",
    ]
    result = table.add_or_update(p, bad + good, 1.0)  # type: ignore[arg-type]
    assert result.status is AddStatus.ADDED
    assert [str(a) for a in table.get(p).addrs] == [  # type: ignore[union-attr]
        "/ip4/1.2.3.4/tcp/5",
        "/ip6/2001:db8::1/tcp/31337",
        "/dns/peer.example.org/tcp/31337",
        f"/ip4/5.6.7.8/tcp/4001/p2p/{relay}/p2p-circuit",
        f"/p2p/{relay}/p2p-circuit",
    ]


def test_addresses_capped_and_merged_new_first() -> None:
    p = make_peer()
    many = [addr_of(i) for i in range(20)]
    assert len(dialable_addrs(p, many, max_addrs=3)) == 3
    # a hostile flood is only scanned so far
    assert dialable_addrs(p, ["junk"] * 10_000 + [addr_of(1)], max_addrs=2) == ()
    table = RoutingTable(make_peer(), max_addrs=3)
    table.add_or_update(p, [addr_of(1), addr_of(2)], 0.0)
    table.add_or_update(p, [addr_of(3)], 1.0)
    assert table.get(p).addrs == tuple(Multiaddr(addr_of(i)) for i in (3, 1, 2))  # type: ignore[union-attr]
    table.add_or_update(p, ["/ip4/0.0.0.0/tcp/1"], 2.0)  # nothing dialable: still seen
    assert table.get(p).last_seen == 2.0  # type: ignore[union-attr]
    assert len(table.get(p).addrs) == 3  # type: ignore[union-attr]
    table.add_or_update(p, [addr_of(9)], 3.0, replace_addrs=True)
    assert table.get(p).addrs == (Multiaddr(addr_of(9)),)  # type: ignore[union-attr]


# ---------------------------------------------------------------- nearest


def brute_force(table: RoutingTable, target: int, count: int, exclude: set[PeerID]) -> list[int]:
    return sorted((c.node_id for c in table if c.peer_id not in exclude), key=lambda n: n ^ target)[
        :count
    ]


@settings(max_examples=60, deadline=None)
@given(
    seeds=st.lists(st.binary(min_size=32, max_size=32), min_size=0, max_size=120, unique=True),
    local=st.binary(min_size=32, max_size=32),
    k=st.integers(min_value=1, max_value=8),
    target=ids,
    near_bits=st.one_of(st.none(), st.integers(min_value=0, max_value=ID_BITS)),
    count=st.integers(min_value=0, max_value=40),
    n_exclude=st.integers(min_value=0, max_value=10),
)
def test_nearest_equals_brute_force(
    seeds: list[bytes],
    local: bytes,
    k: int,
    target: int,
    near_bits: int | None,
    count: int,
    n_exclude: int,
) -> None:
    table = RoutingTable(PeerID.from_public_key(local), k)
    peers = [PeerID.from_public_key(s) for s in seeds]
    for t, p in enumerate(peers):
        table.add_or_update(p, [addr_of(t)], float(t))
    if near_bits is not None:
        # targets close to our own ID exercise the deep buckets
        target = table.local_id ^ (target & ((1 << near_bits) - 1))
    exclude = set(peers[:n_exclude])
    got = table.nearest(target, count, exclude)
    assert [c.node_id for c in got] == brute_force(table, target, count, exclude)


def test_nearest_in_a_large_table() -> None:
    rng = random.Random(7)
    table = RoutingTable(make_peer(rng), 20)
    for i in range(3000):
        table.add_or_update(make_peer(rng), [addr_of(i)], float(i))
    assert 150 < len(table) < 400
    for _ in range(50):
        target = rng.getrandbits(ID_BITS)
        got = table.nearest(target, 20)
        assert [c.node_id for c in got] == brute_force(table, target, 20, set())
    assert table.nearest(0, 0) == []
    assert len(table.nearest(table.local_id, 10_000)) == len(table)


# ---------------------------------------------------------------- refresh


def test_refresh_targets_fall_in_stale_buckets() -> None:
    rng = random.Random(3)
    table = RoutingTable(make_peer(rng), 4, rng=rng)
    for i in range(200):
        table.add_or_update(make_peer(rng), [addr_of(i)], 0.0)
    touched = {table.bucket_index(c.node_id) for c in table}
    deepest = max(touched)
    # recently updated buckets are fresh; the empty one just past the deepest is not
    stale = [table.bucket_index(t) for t in table.buckets_to_refresh(100.0, interval=600.0)]
    assert stale == [i for i in range(deepest + 2) if i not in touched]
    assert deepest + 1 in stale
    # everything is stale after the interval: one target per bucket 0..deepest+1
    targets = table.buckets_to_refresh(700.0, interval=600.0)
    indices = [table.bucket_index(t) for t in targets]
    assert indices == list(range(deepest + 2))
    for index, t in zip(indices, targets, strict=True):
        low, high = bucket_range(table.local_id, index)
        assert low <= t <= high
    # a completed lookup refreshes its bucket
    table.touch_bucket_for(targets[0], 700.0)
    assert 0 not in [table.bucket_index(t) for t in table.buckets_to_refresh(800.0, 600.0)]
    assert 0 in [table.bucket_index(t) for t in table.buckets_to_refresh(1300.0, 600.0)]


def test_refresh_of_an_empty_table() -> None:
    table = RoutingTable(make_peer())
    [target] = table.buckets_to_refresh(0.0)
    assert table.bucket_index(target) == 0


# ---------------------------------------------------------------- status and scale


def test_snapshot_is_json() -> None:
    table, peers = full_bucket(k=4)
    table.add_or_update(peers[4], [addr_of(4)], 10.0)
    [other] = peers_in_bucket(table, 1, 1)
    table.add_or_update(other, [addr_of(9)], 11.0)
    snap = table.snapshot(20.0, contacts=True)
    decoded = json.loads(json.dumps(snap))
    assert decoded["size"] == 5
    assert decoded["k"] == 4
    assert decoded["replacements"] == 1
    b0 = decoded["buckets"][0]
    assert b0["index"] == 0
    assert (b0["count"], b0["replacements"], b0["ping_pending"]) == (4, 1, True)
    assert b0["oldest_seen_age"] == 20.0
    assert b0["contacts"][0]["peer_id"] == str(peers[0])
    assert json.dumps(RoutingTable(make_peer()).snapshot(0.0))


def test_memory_per_contact_fits_a_thousand_node_simulation() -> None:
    """1,000 tables of ~100 contacts must fit easily in 2 GB; measure 20 tables and scale."""
    rng = random.Random(11)
    pool = [make_peer(rng) for _ in range(1000)]
    texts = [f"{addr_of(i)}/p2p/{p}" for i, p in enumerate(pool)]
    for p in pool:
        node_id(p)  # the shared ID cache is not per table
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        tables = []
        for i in range(20):
            table = RoutingTable(pool[i], 20)
            for j in rng.sample(range(1000), 300):
                # fresh objects, as if each address came off the wire
                table.add_or_update(pool[j], [Multiaddr(texts[j])], float(j))
            tables.append(table)
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    contacts = sum(len(t) for t in tables) + sum(
        len(t.replacements(t.local_id ^ (1 << 255))) for t in tables
    )
    assert contacts > 20 * 60
    per_contact = used / contacts
    assert per_contact < 2000, per_contact  # 1,000 x 100 contacts: under 200 MB
