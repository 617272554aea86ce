"""The work of a shared state's lineage (averaging/lineage.py): members summed over
its commits, carried with the state, and what decides between two versions that
went their own ways when as many peers hold each."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import torch

from shoal.averaging.averager import Averager, AveragerConfig
from shoal.averaging.lineage import commits_of, lineage_work
from shoal.averaging.matchmaking import MatchmakingConfig
from shoal.dht.node import DHTNode

KEY = "lineage/params"


def test_a_lineage_is_worth_at_least_its_commits_and_no_holder_raises_it() -> None:
    version = (7).to_bytes(8, "big") + b"chainhsh"
    assert commits_of(version) == 7 and commits_of(b"") == 0
    assert lineage_work(version, []) == 7  # nobody says: one member per commit
    assert lineage_work(version, [None, 30]) == 30
    assert lineage_work(version, [30, 1000]) == 30  # the least any holder says
    assert lineage_work(version, [3]) == 7  # below its commits: not believed


@pytest.fixture
async def closing() -> AsyncIterator[list[Any]]:
    things: list[Any] = []
    yield things
    for a in reversed(things):
        await a.aclose()


async def swarm_of(make_host: Callable[..., Any], n: int, closing: list[Any]) -> list[Averager]:
    dhts: list[DHTNode] = []
    for _ in range(n):
        host = await make_host(max_connections_per_ip=10_000)
        boot = [str(dhts[0].host.addresses()[0])] if dhts else []
        dhts.append(await DHTNode.create(host, bootstrap=boot, hop_timeout=1.0))
    closing.extend(dhts)
    mm = MatchmakingConfig(min_group_size=2, target_group_size=n, matchmaking_time=1.0,
                           give_up_alone_after=0.5)  # fmt: skip
    config = AveragerConfig(matchmaking=mm, shared_state=True)
    averagers = [
        Averager(d, KEY, [torch.full((64,), float(i + 1))], config=config)
        for i, d in enumerate(dhts)
    ]
    closing.extend(averagers)
    return averagers


@pytest.mark.timeout(60)
async def test_a_peer_back_from_stepping_alone_resyncs_onto_the_swarm_not_the_reverse(
    make_host: Callable[..., Any], closing: list[Any]
) -> None:
    """Four peers commit a round (work 4); three go on with two rounds of three (work
    10, 3 commits). The fourth comes back from six steps alone (work 10 - 1, 6 commits:
    more commits, less work). When it and one of the three look at once (one holder
    each), it re-syncs to the swarm's state, with its work; the swarm's peer keeps its
    version (ordered by commits, the swarm's peer re-synced onto the lone state)."""
    *swarm, lone = await swarm_of(make_host, 4, closing)
    results = await asyncio.gather(*(a.step(timeout=20.0) for a in [*swarm, lone]))
    assert all(r.committed and r.group_size == 4 for r in results), results
    assert {a.work for a in [*swarm, lone]} == {4}
    for _ in range(2):
        results = await asyncio.gather(*(a.step(timeout=20.0) for a in swarm))
        assert all(r.committed and r.group_size == 3 for r in results), results
    assert {(a.commits, a.work) for a in swarm} == {(3, 10)}

    # The lone peer's six steps alone (as a restart from its checkpoint brings it back).
    lone_version = (7).to_bytes(8, "big") + b"loneline"
    lone.restore(7, lone_version.hex(), 4 + 6 - 1)
    lone.tensors[0].fill_(100.0)
    keeper = swarm[0]
    kept_version = keeper.state_version
    theirs, mine = await asyncio.gather(keeper.step(timeout=6.0), lone.step(timeout=6.0))
    assert mine.resynced and not mine.committed, mine
    assert lone.state_version == kept_version and lone.work == 10
    assert torch.equal(lone.tensors[0], keeper.tensors[0])
    assert not theirs.resynced and keeper.state_version == kept_version


def test_a_checkpoint_restores_the_work_and_an_older_one_counts_its_commits() -> None:
    """(No network: `restore` only sets counters.)"""
    averager = Averager.__new__(Averager)
    version = (5).to_bytes(8, "big") + b"abcdefgh"
    averager.restore(5, version.hex(), 12)
    assert (averager.commits, averager.state_version, averager.work) == (5, version, 12)
    averager.restore(5, version.hex())  # a checkpoint of an older release
    assert averager.work == 5
    for bad in ("12", -1, True):
        with pytest.raises(ValueError, match="work"):
            averager.restore(5, version.hex(), bad)
