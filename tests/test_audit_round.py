"""After a verified round commits, the members' secrets meet in the DHT
(peer/verify/audit_round.py): every member draws the same, a member that contributed
nothing is not waited for, one that committed and withholds is, up to the
deadline, a member's two different commitments for one round are not
accepted, and what the DHT lacks is asked of the members directly."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from types import SimpleNamespace
from typing import Any

import pytest
from verification_round import commit, h

from shoal.dht.node import DHTNode
from shoal.peer.verify import audit_round
from shoal.peer.verify.audit_round import RecentRounds, encode_record, gather, publish_record
from shoal.peer.verify.verifier import round_committed
from shoal.peer.verify.withholding import DirectRecords
from shoal.transport import rpc
from shoal.transport.host import Host
from shoal.transport.identity import Identity
from shoal.verification.referees import RoundDraw, new_secret

pytestmark = pytest.mark.timeout(60)
ROUND = 7
NS = "exp"
START = h("global")  # (the global state `commit` says its rounds started from)


@pytest.fixture
async def nodes(make_host: Callable[..., Any]) -> AsyncIterator[list[DHTNode]]:
    made: list[DHTNode] = []
    for _ in range(4):
        host: Host = await make_host()
        boot = [str(made[0].host.addresses()[0])] if made else []
        made.append(await DHTNode.create(host, bootstrap=boot, hop_timeout=1.0))
    yield made
    await asyncio.gather(*(n.aclose() for n in made), return_exceptions=True)


async def test_members_gather_the_same_secrets_and_draw_the_same(nodes: list[DHTNode]) -> None:
    secrets = {n.peer_id: new_secret() for n in nodes}
    mine = {n.peer_id: commit(n.host.identity, secrets[n.peer_id], rnd=ROUND) for n in nodes}
    await asyncio.gather(
        *(publish_record(n, NS, mine[n.peer_id], secrets[n.peer_id]) for n in nodes)
    )
    members = [n.peer_id for n in nodes]
    views = await asyncio.gather(
        *(
            gather(n, NS, ROUND, {n.peer_id: mine[n.peer_id]}, members, 10.0, start=START)
            for n in nodes
        )
    )
    for commitments, found in views:
        assert commitments == mine and found == secrets
    draws = {RoundDraw.from_reveals(list(c.values()), s).seed for c, s in views}
    assert len(draws) == 1


async def test_a_member_without_a_commitment_is_waited_for_briefly_one_with_one_fully(
    nodes: list[DHTNode], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(audit_round, "UNKNOWN_GRACE_S", 1.0)
    a, b, _idle, silent = nodes  # _idle never publishes
    secrets = {n.peer_id: new_secret() for n in nodes}
    mine = {n.peer_id: commit(n.host.identity, secrets[n.peer_id], rnd=ROUND) for n in nodes}
    for n in (a, b):
        await publish_record(n, NS, mine[n.peer_id], secrets[n.peer_id])
    members = [n.peer_id for n in nodes]

    # `idle` contributed nothing (weight 0) and `silent` withholds: with no commitment
    # of either known, the gather ends after the grace, not the deadline.
    started = time.monotonic()
    commitments, found = await gather(
        a, NS, ROUND, {}, members, 20.0, {a.peer_id: secrets[a.peer_id]}, start=START
    )
    assert 1.0 <= time.monotonic() - started < 10.0
    assert set(found) == set(commitments) == {a.peer_id, b.peer_id}

    # `silent`'s commitment came with its contribution: it is waited for to the end,
    # and the draw then names it as withholding.
    started = time.monotonic()
    commitments, found = await gather(a, NS, ROUND, {silent.peer_id: mine[silent.peer_id]},
                                      members, 3.0, start=START)  # fmt: skip
    assert time.monotonic() - started >= 3.0
    draw = RoundDraw.from_reveals(list(commitments.values()), found)
    assert draw.withheld == frozenset({silent.peer_id})


async def test_a_second_commitment_of_a_member_for_the_round_is_not_taken(
    nodes: list[DHTNode],
) -> None:
    a, b = nodes[:2]
    sent = commit(b.host.identity, new_secret(), rnd=ROUND)  # what came with its bytes
    other_secret = new_secret()
    other = commit(b.host.identity, other_secret, rnd=ROUND, steps=9)
    await publish_record(b, NS, other, other_secret)
    commitments, found = await gather(a, NS, ROUND, {b.peer_id: sent}, [b.peer_id], 1.0,
                                      start=START)  # fmt: skip
    assert commitments[b.peer_id] == sent and b.peer_id not in found


def test_a_round_stays_answerable_for_the_retention_window_however_many_follow() -> None:
    """A prover keeps its rounds as long as its work log keeps their work: with fast
    rounds, a referee's late reveal request (audits queue) must not find "no work of
    round N here" and leave an honest prover out of its rounds (the CI run of
    dbdfc1a: round 2 forgotten 4 s after its commit, 8 rounds later)."""
    now = [0.0]
    rounds: RecentRounds[str] = RecentRounds(keep=4, retain_s=300.0, clock=lambda: now[0])
    for r in range(50):  # a round every 0.6 s
        rounds.add(r, f"round {r}")
        now[0] += 0.6
    assert rounds.get(2) == "round 2" and len(rounds) == 50 and rounds.oldest() == 0
    now[0] = 301.0  # past the window of round 0 (added at 0.0) and of round 1 (0.6)
    rounds.add(50, "round 50")
    assert rounds.get(0) is None and rounds.oldest() == 2 and rounds.get(2) == "round 2"
    now[0] = 10_000.0  # long after: the last `keep` stay however old
    rounds.add(51, "round 51")
    assert [r for r in range(52) if rounds.get(r)] == [48, 49, 50, 51]


def test_a_round_index_committed_twice_keeps_both_rounds_under_their_starts() -> None:
    """A peer that re-synced onto a lineage at a lower commit count commits an index
    again: each round stays answerable under the state it started from (its referees
    asked the prover about the first and were answered from the second, or not at
    all), and the last rounds kept are the last added, not the highest indices."""
    now = [0.0]
    rounds: RecentRounds[str] = RecentRounds(keep=2, retain_s=0.0, clock=lambda: now[0])
    rounds.add(7, "7 of lineage A", tag=b"A")
    rounds.add(8, "8 of lineage A", tag=b"A")
    now[0] = 1.0
    rounds.add(7, "7 of lineage B", tag=b"B")  # re-synced: B's commit count was lower
    assert rounds.get(7, b"A") is None  # (past its window, and not among the last 2)
    assert rounds.get(7, b"B") == "7 of lineage B" and rounds.get(8, b"A") == "8 of lineage A"
    rounds = RecentRounds(keep=4, retain_s=300.0, clock=lambda: now[0])
    rounds.add(7, "7 of A", tag=b"A")
    rounds.add(7, "7 of B", tag=b"B")
    assert rounds.of_round(7) == ["7 of A", "7 of B"] and rounds.get(7) == "7 of B"
    assert rounds.get(7, b"A") == "7 of A" and len(rounds) == 2
    rounds.add(7, "7 of A, re-run", tag=b"A")  # (the same start: a replacement)
    assert rounds.of_round(7) == ["7 of B", "7 of A, re-run"] and len(rounds) == 2


async def test_a_reveal_or_verdict_is_answered_from_the_round_its_commitment_is_of() -> None:
    """The prover (or a referee) holding two rounds of one index picks the round in
    which the member committed to the digest asked about; with no digest (a 2.3
    referee), the last round of the index; a digest of neither round finds none."""
    me = Identity.generate()
    first = commit(me, b"s" * 32, rnd=ROUND, start=h("lineage A"))
    second = commit(me, b"t" * 32, rnd=ROUND, start=h("lineage B"))
    rounds: RecentRounds[asyncio.Future[Any]] = RecentRounds(keep=4, retain_s=300.0)
    made = {}
    for c in (first, second):
        future = asyncio.get_running_loop().create_future()
        made[c.start] = SimpleNamespace(commitments={me.peer_id: c})
        future.set_result(made[c.start])
        rounds.add(ROUND, future, tag=c.start)
    found = await round_committed(rounds, ROUND, me.peer_id, first.digest())
    assert found is made[first.start]
    assert await round_committed(rounds, ROUND, me.peer_id, second.digest()) is made[second.start]
    assert await round_committed(rounds, ROUND, me.peer_id, None) is made[second.start]
    assert await round_committed(rounds, ROUND, me.peer_id, h("neither")) is None
    assert await round_committed(rounds, ROUND + 1, me.peer_id, None) is None


async def test_records_the_dht_lacks_are_asked_of_their_members_directly(
    nodes: list[DHTNode],
) -> None:
    """Members cut off from the DHT together (an island) still draw with every secret:
    what the first read lacks is asked of its member over the round's connection,
    taken only from the member it belongs to, and served only once published."""
    a, b, c, late = nodes
    secrets = {n.peer_id: new_secret() for n in nodes}
    mine = {n.peer_id: commit(n.host.identity, secrets[n.peer_id], rnd=ROUND) for n in nodes}
    served = {
        n.peer_id: DirectRecords(rpc.RpcService(n.host, "/shoal/test-records/1")) for n in nodes
    }
    for n in (b, c):  # published, but not in the DHT
        served[n.peer_id].publish(ROUND, START, encode_record(mine[n.peer_id], secrets[n.peer_id]))
    # c answers for the next round with b's record as if it were its own
    b_next = commit(b.host.identity, secrets[b.peer_id], rnd=ROUND + 1)
    served[c.peer_id].publish(ROUND + 1, START, encode_record(b_next, secrets[b.peer_id]))
    for n in (b, c, late):
        await a.host.connect(n.host.addresses()[0])
    members = [n.peer_id for n in nodes]
    known = {p: mine[p] for p in members}  # every member contributed (the all-reduce)

    started = time.monotonic()
    commitments, found = await gather(
        a, NS, ROUND, known, members, 2.0, {a.peer_id: secrets[a.peer_id]},
        ask=lambda peers: served[a.peer_id].ask(ROUND, START, peers), start=START,
    )  # fmt: skip
    assert found == {p: secrets[p] for p in (a.peer_id, b.peer_id, c.peer_id)}
    assert commitments == known
    assert time.monotonic() - started >= 2.0  # `late` had not published: waited for
    assert served[a.peer_id].found == 2 and served[b.peer_id].served == 1

    _, found = await gather(
        a, NS, ROUND + 1, {}, [b.peer_id, c.peer_id], 0.5,
        ask=lambda peers: served[a.peer_id].ask(ROUND + 1, START, peers), start=START,
    )  # fmt: skip
    assert found == {}  # c's answer is b's record: not taken from c


async def test_a_members_rounds_of_one_index_in_two_lineages_are_both_found(
    nodes: list[DHTNode],
) -> None:
    """b was in round 7 of one lineage, re-synced onto another at a lower count and
    committed its round 7 too. Both records stay found, each by the members of its
    round: under the round index alone the second replaced the first, and the first
    round's members saw b withhold its secret (the soak: an honest peer shunned)."""
    a, b = nodes[:2]
    first_secret, second_secret = new_secret(), new_secret()
    first = commit(b.host.identity, first_secret, rnd=ROUND)
    second = commit(b.host.identity, second_secret, rnd=ROUND, start=h("another lineage"))
    served = DirectRecords(rpc.RpcService(b.host, "/shoal/test-records/1"))
    asker = DirectRecords(rpc.RpcService(a.host, "/shoal/test-records/1"))
    for c, secret in ((first, first_secret), (second, second_secret)):
        assert await publish_record(b, NS, c, secret)
        served.publish(ROUND, c.start, encode_record(c, secret))
    for c, secret in ((first, first_secret), (second, second_secret)):
        _, found = await gather(a, NS, ROUND, {b.peer_id: c}, [b.peer_id], 5.0, start=c.start)
        assert found == {b.peer_id: secret}
        (answer,) = await asker.ask(ROUND, c.start, [b.peer_id])
        assert answer[1] == encode_record(c, secret)
