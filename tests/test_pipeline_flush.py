"""A trainer's flush (`TrainerLoop._flush_if_stuck`) asks a stage to step with what it
holds from one version: it is for that version only.

A trainer asks after 3 s with nothing in flight. Under load a stage's all-reduce
alone can take that long: the flush then arrives while the stage steps, and used to
outlive the step, so the next version stepped on its first microbatch (a step of
half the global batch, the rest replayed into a later step: a CI failure)."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Collection
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from shoal.peer.training.tasks.bytegpt import make_task
from shoal.pipeline import trainer_loop
from shoal.pipeline.stage_peer import StagePeer
from shoal.pipeline.trainer_loop import TrainerLoop
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


class _NeverSteppingTrainer:
    """What a `TrainerLoop` reads of a trainer, for one stage that never steps: what is
    sent completes at once (nothing stays in flight), and a flush changes nothing."""

    stages = 1

    def __init__(self) -> None:
        self.versions = [0]
        self.counters = SimpleNamespace(samples=0)
        self.changed = asyncio.Event()
        self.flushes = 0

    def stepped(self, stage: int, since: int, typical: int) -> int:
        return 0

    async def refresh(self) -> None:
        pass

    async def flush(self, stage: int) -> int:
        self.flushes += 1
        return 2  # (two live peers agreed, and held nothing to step on)


async def test_a_stage_that_never_steps_gets_one_microbatch_per_two_fruitless_flushes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The live peers hold nothing of the version the trainer waits for: a microbatch
    beyond the pace after the second flush that changed nothing, another after every
    second one since (the first may have gone to the dying peer, still serving), and
    never a global batch beyond the pace."""
    monkeypatch.setattr(trainer_loop, "FLUSH_AFTER_S", 0.0)
    monkeypatch.setattr(trainer_loop, "PACED_POLL_S", 0.001)
    trainer = _NeverSteppingTrainer()
    microbatch = 2
    batches = itertools.repeat(torch.zeros(microbatch, 4))
    loop = TrainerLoop(trainer, batches, inputs_of=lambda b: b, loss_of=lambda y, b: y,  # type: ignore[arg-type]
                       global_batch=GLOBAL_BATCH, lag=0)  # fmt: skip
    loop.base = loop._peak = 0
    flushes_before: list[int] = []
    for _ in range(2 * GLOBAL_BATCH // microbatch):
        async with asyncio.timeout(5.0):
            mb = await loop._next(asyncio.Event(), None)
        assert mb is not None
        trainer.counters.samples += mb.samples  # (completed at once)
        flushes_before.append(trainer.flushes)
    paced, beyond = flushes_before[: GLOBAL_BATCH // microbatch], flushes_before[4:]
    assert paced == [0] * len(paced)  # the pace's global batch: no flush
    assert beyond == [2, 4, 6, 8]  # then one microbatch per two fruitless flushes
    # A global batch beyond the pace: the trainer waits, flushing.
    trainer.flushes = 0
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.5):
            await loop._next(asyncio.Event(), None)
    assert trainer.flushes > 2
