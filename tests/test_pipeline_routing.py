"""A trainer's routing among unequal stage peers, and a stage peer killed mid-run, in-process.

Stage peers get an artificial compute speed: their stage module sleeps in its compute
thread for the samples it computes over the peer's speed (`Paced`), so a peer twice as
fast really serves twice the samples per second, and the peers of a stage compute in
parallel. Everything runs on loopback in one process. Throughput against the capacity
bound is a performance figure: bench/pipeline.py measures it; here only a sanity bound.

One test is an expected failure, the pipeline bug its reason names: a stage's fresh
peers are not shared by speed at first (the balancer's prior).
"""

from __future__ import annotations

import asyncio
import copy
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from waiting import eventually

from shoal.peer.training.tasks.bytegpt import make_task
from shoal.pipeline.balancer import BACKWARD_COST
from shoal.pipeline.server import StageServer
from shoal.pipeline.stage import StageWorker
from shoal.pipeline.stage_peer import StagePeer
from shoal.pipeline.trainer import PipelineTrainer

from .pipeline_swarm import EXPERIMENT, TINY, Swarm, loop_for


class Paced(torch.nn.Module):
    """A stage module at an artificial speed: before the real layers it sleeps
    `samples x seconds_per_sample / speed`, times `BACKWARD_COST` when the call builds a
    graph (a backward request: the stage recomputes its forward and backpropagates), the
    cost model of the trainer's balancer. The sleep runs in the stage server's compute
    thread (the GIL released), so the peers of a stage compute in parallel."""

    def __init__(self, inner: torch.nn.Module, seconds_per_sample: float, speed: float) -> None:
        super().__init__()
        self.inner = inner
        self.seconds_per_sample = seconds_per_sample
        self.speed = speed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cost = BACKWARD_COST if torch.is_grad_enabled() else 1.0
        time.sleep(x.shape[0] * cost * self.seconds_per_sample / self.speed)
        return self.inner(x)


def _work(server: StageServer) -> float:
    """The work a stage server did, in the balancer's units (a forward sample costs 1)."""
    return server.served["forward"] + BACKWARD_COST * server.served["backward"]


async def _paced_stage(
    swarm: Swarm, speeds: tuple[float, ...], seconds_per_sample: float, *, warm: bool
) -> list[StageServer]:
    """One stage served by a peer per speed. `warm`: each first serves two microbatches
    alone and announces the speed it measured, as a peer that has been serving does."""
    task = make_task(TINY)
    (module,) = task.make_stages(3, 1)
    batches = task.batches(0, 1, 1)
    servers = []
    for speed in speeds:
        paced = Paced(copy.deepcopy(module), seconds_per_sample, speed)
        server = StageServer(await swarm.node(), EXPERIMENT, 0, StageWorker(paced))
        await server.start()
        servers.append(server)
        if warm:
            alone = PipelineTrainer(swarm.nodes[0], EXPERIMENT, 1, codec="none")
            alone.balancers[0].set_peers([(server.dht.peer_id, None)])
            for mb in range(2):
                batch = next(batches)
                await alone.run(mb, task.stage_inputs(batch),
                                lambda y, b=batch: task.stage_loss(y, b))  # fmt: skip
            await server.announce()
    return servers


async def _shares(
    make_host: Callable[..., Any], speeds: tuple[float, ...], *, warm: bool, skip: int, count: int
) -> tuple[list[float], float]:
    """A trainer loop (12 microbatches in flight) on a paced stage: each peer's share of
    the work served in `count` microbatches after the first `skip`, and the samples/s
    over those as a fraction of the stage's capacity bound (the sum of the speeds)."""
    task = make_task(TINY)
    seconds_per_sample = 0.015  # a forward sample at speed 1 (the real layers add ~1 ms)
    swarm = Swarm(make_host)
    servers: list[StageServer] = []
    try:
        trainer_dht = await swarm.node()
        servers = await _paced_stage(swarm, speeds, seconds_per_sample, warm=warm)
        trainer = PipelineTrainer(trainer_dht, EXPERIMENT, 1, codec="none")
        # Nothing steps here: an unbounded lag lets the loop run ahead freely.
        loop = loop_for(trainer, task, shard=0, global_batch=TINY["batch_size"], lag=10**6,
                        concurrency=12)  # fmt: skip
        stop = asyncio.Event()
        running = asyncio.ensure_future(loop.run(stop))
        try:
            done = trainer.counters
            await eventually(lambda: done.microbatches >= skip, "the warm-up", 30.0)
            before, samples, started = [_work(s) for s in servers], done.samples, time.monotonic()
            await eventually(lambda: done.microbatches >= skip + count, "the run", 60.0)
            after, samples = [_work(s) for s in servers], done.samples - samples
            rate = samples / (time.monotonic() - started)
            balancer = trainer.balancers[0]
            seen = [(balancer.throughput(s.dht.peer_id), s.queued) for s in servers]
            print(f"{done.retries} retries; measured speeds and queues {seen}")
        finally:
            stop.set()
            await running
    finally:
        for server in servers:
            await server.aclose()
        await swarm.aclose()
    work = [a - b for a, b in zip(after, before, strict=True)]
    capacity = sum(speeds) / ((1 + BACKWARD_COST) * seconds_per_sample)
    return [w / sum(work) for w in work], rate / capacity


@pytest.mark.timeout(60)
async def test_a_stage_s_work_goes_to_its_peers_in_proportion_to_their_speed(
    make_host: Callable[..., Any],
) -> None:
    """One stage, three peers at speeds 1:2:4 that announce the speed they measured: after
    a warm-up, the work each serves (forward + 2.5 x backward requests, microbatches of
    equal size) is within 20% (relative) of 1/7, 2/7 and 4/7."""
    speeds = (1.0, 2.0, 4.0)
    shares, efficiency = await _shares(make_host, speeds, warm=True, skip=30, count=120)
    print(f"shares {[round(s, 3) for s in shares]}; {efficiency:.2f} of the capacity bound")
    for share, speed in zip(shares, speeds, strict=True):
        assert share == pytest.approx(speed / sum(speeds), rel=0.2), shares
    assert efficiency > 0.25  # a sanity bound only: the figure belongs to bench/pipeline.py


@pytest.mark.timeout(60)
async def test_fresh_peers_are_shared_by_speed_from_the_start(
    make_host: Callable[..., Any],
) -> None:
    """The same stage of peers that have not measured a speed yet: over the first 60
    microbatches after the first 10, no peer gets less than half its share."""
    speeds = (1.0, 2.0, 4.0)
    shares, _ = await _shares(make_host, speeds, warm=False, skip=10, count=60)
    print(f"shares {[round(s, 3) for s in shares]}")
    for share, speed in zip(shares, speeds, strict=True):
        assert share >= 0.5 * speed / sum(speeds), shares


def _held(peer: StagePeer) -> int:
    """Samples a stage peer holds gradients for and has not stepped with (at a quiescent
    point all of them are for its current version: older ones went into its steps or
    were dropped when it re-synced)."""
    return sum(peer.worker.samples_for(e) for e in range(peer.version + 2))


async def _two_stages(swarm: Swarm, global_batch: int) -> None:
    """Stage 0 served by 2 peers, stage 1 by 3, at an equal artificial speed."""
    task = make_task(TINY)
    for s, module in enumerate(task.make_stages(11, 2)):
        for _ in range(2 + s):
            paced = Paced(module, seconds_per_sample=0.002, speed=1.0)
            await swarm.stage_peer(s, paced, global_batch=global_batch)


def _holding(swarm: Swarm, stage: int) -> StagePeer | None:
    """The peer of `stage` holding gradients for the most samples, if any holds some."""
    most = max(swarm.of_stage(stage), key=_held)
    return most if _held(most) > 0 else None


async def _kill(swarm: Swarm, victim: StagePeer) -> None:
    """As a crash: its host closes under its requests and rounds, then its tasks stop
    (its goodbye to the DHT cannot go out any more: its records outlive it)."""
    await victim.server.dht.host.aclose()
    await victim.aclose()
    swarm.peers.remove(victim)


@pytest.mark.timeout(120)
async def test_a_stage_peer_killed_mid_run_loses_no_microbatch_and_counts_none_twice(
    make_host: Callable[..., Any],
) -> None:
    """Two stages (2 and 3 peers), one trainer: after the second step, the peer of
    stage 1 holding the most gradients is killed. Training goes on to 8 steps; then at a
    quiescent point (no request in flight, no replay under way, every stage's peers at
    one version and none mid-step), for each stage:

        samples of the microbatches the trainer completed
          == the samples of the stage's committed steps (the all-reduce's weights)
           + the samples its live peers hold gradients for (the next step's)
           + the samples of backwards the trainer holds open whose peer lost them (died,
             or the step went on without it: the trainer replays those on its next
             answer from the stage; usually none)

    Nothing lost, nothing counted twice. The trainer's ledger counts each microbatch
    once too (counted + open == completed), and the surviving peers of each stage hold
    equal parameters and moments (fingerprints) at one version.

    The loop's lag is unbounded (only its 4 microbatches in flight pace it): the stage
    must step without the dead peer's gradients before its trainer replays them, and
    fresh samples keep coming to let it. At small lags that may take the trainer's flush
    (the next test); before it, at lags 1 and 3, this run stalled 5 times in 14 under
    load: the steps' overshoots (a step takes all its peers hold, often more than the
    global batch, while the loop paces by steps x global batch) had eaten the slack, and
    the victim had held all of the step's samples and died in the step.
    """
    global_batch, steps, kill_after = 16, 8, 2
    swarm = Swarm(make_host)
    try:
        await _two_stages(swarm, global_batch)
        trainer = await swarm.trainer(2, codec="none")
        task = make_task(TINY)
        loop = loop_for(trainer, task, shard=0, global_batch=global_batch, lag=10**6,
                        concurrency=4)  # fmt: skip
        members: list[dict[int, frozenset[Any]]] = [{}, {}]  # stage -> version -> members

        def log_steps() -> None:  # a peer tells only its last steps' members
            for p in swarm.peers:
                for record in p.optimizer.steps:
                    members[p.stage][record.version] = frozenset(record.members)

        loop.on_microbatch = lambda _: log_steps()
        running = asyncio.ensure_future(loop.run(steps=steps))
        await eventually(
            lambda: running.done() or (loop.steps >= kill_after and _holding(swarm, 1)),
            "gradients held in stage 1 after two steps", 30.0,
        )  # fmt: skip
        victim = _holding(swarm, 1)
        assert victim is not None and not running.done()
        log_steps()
        await _kill(swarm, victim)
        await eventually(running.done, f"{steps} steps, one peer of stage 1 dead", 45.0)
        await running
        await trainer.settled()

        def quiescent() -> bool:
            log_steps()
            for s in range(2):
                alive = swarm.of_stage(s)
                versions = {p.version for p in alive}
                if len(versions) > 1 or any(p.worker.epoch != p.version for p in alive):
                    return False  # a peer mid-step or behind
                if any(p.optimizer.stepping for p in alive):
                    return False  # a peer that counted its commit but not applied it yet
                stepped = {v for p in [*alive, victim] if p.stage == s
                           for v in p.optimizer.step_samples}  # fmt: skip
                if stepped != set(range(versions.pop())):
                    return False  # a commit not logged yet
            return True

        await eventually(quiescent, "every stage's peers at one version, none mid-step", 30.0)
        completed = trainer.counters.samples
        assert completed == loop.started_samples  # no microbatch left waiting for a stage
        assert loop.steps >= steps and trainer.counters.retries > 0
        assert len(swarm.of_stage(1)) == 2
        for s in range(2):
            alive = swarm.of_stage(s)
            version = alive[0].version
            step_samples: dict[int, int] = {}
            for p in [*alive, victim] if s == 1 else alive:  # the victim's log is history
                for v, n in p.optimizer.step_samples.items():
                    assert step_samples.setdefault(v, n) == n  # its members agree on it
            held = sum(_held(p) for p in alive)
            live = {p.server.dht.peer_id for p in alive}
            lost = 0
            for entry in trainer.ledger.open(s):
                if entry.epoch < version:  # its step committed: with its peer?
                    with_ = members[s].get(entry.epoch)
                    assert with_ is not None, f"stage {s}: no peer logged step {entry.epoch}"
                    lost += 0 if entry.peer in with_ else entry.samples
                else:  # its step is the next one: is its peer there to take it?
                    lost += 0 if entry.peer in live else entry.samples
            ledger = trainer.ledger
            print(f"stage {s}: {len(step_samples)} steps of {sum(step_samples.values())} "
                  f"samples, {held} held, {lost} lost (to replay), {completed} completed; "
                  f"ledger: {ledger.counted[s]} counted, {ledger.open_samples(s)} open, "
                  f"{ledger.replayed[s]} replayed, {ledger.assumed[s]} assumed")  # fmt: skip
            assert sum(step_samples.values()) + held + lost == completed
            assert ledger.counted[s] + ledger.open_samples(s) + ledger.assumed[s] == completed
            assert len({p.optimizer.fingerprint() for p in alive}) == 1
    finally:
        await swarm.aclose()


@pytest.mark.timeout(60)
async def test_at_lag_0_a_peer_killed_before_it_reported_its_gradients_stalls_no_stage(
    make_host: Callable[..., Any],
) -> None:
    """As above at lag 0 (each step takes exactly the next global batch), with the DHT
    slow to store a report (0.5 s, as over a WAN), and a peer of stage 1 killed as soon
    as the trainer has its answer to a backward for the stage's next step (so that those
    samples may be in no report the stage's other peers read): the stage still steps
    past that version within 15 s (the trainer, waiting with nothing in flight, asks it
    to step with what it holds after 3 s: `TrainerLoop`'s flush; before that fix the
    stage never stepped again)."""
    global_batch, kill_after = 16, 2
    swarm = Swarm(make_host)
    try:
        await _two_stages(swarm, global_batch)
        for p in swarm.of_stage(1):
            report = p.progress.report

            async def slow(samples: int, version: int, report: Any = report) -> bool:
                await asyncio.sleep(0.5)
                return await report(samples, version)

            p.progress.report = slow  # type: ignore[method-assign]
        trainer = await swarm.trainer(2, codec="none")
        task = make_task(TINY)
        loop = loop_for(trainer, task, shard=0, global_batch=global_batch, lag=0, concurrency=4)
        stop = asyncio.Event()
        running = asyncio.ensure_future(loop.run(stop))
        try:

            def answered() -> StagePeer | None:  # a peer whose backward the trainer counts
                for entry in trainer.ledger.open(1) if loop.steps >= kill_after else ():
                    for p in swarm.of_stage(1):
                        if entry.peer == p.server.dht.peer_id and entry.epoch == p.version:
                            return p
                return None

            await eventually(lambda: running.done() or answered(),
                             "an answered backward in stage 1 after two steps", 30.0)  # fmt: skip
            victim = answered()
            assert victim is not None and not running.done()
            version = victim.version
            await _kill(swarm, victim)
            await eventually(
                lambda: all(p.version > version for p in swarm.of_stage(1)),
                "stage 1 stepped past the version its dead peer held gradients for", 15.0,
            )  # fmt: skip
        finally:
            stop.set()
            await running
    finally:
        await swarm.aclose()
