"""A stage that loses every peer holding its state: the swarm trains on.

When every peer of a stage dies, its parameters are gone; a peer that moves into
the stage afterwards finds no one to download them from and starts from its own
(at version 0). Training must go on from there: the trainers stop asking for the
dead peers' version (their records stay in the DHT until the TTL) and re-base
their pacing on the stage's new version, instead of waiting forever for a step
from the version only the dead reached.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from shoal.peer.training.tasks.bytegpt import make_task

from .pipeline_swarm import TINY, Swarm, loop_for
from .test_pipeline_swarm import kill
from .waiting import eventually


@pytest.mark.timeout(90)
async def test_a_stage_that_lost_all_its_peers_trains_on_from_a_newcomers_state(
    make_host: Callable[..., Any],
) -> None:
    task = make_task(TINY)
    stages = task.make_stages(3, 2)
    gb = 8
    swarm = Swarm(make_host)
    stop = asyncio.Event()
    try:
        await swarm.stage_peer(0, stages[0], global_batch=gb)
        lost = [await swarm.stage_peer(1, stages[1], global_batch=gb) for _ in range(2)]
        trainer = await swarm.trainer(2, codec="none")
        loop = loop_for(trainer, task, shard=0, global_batch=gb, lag=0, concurrency=4)
        running = asyncio.ensure_future(loop.run(stop))
        await eventually(lambda: loop.steps >= 3, "3 steps", 40)
        assert all(p.version >= 3 for p in lost)

        for peer in lost:  # both die: stage 1's state is gone with them
            kill(peer.server.dht.host)
            assert peer._task is not None
            peer._task.cancel()
        newcomer = await swarm.stage_peer(1, stages[1], global_batch=gb, sync=True)
        assert newcomer.version == 0  # nobody left to download the stage from

        before = loop.steps
        await eventually(lambda: newcomer.version >= 3, "3 steps of the newcomer", 40)
        await eventually(lambda: loop.steps >= before + 3, "the loop counts them", 10)
        assert not running.done()
    finally:
        stop.set()
        await swarm.aclose()
