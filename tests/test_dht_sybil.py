"""Sybil and eclipse resistance of the DHT (issue 21, item 3).

The attacker makes peer IDs for free but not addresses: 200 Sybils in one /24,
IDs ground next to the key, answering lookups with each other and hiding the
record, cannot hide it from honest peers in other /24s. The pieces: IP
diversity in routing tables, lookup beams and replica sets; holders counted by
group for a value lookup's early stop; storage quotas per origin; request rate
limits with a typed busy answer.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest
from dht_sim import sybil_attack

from shoal.dht.admission import (
    NO_DIVERSITY,
    DiversityPolicy,
    RateLimits,
    RequestAdmission,
    ip_group,
)
from shoal.dht.lookup import Candidate, KeyLookup, traverse
from shoal.dht.node import DHTNode
from shoal.dht.protocol import WireContact
from shoal.dht.records import Record
from shoal.dht.routing import AddStatus, RoutingTable, key_id, node_id
from shoal.dht.storage import LocalStorage
from shoal.transport.identity import Identity, PeerID

HOST_OPTS = {
    "max_connections_per_ip": 100_000,
    "max_connections": 100_000,
    "close_grace": 0.1,
    "reuse_port": True,  # outbound connections leave from the listen IP, as on a real host
}


def peer() -> PeerID:
    return Identity.generate().peer_id


def peers_in_bucket(table: RoutingTable, index: int, n: int) -> list[PeerID]:
    out: list[PeerID] = []
    while len(out) < n:
        p = peer()
        if table.bucket_index(node_id(p)) == index:
            out.append(p)
    return out


# ---------------------------------------------------------------- IP groups


def test_ip_groups_are_the_24_and_the_48_and_private_ranges_are_exempt() -> None:
    assert ip_group("198.51.100.7") == "198.51.100.0/24"
    assert ip_group("2001:db8:1:2::5") == "2001:db8:1::/48"
    assert ip_group("::ffff:203.0.113.9") == "203.0.113.0/24"  # v4-mapped counts as v4
    for exempt in ("127.0.0.1", "10.1.2.3", "192.168.0.5", "172.20.0.1", "::1", "fd00::1"):
        assert ip_group(exempt) is None
    assert ip_group("127.0.0.1", ()) == "127.0.0.0/24"  # no exemption: counted too
    assert ip_group("not an ip") is None


# ---------------------------------------------------------------- routing table


def test_a_bucket_keeps_two_contacts_per_24_and_the_rest_wait_as_replacements() -> None:
    table = RoutingTable(peer(), 20)
    same_24 = peers_in_bucket(table, 0, 5)
    results = [
        table.add_or_update(p, ["/ip4/203.0.113.9/tcp/1"], 0.0, observed_ip=f"203.0.113.{i}")
        for i, p in enumerate(same_24)
    ]
    assert [r.status for r in results] == [AddStatus.ADDED] * 2 + [AddStatus.CACHED] * 3
    assert results[2].reason == "ip diversity"
    # another /24 still gets in: the bucket has room for honest peers
    other = peers_in_bucket(table, 0, 1)[0]
    assert table.add_or_update(other, ["/ip4/198.51.100.1/tcp/1"], 1.0).status is AddStatus.ADDED
    # one of the two leaves: the most recent waiting contact of that /24 takes its place
    table.remove(same_24[0])
    assert same_24[4] in table and len(table) == 3


def test_the_whole_table_keeps_at_most_ten_contacts_per_24() -> None:
    # (the bucket limit lifted: random IDs would not fill 5 buckets with 2 each every time)
    table = RoutingTable(peer(), 20, diversity=DiversityPolicy(per_group_bucket=20))
    added = 0
    for i in range(200):
        r = table.add_or_update(peer(), [f"/ip4/203.0.113.{i % 250 + 1}/tcp/1"], 0.0)
        added += r.in_table
    assert added == 10
    assert table.snapshot(0.0)["ip_groups"] == 1


def test_the_observed_ip_decides_the_group_not_the_advertised_one() -> None:
    table = RoutingTable(peer(), 20, diversity=DiversityPolicy(per_group_table=1))
    a, b = peer(), peer()
    # b advertises another /24, but its connection comes from a's /24
    assert table.add_or_update(a, ["/ip4/203.0.113.1/tcp/1"], 0.0).in_table
    r = table.add_or_update(b, ["/ip4/198.51.100.1/tcp/1"], 0.0, observed_ip="203.0.113.2")
    assert r.status is AddStatus.CACHED
    assert table.get(a) is not None and table.get(a).ip_group == "203.0.113.0/24"  # type: ignore[union-attr]


def test_loopback_and_private_peers_are_not_limited_unless_configured() -> None:
    open_table = RoutingTable(peer(), 20)
    strict = RoutingTable(peer(), 20, diversity=DiversityPolicy(exempt=(), per_group_bucket=20))
    for _ in range(30):
        p = peer()
        open_table.add_or_update(p, ["/ip4/127.0.0.1/tcp/1"], 0.0, observed_ip="127.0.0.1")
        strict.add_or_update(p, ["/ip4/127.0.0.1/tcp/1"], 0.0, observed_ip="127.0.0.1")
    assert len(open_table) > 10  # only k per bucket bounds it
    assert len(strict) == 10


# ---------------------------------------------------------------- storage quotas


NOW = 1_000_000.0


def test_long_lived_junk_from_one_origin_cannot_evict_short_lived_honest_records() -> None:
    storage = LocalStorage(max_entries=1000)
    honest = [(peer(), f"198.18.{i}.0/24") for i in range(20)]
    for i, origin in enumerate(honest):
        record = Record(f"declaration/{i}", None, b"x", NOW + 30)  # matchmaking: 30 s
        assert storage.store(record, NOW, origin)
    sybil_group = "203.0.113.0/24"
    for i in range(5000):  # 200 Sybil peers of one /24, a day-long record each
        origin = (f"sybil{i % 200}", sybil_group)
        storage.store(Record(f"junk/{i}", None, b"y" * 100, NOW + 86_000), NOW, origin)
    for i in range(20):
        assert storage.get(f"declaration/{i}", NOW) is not None
    # the group holds its 5 % share, whatever the number of its peer IDs
    assert storage.group_usage(sybil_group)[0] == storage.group_quota[0] == 50
    assert storage.stats()["over_quota"] == 5000 - 50


def test_a_full_storage_evicts_from_the_largest_origin_first() -> None:
    storage = LocalStorage(max_entries=100, peer_share=0.6, group_share=0.6)
    small, big, bigger = (peer(), None), (peer(), None), (peer(), None)
    for i in range(10):
        storage.store(Record(f"small/{i}", None, b"x", NOW + 30), NOW, small)
    for i in range(200):  # each big origin fills its quota of 60; together they do not fit
        storage.store(Record(f"big/{i}", None, b"x", NOW + 3600 + i), NOW, big)
        storage.store(Record(f"bigger/{i}", None, b"x", NOW + 7200 + i), NOW, bigger)
    assert len(storage) == 100
    assert storage.usage(small)[0] == 10  # the soonest-expiring records, untouched
    assert storage.usage(big)[0] + storage.usage(bigger)[0] == 90
    assert abs(storage.usage(big)[0] - storage.usage(bigger)[0]) <= 1


def test_records_stored_without_an_origin_are_charged_to_no_quota() -> None:
    storage = LocalStorage(max_entries=100)
    for i in range(100):
        assert storage.store(Record(f"own/{i}", None, b"x", NOW + 60), NOW)
    assert len(storage) == 100


# ---------------------------------------------------------------- rate limits


def test_request_admission_limits_peers_ips_and_groups() -> None:
    limits = RateLimits(per_peer=1, peer_burst=2, per_ip=1, ip_burst=3, per_group=1, group_burst=4)
    admission = RequestAdmission(limits)
    a, b, c = peer(), peer(), peer()
    assert [admission.admit(a, "203.0.113.1", 0.0) for _ in range(3)] == [True, True, False]
    # a fresh peer on the same IP: the IP's bucket (3) has 0 left after a's 3 requests
    assert not admission.admit(b, "203.0.113.1", 0.0)
    # another IP of the /24: the group's bucket (4) is spent too
    assert not admission.admit(c, "203.0.113.2", 0.0)
    assert admission.admit(c, "198.51.100.1", 0.0)  # another /24 is untouched
    assert admission.admit(a, "203.0.113.1", 5.0)  # tokens come back
    # loopback peers are limited per peer only
    loop = RequestAdmission(limits)
    assert all(loop.admit(peer(), "127.0.0.1", 0.0) for _ in range(50))


async def test_a_throttled_requester_gets_a_busy_answer_and_does_not_count_it_as_garbage(
    make_host: Callable[..., Any],
) -> None:
    tight = RateLimits(per_peer=0.01, peer_burst=2)
    server = await DHTNode.create(await make_host(**HOST_OPTS), rate_limits=tight)
    client = await DHTNode.create(
        await make_host(**HOST_OPTS), bootstrap=[str(server.host.addresses()[0])]
    )
    try:
        # the bootstrap ping and the self-lookup took the burst; the next request is refused
        assert await client.get("anything") is None
        stats = client.stats()
        assert stats["busy_answers"] >= 1
        assert stats["garbage_answers"] == 0 and stats["requests_failed"] == 0
        assert server.peer_id in client.routing_table  # not failed: still a contact
        assert client.routing_table.get(server.peer_id).failures == 0  # type: ignore[union-attr]
        assert server.stats()["requests_refused"] >= 1
    finally:
        await client.aclose()
        await server.aclose()


# ---------------------------------------------------------------- lookups


def _cand(group: str | None) -> Candidate:
    p = peer()
    return Candidate(p, node_id(p), (), 0, group)


def test_a_lookup_beam_gives_one_group_at_most_two_of_its_slots() -> None:
    lk = KeyLookup(key_id("k"), per_group=2)
    sybils = [_cand("203.0.113.0/24") for _ in range(50)]
    honest = [_cand(f"198.18.{i}.0/24") for i in range(50)]
    for c in sybils:  # ground next to the key: closer than every honest peer
        c.node_id = key_id("k") ^ (c.node_id >> 200)
    for c in sybils + honest:
        lk.add(c)
    best = lk.best(20, set())
    assert sum(c.group == "203.0.113.0/24" for c in best) == 2 and len(best) == 20
    assert len(KeyLookup(key_id("k"), candidates=lk.candidates).best(20, set())) == 20


def test_the_cap_never_leaves_a_slot_empty() -> None:
    """A small swarm in one /24 (a lab, a campus) is still searched in full: peers
    over their group's share only fill slots no other group could."""
    lk = KeyLookup(key_id("k"), per_group=2)
    same = [_cand("198.51.100.0/24") for _ in range(5)]
    other = _cand("198.18.0.0/24")
    for c in [*same, other]:
        lk.add(c)
    best = lk.best(20, set())
    assert set(best) == {*same, other}
    assert {c.group for c in best[:3]} == {"198.51.100.0/24", "198.18.0.0/24"}  # diverse first
    assert lk.best(3, set()).count(other) == 1


async def _value_lookup_with_fast_sybils(per_group: int | None) -> KeyLookup:
    """Two Sybils of one /24, closest to the key, answer at once with an old record;
    honest peers answer the newer one only after both Sybils did."""
    key = "k"
    old = Record(key, None, b"old", time.time() + 60)
    new = Record(key, None, b"new", time.time() + 120)
    sybils = [_cand("203.0.113.0/24") for _ in range(2)]
    honest = [_cand(f"198.18.{i}.0/24") for i in range(6)]
    for c in sybils:  # closest to the key: asked first
        c.node_id = key_id(key) ^ (c.node_id >> 200)
    lk = KeyLookup(key_id(key), key, quorum=2, per_group=per_group)
    for c in sybils + honest:
        lk.add(c)
    sybils_answered = asyncio.Event()

    async def query(cand: Candidate, lks: list[KeyLookup]) -> list[list[WireContact]]:
        if cand.group == "203.0.113.0/24":
            record = old
            if sum(h.group == cand.group for h in lks[0].holders) == 1:
                sybils_answered.set()
        else:
            await sybils_answered.wait()
            for _ in range(10):  # let the lookup take in the Sybils' answers first
                await asyncio.sleep(0)
            record = new
        for x in lks:
            x.records.append(record)
            x.holders.append(cand)
        return [[] for _ in lks]

    await traverse(
        [lk],
        query,
        k=20,
        alpha=3,
        stall_after=1.0,
        on_failure=lambda c, e: None,
        blocked=lambda p: False,
    )
    return lk


async def test_holders_in_one_24_do_not_end_a_value_lookup_early() -> None:
    """Sybils in one /24 count as one holder: the lookup waits for a holder in
    another group, and sees the newer honest record."""
    lk = await _value_lookup_with_fast_sybils(per_group=2)
    assert any(r.value == b"new" for r in lk.records)
    # counted per peer (no diversity), the two Sybils end the lookup on their own
    plain = await _value_lookup_with_fast_sybils(per_group=None)
    assert [r.value for r in plain.records] == [b"old", b"old"]


# ---------------------------------------------------------------- the attack


@pytest.mark.timeout(60)
async def test_two_hundred_sybils_in_one_24_cannot_hide_an_honest_record() -> None:
    """The issue's criterion in simulation: >= 99 % of 2,000 lookups from honest
    peers find the record; without the defences the same attack hides it."""
    rates = []
    for seed in (1, 2):
        result = await sybil_attack(defended=True, lookups=1000, seed=seed)
        assert result["honest_replicas"] >= 15  # replicas picked with diversity
        rates.append(result["success_rate"])
    assert min(rates) >= 0.99, rates
    control = await sybil_attack(defended=False, lookups=100, seed=1)
    assert control["honest_replicas"] == 0
    assert control["success_rate"] < 0.5, control


async def test_the_observed_ip_of_a_connection_reaches_the_routing_table(
    make_host: Callable[..., Any],
) -> None:
    """Over real sockets: five peers dialing from 127.66.6.x (one /24 once loopback is
    not exempt) take at most the table's share of that /24, and what they store is
    charged to it."""
    # (per bucket lifted: five random IDs all in one bucket would leave only 2)
    policy = DiversityPolicy(exempt=(), per_group_table=3, per_group_bucket=20)
    server = await DHTNode.create(await make_host(**HOST_OPTS), diversity=policy)
    sybils = []
    try:
        for i in range(5):
            host = await make_host(**HOST_OPTS, listen=(f"/ip4/127.66.6.{i + 1}/tcp/0",))
            sybils.append(
                await DHTNode.create(
                    host, bootstrap=[str(server.host.addresses()[0])], diversity=policy
                )
            )
        groups = {c.ip_group for c in server.routing_table}
        assert groups == {"127.66.6.0/24"}
        assert len(server.routing_table) == 3
        # what they store is charged to their /24, as observed
        assert await sybils[0].store("charged", 1, time.time() + 60)
        assert server.storage.group_usage("127.66.6.0/24")[0] == 1
    finally:
        await asyncio.gather(*(s.aclose() for s in sybils), server.aclose())


def test_no_diversity_is_the_plain_kademlia_table() -> None:
    table = RoutingTable(peer(), 20, diversity=NO_DIVERSITY)
    for _ in range(30):
        table.add_or_update(peer(), ["/ip4/203.0.113.1/tcp/1"], 0.0)
    assert len(table) > 10
