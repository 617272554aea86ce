"""A trainer's flush (`TrainerLoop._flush_if_stuck`) asks a stage to step with what it
holds from one version: it is for that version only.

A trainer asks after 3 s with nothing in flight. Under load a stage's all-reduce
alone can take that long: the flush then arrives while the stage steps, and used to
outlive the step, so the next version stepped on its first microbatch (a step of
half the global batch, the rest replayed into a later step: a CI failure)."""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import pytest

from shoal.peer.training.tasks.bytegpt import make_task
from shoal.pipeline.stage_peer import StagePeer
from shoal.transport.identity import PeerID

from .pipeline_swarm import EXPERIMENT, TINY, Swarm

GLOBAL_BATCH = 8


async def lone_stage_peer(swarm: Swarm, held: dict[int, int]) -> tuple[StagePeer, list[int]]:
    """One stage peer whose `tick` we drive (not started): it holds `held[version]`
    samples, and its steps are recorded, not taken."""
    (module,) = make_task(TINY).make_stages(0, 1)
    peer = StagePeer(await swarm.node(), EXPERIMENT, 0, module, hyper={"lr": 1e-3},
                     global_batch=GLOBAL_BATCH)  # fmt: skip
    peer.worker.samples_for = lambda version: held.get(version, 0)  # type: ignore[method-assign]
    stepped_from: list[int] = []

    async def record_step(partners: Collection[PeerID] = ()) -> None:
        stepped_from.append(peer.version)

    peer.step = record_step  # type: ignore[method-assign]
    return peer, stepped_from


@pytest.mark.timeout(30)
async def test_a_flush_makes_the_stage_step_with_part_of_its_batch(
    make_host: Callable[..., Any],
) -> None:
    swarm = Swarm(make_host)
    try:
        peer, stepped_from = await lone_stage_peer(swarm, {0: 4})
        await peer.tick()
        assert stepped_from == []  # 4 of 8: not yet
        assert peer.server.on_flush is not None and peer.server.on_flush(0)
        await peer.tick()
        assert stepped_from == [0]
        await peer.tick()  # (once: the flush was used)
        assert stepped_from == [0]
    finally:
        await swarm.aclose()


@pytest.mark.timeout(30)
async def test_a_flush_during_the_step_is_refused(make_host: Callable[..., Any]) -> None:
    swarm = Swarm(make_host)
    try:
        peer, stepped_from = await lone_stage_peer(swarm, {0: 4})
        peer.optimizer.stepping = True  # (the round under way, a slow one)
        assert peer.server.on_flush is not None and not peer.server.on_flush(0)
        peer.optimizer.stepping = False
        await peer.tick()
        assert stepped_from == []
    finally:
        await swarm.aclose()


@pytest.mark.timeout(30)
async def test_a_flush_for_a_version_the_stage_left_does_not_step_the_next_one(
    make_host: Callable[..., Any],
) -> None:
    swarm = Swarm(make_host)
    try:
        peer, stepped_from = await lone_stage_peer(swarm, {0: 8, 1: 4})
        assert peer.server.on_flush is not None and peer.server.on_flush(0)
        peer.optimizer.averager.commits = 1  # the stage stepped from 0 before the tick
        await peer.tick()
        assert stepped_from == []  # 4 of version 1's 8: the flush was for version 0
    finally:
        await swarm.aclose()
