"""A member that withholds its round secret, or a prover that does not reveal, is
left out of our rounds for a while: nothing tells it from an honest peer that
crashed, restarted or sat behind a partition, so the first time costs it 30 s
and only a repeat offender climbs to 10 minutes (peer/verify/shunning.py). Before
anyone is shunned, its missing secret is looked for once more, and a member
stores its own record again while it still misses others' (peer/verify/withholding.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from verification_round import commit, h, identities

from shoal.dht.node import DHTNode
from shoal.dht.storage import LocalStorage
from shoal.peer.verify.audit_round import gather, publish_record
from shoal.peer.verify.shunning import FIRST_SHUN_S, MAX_SHUN_S, STRIKE_DECAY_S, Shunning
from shoal.peer.verify.withholding import publish_while_gathering, recheck_withheld
from shoal.transport.identity import PeerID
from shoal.verification.referees import new_secret

ROUND = 7
NS = "exp"
START = h("global")  # (the global state `commit` says its rounds started from)


def test_a_first_failure_costs_a_short_shun_and_each_further_one_doubles_it() -> None:
    (peer,) = (i.peer_id for i in identities(1, "shun"))
    shunning = Shunning()
    shuns = [shunning.offend(peer, r, now=float(r)) for r in range(1, 8)]
    assert shuns == [FIRST_SHUN_S, 60.0, 120.0, 240.0, 480.0, MAX_SHUN_S, MAX_SHUN_S]
    assert shunning.shuns == 7


def test_one_round_is_one_offence_however_many_ways_it_failed() -> None:
    """A member that restarted both withholds its secret and cannot reveal."""
    (peer,) = (i.peer_id for i in identities(1, "once"))
    shunning = Shunning()
    assert shunning.offend(peer, ROUND, now=0.0) == FIRST_SHUN_S
    assert shunning.offend(peer, ROUND, now=5.0) is None
    assert shunning.offend(peer, ROUND + 1, now=10.0) == 60.0


def test_peers_are_counted_apart() -> None:
    a, b = (i.peer_id for i in identities(2, "apart"))
    shunning = Shunning()
    assert shunning.offend(a, 1, now=0.0) == FIRST_SHUN_S
    assert shunning.offend(a, 2, now=1.0) == 60.0
    assert shunning.offend(b, 2, now=1.0) == FIRST_SHUN_S


def test_an_honest_peer_failing_a_round_now_and_then_stays_at_the_first_shun() -> None:
    """One failure each half hour (a restart, say) is forgiven before the next."""
    (peer,) = (i.peer_id for i in identities(1, "honest"))
    shunning = Shunning()
    shuns = [shunning.offend(peer, r, now=r * STRIKE_DECAY_S) for r in range(10)]
    assert shuns == [FIRST_SHUN_S] * 10
    assert shunning.strikes(peer, now=10 * STRIKE_DECAY_S) == 0.0


def test_a_peer_that_withholds_whenever_it_is_let_back_in_stays_out_the_longest() -> None:
    """Offending again the moment each shun ends: the shuns climb to the longest
    and stay there (one strike decays per half hour, more than a shun lasts)."""
    (peer,) = (i.peer_id for i in identities(1, "cheat"))
    shunning = Shunning()
    now, shuns = 0.0, []
    for r in range(30):
        seconds = shunning.offend(peer, r, now)
        assert seconds is not None
        shuns.append(seconds)
        now += seconds
    assert shuns[:6] == [FIRST_SHUN_S, 60.0, 120.0, 240.0, 480.0, MAX_SHUN_S]
    assert set(shuns[5:]) == {MAX_SHUN_S}
    # Out for all but one round every ten minutes, as the flat rule had it.
    assert now > 4 * 3600


@pytest.fixture
async def nodes(make_host: Callable[..., Any]) -> AsyncIterator[list[DHTNode]]:
    made: list[DHTNode] = []
    for _ in range(3):
        host = await make_host()
        boot = [str(made[0].host.addresses()[0])] if made else []
        made.append(await DHTNode.create(host, bootstrap=boot, hop_timeout=1.0))
    yield made
    await asyncio.gather(*(n.aclose() for n in made), return_exceptions=True)


@pytest.mark.timeout(60)
async def test_a_member_whose_secret_comes_late_is_not_shunned_one_that_never_does_is(
    nodes: list[DHTNode],
) -> None:
    me, slow, silent = nodes
    secrets = {n.peer_id: new_secret() for n in nodes}
    mine = {n.peer_id: commit(n.host.identity, secrets[n.peer_id], rnd=ROUND) for n in nodes}
    await publish_record(me, NS, mine[me.peer_id], secrets[me.peer_id])
    members = [n.peer_id for n in nodes]
    commitments, found = await gather(
        me, NS, ROUND, mine, members, 1.0, {me.peer_id: secrets[me.peer_id]}, start=START
    )
    missing = frozenset(commitments.keys() - found.keys())
    assert missing == {slow.peer_id, silent.peer_id}

    shunning = Shunning()
    shunned: dict[PeerID, float | None] = {}

    def shun(peer: PeerID, round_index: int) -> float | None:
        shunned[peer] = shunning.offend(peer, round_index, now=0.0)
        return shunned[peer]

    recheck = asyncio.ensure_future(
        recheck_withheld(me, NS, (ROUND, START), commitments, missing, shun, after=0.5, timeout=3.0)
    )
    # `slow`'s record lands between our gather and the recheck (a partition healed).
    assert await publish_record(slow, NS, mine[slow.peer_id], secrets[slow.peer_id])
    late = await recheck
    assert late == {slow.peer_id: secrets[slow.peer_id]}
    assert shunned == {silent.peer_id: FIRST_SHUN_S}


@pytest.mark.timeout(60)
async def test_a_member_stores_its_record_again_while_it_still_gathers(
    nodes: list[DHTNode],
) -> None:
    """The nodes that held our record lost it (they restarted, or a partition kept
    it on our side): the next store, made while we still wait for others' records,
    lets the others find it."""
    me, other, _ = nodes
    secret = new_secret()
    record = commit(me.host.identity, secret, rnd=ROUND)
    gathered = asyncio.Event()
    stores = asyncio.ensure_future(
        publish_while_gathering(me, NS, record, secret, gathered, every=0.3, within=20.0)
    )
    try:
        _, found = await gather(other, NS, ROUND, {}, [me.peer_id], 5.0, start=START)
        assert found == {me.peer_id: secret}  # the first store
        for node in nodes:  # every replica lost
            node.storage = LocalStorage(validator=node.validator)
        _, found = await gather(
            other, NS, ROUND, {me.peer_id: record}, [me.peer_id], 10.0, start=START
        )
        assert found == {me.peer_id: secret}
    finally:
        gathered.set()
    assert await asyncio.wait_for(stores, 5.0) >= 2


@pytest.mark.timeout(30)
async def test_a_member_that_gathered_everything_stores_its_record_once(
    nodes: list[DHTNode],
) -> None:
    me = nodes[0]
    secret = new_secret()
    gathered = asyncio.Event()
    gathered.set()
    record = commit(me.host.identity, secret, rnd=ROUND)
    stores = await publish_while_gathering(me, NS, record, secret, gathered, every=0.1, within=5.0)
    assert stores == 1
