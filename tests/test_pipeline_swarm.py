"""A pipelined swarm in one process: stage peers step together, trainers pace and replay."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from shoal.peer.training.tasks.bytegpt import make_task

from .pipeline_swarm import TINY, Swarm, loop_for
from .waiting import eventually


def single_process(
    task: Any, stages: list[torch.nn.Module], steps: int, per_step: int
) -> list[float]:
    """The same model, data order, global batch and AdamW in one process."""
    params = [p for s in stages for p in s.parameters()]
    opt = torch.optim.AdamW(params, lr=3e-3, weight_decay=0.0, betas=(0.9, 0.999))
    batches = task.batches(0, 1, 0)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        for _ in range(per_step):
            batch = next(batches)
            y = task.stage_inputs(batch)
            for s in stages:
                y = s(y)
            loss = task.stage_loss(y, batch)
            (loss / per_step).backward()
            losses.append(float(loss.detach()))
        opt.step()
    return losses


@pytest.mark.slow
@pytest.mark.timeout(400)
async def test_a_three_stage_swarm_trains_like_one_process(make_host: Callable[..., Any]) -> None:
    """3 stages x 2 peers, one trainer, no compression, 150 steps: the last steps' loss is
    within 2% of one process's; every stage's peers hold equal parameters; every
    step took exactly the global batch."""
    task = make_task(TINY)
    steps, per_step, global_batch = 150, 2, 8
    stages = task.make_stages(7, 3)
    reference = single_process(task, [s for s in task.make_stages(7, 3)], steps, per_step)
    swarm = Swarm(make_host)
    try:
        for s, module in enumerate(stages):
            for _ in range(2):
                await swarm.stage_peer(s, module, global_batch=global_batch)
        trainer = await swarm.trainer(3, codec="none")
        loop = loop_for(trainer, task, shard=0, global_batch=global_batch, lag=0)
        losses: list[float] = []
        loop.on_microbatch = lambda mb: losses.append(mb.loss)
        started = time.monotonic()
        await loop.run(steps=steps)
        print(f"{steps} steps in {time.monotonic() - started:.1f}s")
        tail = sum(losses[-40:]) / 40
        tail_ref = sum(reference[-40:]) / 40
        assert reference[-1] < reference[0] - 1.0
        assert tail == pytest.approx(tail_ref, rel=0.02)

        def last_step_applied() -> bool:
            # The trainer counts a stage's step once one of its peers reports it, and a
            # peer's version counts a step before the step is applied (in a thread) and
            # its state frozen: wait for every peer's frozen state of the last step.
            return all(p.optimizer.averager.last_fingerprint_commits == steps for p in swarm.peers)

        await eventually(last_step_applied, f"every stage peer applied step {steps}", 30.0)
        for s in range(3):
            peers = swarm.of_stage(s)
            assert len({p.optimizer.fingerprint() for p in peers}) == 1
            done = {v: n for p in peers for v, n in p.optimizer.step_samples.items()}
            assert done == dict.fromkeys(range(steps), global_batch)
        assert trainer.counters.samples == steps * global_batch
    finally:
        await swarm.aclose()


def kill(host: Any) -> None:
    """Tear a host down at once, as the kernel closes a killed process' sockets."""
    host._closing = True
    for server in host._servers:
        server.close()
    for conn in list(host._all):
        conn.abort("killed")


class Killed(Exception):
    pass


def assert_every_sample_in_one_step(survivors: list[Any], trainer: Any) -> None:
    """Every sample the trainer completed is in exactly one of the survivors' steps, or
    held by one of them for the step to come."""
    steps: dict[int, int] = {}
    for p in survivors:
        steps.update(p.optimizer.step_samples)
    pending = sum(p.worker.samples_for(p.version) for p in survivors)
    assert sum(steps.values()) + pending == trainer.counters.samples


@pytest.mark.timeout(120)
async def test_a_stage_peer_killed_in_the_stage_all_reduce_does_not_stop_the_step(
    make_host: Callable[..., Any],
) -> None:
    """Three peers serve one stage; one dies in the middle of the stage's third step
    (it holds its averaged part, has not voted): the other two commit that step without
    it, every step
    leaves the stage's live peers with the same parameters, and every sample the
    trainer completed is in exactly one step (the victim's are replayed)."""
    task = make_task(TINY)
    (module,) = task.make_stages(3, 1)
    swarm = Swarm(make_host)
    try:
        peers = [await swarm.stage_peer(0, module, global_batch=8) for _ in range(3)]
        victim, survivors = peers[0], peers[1:]
        prints: dict[int, set[str]] = {}
        for peer in survivors:

            def record(result: Any, peer: Any = peer) -> None:
                prints.setdefault(peer.version, set()).add(peer.optimizer.fingerprint())

            peer.on_step = record

        async def die_in_third_step(point: str) -> None:
            if point == "before_ready" and victim.version == 2:
                kill(victim.server.dht.host)
                raise Killed(point)

        victim.optimizer.averager.config.allreduce.fault_hook = die_in_third_step
        trainer = await swarm.trainer(1, codec="none")
        loop = loop_for(trainer, task, shard=0, global_batch=8, lag=0, concurrency=4)
        await loop.run(steps=8)
        await trainer.settled()
        assert victim.version == 2  # it died in its third step
        assert all(p.version >= 8 for p in survivors)
        assert 3 in prints and all(len(fps) == 1 for fps in prints.values()), prints
        assert_every_sample_in_one_step(survivors, trainer)
    finally:
        await swarm.aclose()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("slow_step", [False, True], ids=["dies-at-once", "dies-slowly"])
async def test_a_stage_peer_that_dies_holding_the_whole_batch_does_not_stop_the_stage(
    make_host: Callable[..., Any], slow_step: bool
) -> None:
    """Three peers serve one stage; only one takes the trainer's requests for the first
    step, and it dies in that step's all-reduce holding the whole global batch: the two
    others hold nothing to step on, and a flush alone cannot make them step. The
    trainer's loop then sends one microbatch beyond its pace; the two step on it
    without the dead peer, whose microbatches are then replayed: every sample the
    trainer completed is in exactly one step.

    Slowly: the victim's step is slow enough (a loaded machine: a CI hang) that the
    microbatch beyond the pace goes to the victim too, and dies with it; the loop
    sends one more, for the two."""
    task = make_task(TINY)
    (module,) = task.make_stages(3, 1)
    swarm = Swarm(make_host)
    try:
        peers = [await swarm.stage_peer(0, module, global_batch=8) for _ in range(3)]
        victim, survivors = peers[0], peers[1:]
        prints: dict[int, set[str]] = {}
        for peer in survivors:  # (not ready: the trainer sends the first batch to the victim)
            peer.server.serving = False
            await peer.server.announce()

            def record(result: Any, peer: Any = peer) -> None:
                prints.setdefault(peer.version, set()).add(peer.optimizer.fingerprint())

            peer.on_step = record

        async def die_holding_the_batch(point: str) -> None:
            if point == "before_ready" and victim.version == 0:
                if slow_step:  # (still in the step when the microbatch beyond the pace comes)
                    took = victim.server.served["backward"]
                    await eventually(
                        lambda: victim.server.served["backward"] > took,
                        "the victim took the microbatch beyond the pace",
                        60.0,
                    )
                for peer in survivors:
                    peer.server.serving = True
                    await peer.server.announce()
                kill(victim.server.dht.host)
                raise Killed(point)

        victim.optimizer.averager.config.allreduce.fault_hook = die_holding_the_batch
        trainer = await swarm.trainer(1, codec="none")
        loop = loop_for(trainer, task, shard=0, global_batch=8, lag=0, concurrency=4)
        await loop.run(steps=3)
        await trainer.settled()
        assert victim.version == 0 and victim.server.served["backward"] >= 1
        assert all(p.version >= 3 for p in survivors)
        # (Compared as each step left them: read now, one may be in its next step.)
        assert prints and all(len(fps) == 1 for fps in prints.values()), prints
        assert_every_sample_in_one_step(survivors, trainer)
        assert trainer.ledger.replayed[0] >= 8  # (the victim held the whole batch)
    finally:
        await swarm.aclose()
