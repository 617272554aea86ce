"""A verified round's secrets go member to member (peer/verify/withholding.py,
protocol 2.10): after a commit each member pushes its secret and its commitment's
digest to every other member (who hold the commitment: it came with the
contribution), and a gather takes the pushed records before it reads the DHT. When
every member took the push, nothing goes into the DHT and nothing is read from it; a
member that takes no push (a peer before 2.10, one out of reach) gets the whole record
from the DHT as before, and its own record, stored there, is read there; a member
that lacks a commitment asks its member for the whole record. A pushed record is
taken only as its sender's own, and what any peer can make us hold is bounded."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
from verification_round import commit, h

from shoal.dht.node import DHTNode
from shoal.peer.verify import audit_round, withholding
from shoal.peer.verify.audit_round import (
    encode_pushed,
    encode_record,
    gather,
    publish_record,
    records_key,
)
from shoal.peer.verify.withholding import DirectRecords, push_or_store
from shoal.transport import rpc
from shoal.transport.host import Host
from shoal.transport.identity import Identity
from shoal.transport.version import Hello, ProtocolVersion
from shoal.verification.commitment import Commitment
from shoal.verification.referees import new_secret

pytestmark = pytest.mark.timeout(60)
ROUND = 7
NS = "exp"
START = h("global")  # (the global state `commit` says its rounds started from)
PROTOCOL = "/shoal/test-records/1"


@pytest.fixture
async def nodes(dht_swarm: Callable[..., Any]) -> list[DHTNode]:
    made: list[DHTNode] = await dht_swarm(4)
    for node in made[1:]:  # (the round's connections)
        for other in made:
            if other is not node:
                await node.host.connect(other.host.addresses()[0])
    return made


def _round(nodes: list[DHTNode]) -> tuple[dict[Any, bytes], dict[Any, Commitment]]:
    secrets = {n.peer_id: new_secret() for n in nodes}
    mine = {n.peer_id: commit(n.host.identity, secrets[n.peer_id], rnd=ROUND) for n in nodes}
    return secrets, mine


def _count_reads(node: DHTNode) -> list[str]:
    """The keys `node` reads from now on."""
    reads: list[str] = []
    real = node.get

    async def get(key: str, **options: Any) -> Any:
        reads.append(key)
        return await real(key, **options)

    node.get = get  # type: ignore[method-assign]
    return reads


async def _publish(
    records: DirectRecords, node: DHTNode, mine: Commitment, secret: bytes, others: list[Any]
) -> bool:
    gathered = asyncio.Event()
    gathered.set()  # (stored once, not again: nobody gathers in these tests)
    return await push_or_store(records, node, NS, mine, secret, others, gathered,
                               every=5.0, within=0.0)  # fmt: skip


async def test_when_every_member_takes_the_push_nothing_goes_through_the_dht(
    nodes: list[DHTNode],
) -> None:
    secrets, mine = _round(nodes)
    records = {n.peer_id: DirectRecords(rpc.RpcService(n.host, PROTOCOL)) for n in nodes}
    members = [n.peer_id for n in nodes]
    reads = {n.peer_id: _count_reads(n) for n in nodes}

    stored = await asyncio.gather(*(
        _publish(records[n.peer_id], n, mine[n.peer_id], secrets[n.peer_id],
                 [p for p in members if p != n.peer_id])
        for n in nodes
    ))  # fmt: skip
    assert stored == [False] * 4
    views = await asyncio.gather(*(  # (the commitments came with the contributions)
        gather(n, NS, ROUND, mine, members, 10.0, {n.peer_id: secrets[n.peer_id]},
               start=START, pushed=records[n.peer_id])
        for n in nodes
    ))  # fmt: skip
    for commitments, found in views:
        assert commitments == mine and found == secrets
    assert all(r.pushed_to == 3 and r.pushed_here == 3 for r in records.values())
    assert all(not keys for keys in reads.values()), reads
    assert await nodes[0].get(records_key(NS, ROUND, START), latest=True) is None


async def test_a_member_that_takes_no_push_reads_the_dht_where_the_others_stored(
    nodes: list[DHTNode], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`old` speaks no 2.10: it takes no push and pushes nothing. The others store
    their records for it, and read its record, stored as before, from the DHT once
    the pushes they waited for did not bring it."""
    monkeypatch.setattr(audit_round, "PUSH_WAIT_S", 0.5)
    *new, old = nodes
    secrets, mine = _round(nodes)
    records = {n.peer_id: DirectRecords(rpc.RpcService(n.host, PROTOCOL)) for n in new}
    members = [n.peer_id for n in nodes]
    # One new member read old's hello (2.9): it does not even ask it to take a push.
    said = new[0].host.versions.peer_version
    older = Hello(ProtocolVersion(2, 9))
    monkeypatch.setattr(new[0].host.versions, "peer_version",
                        lambda p: older if p == old.peer_id else said(p))  # fmt: skip
    asked = []
    real_call = rpc.call

    async def call(host: Host, peer: Any, protocol: str, method: str, *args: Any, **kw: Any) -> Any:
        if method == "push":
            asked.append((host.peer_id, peer))
        return await real_call(host, peer, protocol, method, *args, **kw)

    monkeypatch.setattr(rpc, "call", call)
    stored = await asyncio.gather(*(
        _publish(records[n.peer_id], n, mine[n.peer_id], secrets[n.peer_id],
                 [p for p in members if p != n.peer_id])
        for n in new
    ))  # fmt: skip
    assert stored == [True] * 3
    assert all(r.pushed_to == 2 for r in records.values())
    assert (new[0].peer_id, old.peer_id) not in asked and (new[1].peer_id, old.peer_id) in asked
    assert await publish_record(old, NS, mine[old.peer_id], secrets[old.peer_id])

    started = time.monotonic()
    commitments, found = await gather(old, NS, ROUND, {old.peer_id: mine[old.peer_id]}, members,
                                      10.0, start=START)  # fmt: skip
    assert commitments == mine and found == secrets
    for n in new:
        commitments, found = await gather(
            n, NS, ROUND, mine, members, 10.0, {n.peer_id: secrets[n.peer_id]},
            start=START, pushed=records[n.peer_id],
        )  # fmt: skip
        assert commitments == mine and found == secrets
    assert time.monotonic() - started >= 0.5  # (each new member waited for old's push)


async def test_a_pushed_record_is_taken_only_as_its_senders_own_for_its_round(
    nodes: list[DHTNode], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(audit_round, "PUSH_WAIT_S", 0.3)
    a, b, c, _ = nodes
    secrets, mine = _round(nodes)
    records = {n.peer_id: DirectRecords(rpc.RpcService(n.host, PROTOCOL)) for n in (a, b, c)}
    b_record = encode_record(mine[b.peer_id], secrets[b.peer_id])
    b_other = commit(b.host.identity, secrets[b.peer_id], rnd=ROUND, steps=9)
    b_next = encode_record(commit(b.host.identity, secrets[b.peer_id], rnd=ROUND + 1),
                           secrets[b.peer_id])  # fmt: skip
    b_elsewhere = encode_record(commit(b.host.identity, secrets[b.peer_id], rnd=ROUND,
                                       start=h("another")), secrets[b.peer_id])  # fmt: skip
    wrong = [
        (c, ROUND, START, b_record),  # b's record, pushed by c as if it were its own
        (b, ROUND, START, b_next),  # b's next round's, for this one
        (b, ROUND, START, b_elsewhere),  # b's round 7 in another lineage, for this one
        (b, ROUND, h("another"), b_record),  # this one, for another lineage's
        (b, ROUND, START, encode_pushed(b_other, secrets[b.peer_id])),  # another commitment's
    ]
    for sender, round_index, start, record in wrong:
        took = await records[sender.peer_id].push(round_index, start, record, [a.peer_id])
        assert took == {a.peer_id}
        commitments, found = await gather(a, NS, ROUND, {b.peer_id: mine[b.peer_id]},
                                          [a.peer_id, b.peer_id], 0.4, start=START,
                                          pushed=records[a.peer_id])  # fmt: skip
        assert b.peer_id not in found and commitments == {b.peer_id: mine[b.peer_id]}
    right = encode_pushed(mine[b.peer_id], secrets[b.peer_id])
    await records[b.peer_id].push(ROUND, START, right, [a.peer_id])
    ours = {a.peer_id: secrets[a.peer_id]}
    _, found = await gather(a, NS, ROUND, {b.peer_id: mine[b.peer_id]}, [a.peer_id, b.peer_id],
                            5.0, ours, start=START, pushed=records[a.peer_id])  # fmt: skip
    assert found == {**ours, b.peer_id: secrets[b.peer_id]}


async def test_what_peers_can_push_to_us_is_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(withholding, "MAX_PUSHED", 10)
    service = SimpleNamespace(unary=lambda name: lambda fn: fn)
    records = DirectRecords(service)  # type: ignore[arg-type]
    peers = [Identity.generate().peer_id for _ in range(5)]

    def push(peer: Any, payload: object) -> Any:
        return records._on_push(SimpleNamespace(peer=peer), payload)  # type: ignore[arg-type]

    malformed = [None, [ROUND, START, b"r"], {"round": ROUND, "start": START},
                 {"round": True, "start": START, "record": b"r"},
                 {"round": -1, "start": START, "record": b"r"},
                 {"round": ROUND, "start": bytes(65), "record": b"r"},
                 {"round": ROUND, "start": START, "record": "r"},
                 {"round": ROUND, "start": START,
                  "record": bytes(withholding.MAX_PUSHED_RECORD + 1)}]  # fmt: skip
    for payload in malformed:
        with pytest.raises(ValueError):
            await push(peers[0], payload)
    # One sender's latest rounds only (pushes can come before our own commit)...
    for r in range(10):
        assert await push(peers[0], {"round": r, "start": START, "record": b"%d" % r})
    assert [r for r in range(10) if records.pushed(r, START)] == list(range(6, 10))
    assert records.pushed(9, START) == {peers[0]: b"9"}
    # ... and a bound on all of them, the oldest rounds going first.
    for i, peer in enumerate(peers[1:]):
        for r in (20 + i, 30 + i):
            await push(peer, {"round": r, "start": START, "record": b"x"})
    held = [r for r in range(40) if records.pushed(r, START)]
    assert len(held) == 10 and held[-8:] == [20, 21, 22, 23, 30, 31, 32, 33]


async def test_a_member_whose_record_came_after_our_gather_is_not_shunned(
    nodes: list[DHTNode], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every member took their pushes, so nothing went into the DHT; ours came late:
    `pushed` after our gather had given up, `asked` never pushed to us at all (its
    push to us failed, yet it answers for its record). The recheck finds both, pushed
    to us since or asked directly; `silent` is shunned."""
    monkeypatch.setattr(audit_round, "PUSH_WAIT_S", 0.2)
    me, pushed, asked, silent = nodes
    secrets, mine = _round(nodes)
    records = {n.peer_id: DirectRecords(rpc.RpcService(n.host, PROTOCOL)) for n in nodes}
    members = [n.peer_id for n in nodes]
    ours = {me.peer_id: secrets[me.peer_id]}
    commitments, found = await gather(me, NS, ROUND, mine, members, 0.5, ours, start=START,
                                      pushed=records[me.peer_id])  # fmt: skip
    missing = frozenset(commitments.keys() - found.keys())
    assert missing == {pushed.peer_id, asked.peer_id, silent.peer_id}

    shunned: list[Any] = []
    recheck = asyncio.ensure_future(withholding.recheck_withheld(
        me, NS, (ROUND, START), commitments, missing, lambda p, r: shunned.append(p) or 60.0,
        after=0.5, timeout=2.0, records=records[me.peer_id],
    ))  # fmt: skip
    for late in (pushed, asked):
        own = encode_record(mine[late.peer_id], secrets[late.peer_id])
        records[late.peer_id].publish(ROUND, START, own)
    record = encode_pushed(mine[pushed.peer_id], secrets[pushed.peer_id])
    assert await records[pushed.peer_id].push(ROUND, START, record, [me.peer_id])
    late = await recheck
    assert late == {p.peer_id: secrets[p.peer_id] for p in (pushed, asked)}
    assert shunned == [silent.peer_id]
    assert records[me.peer_id].found == 1  # (asked directly: `asked` alone answered)


async def test_a_member_that_lacks_a_commitment_asks_its_member_for_the_whole_record(
    nodes: list[DHTNode], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`a` owned no part of the round: b's commitment never came to it, and b's
    pushed secret alone cannot be checked. a asks b for its whole record."""
    monkeypatch.setattr(audit_round, "PUSH_WAIT_S", 0.3)
    a, b = nodes[:2]
    secrets, mine = _round(nodes)
    records = {n.peer_id: DirectRecords(rpc.RpcService(n.host, PROTOCOL)) for n in (a, b)}
    others = [a.peer_id]
    assert not await _publish(records[b.peer_id], b, mine[b.peer_id], secrets[b.peer_id], others)
    ours = {a.peer_id: secrets[a.peer_id]}
    commitments, found = await gather(
        a, NS, ROUND, {a.peer_id: mine[a.peer_id]}, [a.peer_id, b.peer_id], 10.0, ours,
        ask=lambda peers: records[a.peer_id].ask(ROUND, START, peers), start=START,
        pushed=records[a.peer_id],
    )  # fmt: skip
    assert commitments == {p: mine[p] for p in (a.peer_id, b.peer_id)}
    assert found == {**ours, b.peer_id: secrets[b.peer_id]}
    assert records[a.peer_id].found == 1 and records[b.peer_id].served == 1
