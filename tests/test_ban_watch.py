"""Enforcing convictions (peer/verify/ban_watch.py): a conviction published in the
DHT is checked and enforced by every peer within one refresh, the convicted
peer learns it, and a forged one changes nothing."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

import pytest
from verification_round import EXPERIMENT, Round, conviction
from waiting import eventually

from shoal.dht.node import DHTNode
from shoal.peer.verify.ban_watch import BanWatcher
from shoal.transport.errors import PeerBlocked
from shoal.transport.host import Host
from shoal.verification.bans import publish

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def swarm(make_host: Callable[..., Any]) -> AsyncIterator[list[DHTNode]]:
    nodes: list[DHTNode] = []
    for _ in range(5):
        host: Host = await make_host()
        boot = [str(nodes[0].host.addresses()[0])] if nodes else []
        nodes.append(await DHTNode.create(host, bootstrap=boot, hop_timeout=1.0))
    yield nodes
    await asyncio.gather(*(n.aclose() for n in nodes), return_exceptions=True)


async def test_every_peer_refuses_a_convicted_peer_within_one_refresh(
    swarm: list[DHTNode],
) -> None:
    *honest, cheater = swarm
    r = Round(0, rnd=3, also=tuple(n.host.identity for n in swarm))
    evidence = conviction(r, cheater.peer_id)
    # Everyone talks to the cheater before the conviction.
    for node in honest:
        await node.host.connect(cheater.peer_id, cheater.host.addresses())
    watchers = [BanWatcher(n, EXPERIMENT, interval=0.1) for n in swarm]
    tasks = [asyncio.create_task(w.run()) for w in watchers]
    try:
        assert await publish(honest[0], evidence)
        await eventually(
            lambda: all(cheater.peer_id in n.host.blocked() for n in honest),
            "every honest peer blocked the cheater",
            timeout=10,
        )
        await eventually(
            lambda: all(cheater.peer_id not in n.host.connections for n in honest),
            "every connection to the cheater closed",
        )
        await eventually(lambda: watchers[-1].convicted_self, "the cheater learned it")
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    for watcher in watchers[:-1]:
        status = watcher.status()
        assert status["banned"] == [str(cheater.peer_id)] and not status["convicted_self"]
        (record,) = status["convictions"]
        assert record["round"] == 3 and len(record["accusers"]) == 2
    with pytest.raises(PeerBlocked):
        await honest[1].host.connect(cheater.peer_id, cheater.host.addresses())
    assert cheater.host.blocked() == {}  # the convicted peer blocks nobody itself


async def test_a_forged_conviction_bans_nobody(swarm: list[DHTNode]) -> None:
    r = Round(0, rnd=3, also=tuple(n.host.identity for n in swarm))
    victim = swarm[1]
    real = conviction(r, victim.peer_id)
    forged = replace(real, verdicts=real.verdicts[:1])  # one accuser is no conviction
    assert await publish(swarm[4], forged)
    watcher = BanWatcher(swarm[2], EXPERIMENT)
    assert await watcher.refresh() == []
    assert watcher.status()["banned"] == [] and watcher.status()["rejected_evidence"] == 1
    assert swarm[2].host.blocked() == {}
