"""Pipelined experiments with `shoal run` processes: hosting, joining, roles, kill -9.

The stage peers are daemons (a crash is the point); in the exactly-once test
the trainer runs in the test process, so its counters can be read at the end.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import Daemon, wait_for

from shoal.dht.node import DHTNode
from shoal.peer.experiment import find_manifest, parse_experiment_ref
from shoal.peer.training.tasks.bytegpt import make_task
from shoal.pipeline.trainer import PipelineTrainer
from shoal.pipeline.trainer_loop import TrainerLoop

pytestmark = pytest.mark.slow

PIPE_TASK = "d_model=32,n_layers=3,n_heads=2,context=32,batch_size=4"
PIPE_ENV = {"SHOAL_TASK_OPTIONS": PIPE_TASK, "SHOAL_THREADS": "1"}


def pipeline_of(d: Daemon) -> dict[str, Any]:
    return d.status()["pipeline"]  # type: ignore[no-any-return]


def stop_all(daemons: list[Daemon]) -> None:
    for d in daemons:
        d.kill()


def tails(daemons: list[Daemon]) -> Callable[[], str]:
    return lambda: "\n".join(d.tail(15) for d in daemons)


# Above the sum of its waits (four rounds of starts of 60 s, 90 + 90 + 90 + 120 s), so a
# slow run names the wait it failed in (41-48 s usually; one local CI run took 153 s).
@pytest.mark.timeout(660)
def test_a_host_and_five_joiners_train_a_three_stage_pipeline_through_a_kill(
    tmp_path: Path,
) -> None:
    """`--pipeline-stages 3` and five joiners with the default role: every peer serves a
    stage and drives microbatches; the trainers' loss falls; the stages keep stepping
    after a peer of a stage that two serve is killed with SIGKILL; peers of a stage at
    one version hold the same parameters."""
    env = {**PIPE_ENV, "SHOAL_STRATEGY_OPTIONS": "warmup_steps=5,inner_lr=3e-3"}
    host = Daemon("host", tmp_path, ["--host-experiment", "pipe", "--pipeline-stages", "3"],
                  env)  # fmt: skip
    daemons = [host]
    try:
        host.wait_ready()
        join = ["--join", host.join_ref, "--bootstrap", host.address]
        # The first two one after the other (each chooses from what the one before
        # serves: the least-capacity choice covers stages 1 and 2); the other three at
        # once (a start is seconds of CPU, and one after the other they add up).
        for i in range(2):
            joiner = Daemon(f"joiner-{i}", tmp_path, join, PIPE_ENV)  # (the manifest's settings)
            daemons.append(joiner)
            joiner.wait_ready()
        daemons += [Daemon(f"joiner-{i}", tmp_path, join, PIPE_ENV) for i in range(2, 5)]
        for joiner in daemons[3:]:
            joiner.wait_ready()
        status = {d.name: pipeline_of(d) for d in daemons}
        assert all(p["trainer"] and p["stage"] is not None for p in status.values())
        served = sorted(p["stage"] for p in status.values())
        assert set(served) == {0, 1, 2}, served  # the least-capacity choice covers them all

        def losses() -> list[float | None]:
            return [d.status()["loss"] for d in daemons if d.alive()]

        wait_for("every trainer's first loss", lambda: all(losses()), 90, debug=tails(daemons))
        wait_for("5 optimizer steps", lambda: host.status()["step"] >= 5, 90, debug=tails(daemons))
        # Every trainer's own shard learned before the kill: a joiner that starts training
        # late (here after 48 steps, under CI's load) first reports the loss of a shard
        # the stages never saw (7.3 once), which falls within a few steps.
        learned = lambda: max(x or 9.0 for x in losses()) < 4.5  # noqa: E731
        wait_for("every trainer's loss below 4.5", learned, 90, debug=tails(daemons))
        steps_before = host.status()["step"]
        at_kill = [x for x in losses() if x is not None]

        # A peer of a stage that another peer also serves, not the host's: the stage
        # routes around it and keeps its state. (Killing a stage's only peer loses the
        # stage's state: test_pipeline_state_loss.py does that.)
        now = {d.name: pipeline_of(d)["stage"] for d in daemons}
        others = [d for d in daemons[1:] if now[d.name] != now["host"]]
        shared = [d for d in others if list(now.values()).count(now[d.name]) >= 2]
        victim = (shared or others)[0]
        victim.kill()
        survivors = [d for d in daemons if d is not victim]
        wait_for("15 more steps after the kill",
                 lambda: host.status()["step"] >= steps_before + 15, 120,
                 debug=tails(survivors))  # fmt: skip
        last = [d.status()["loss"] for d in survivors]
        # ln 256 = 5.55 is a byte model's loss before it learns anything; this tiny
        # model's loss flattens near 3.2 within a few dozen steps.
        assert max(last) < 4.0 and max(at_kill) < 4.5, (at_kill, last)

        # (The fingerprint's own version: `version` counts a step before it is applied.)
        seen: dict[tuple[int, int], set[str]] = {}
        for d in survivors:
            st = d.status()
            p = st["pipeline"]
            seen.setdefault((p["stage"], p["fingerprint_version"]), set()).add(st["fingerprint"])
        assert all(len(prints) == 1 for prints in seen.values()), seen
    finally:
        stop_all(daemons)


@pytest.mark.timeout(180)
def test_a_peer_with_no_pinned_stage_moves_to_the_stage_that_limits_the_pipeline(
    tmp_path: Path,
) -> None:
    """Two stages: the host (role auto, its stage chosen, not pinned) and three pinned
    peers serve stage 0, one pinned peer serves stage 1. With `rebalance_s=2` the host
    moves to stage 1: its status shows the move and the new stage, its own trainer now
    calls stage 1 directly, and the pipeline keeps stepping. (With two pinned peers the
    move would leave stage 0 below stage 1's capacity here, whose peers are faster:
    not a move the rules allow.)"""
    env = {**PIPE_ENV, "SHOAL_STRATEGY_OPTIONS": "rebalance_s=2,inner_lr=3e-3"}
    host = Daemon("host", tmp_path, ["--host-experiment", "pipe", "--pipeline-stages", "2"],
                  env)  # fmt: skip
    daemons = [host]
    try:
        host.wait_ready()
        assert pipeline_of(host)["stage"] == 0
        join = ["--join", host.join_ref, "--bootstrap", host.address, "--role", "stage"]
        daemons += [
            Daemon(f"pinned-{i}", tmp_path, [*join, "--stage", str(stage)], PIPE_ENV)
            for i, stage in enumerate((0, 0, 0, 1))
        ]
        for peer in daemons[1:]:  # (pinned: they start at once)
            peer.wait_ready()
        moved = wait_for("the host's move to stage 1",
                         lambda: (p := pipeline_of(host))["moves"] and p, 90,
                         debug=tails(daemons))  # fmt: skip
        assert moved["stage"] == 1 and [m[:2] for m in moved["moves"]] == [[0, 1]]
        assert all(pipeline_of(d)["moves"] is None for d in daemons[1:])  # pinned: they stay
        assert moved["moves_given_way"] == 0  # the only one free to move met no other move
        steps = host.status()["step"]
        wait_for("5 more steps after the move", lambda: host.status()["step"] >= steps + 5, 60,
                 debug=tails(daemons))  # fmt: skip
        assert pipeline_of(host)["served"]["backward"] > 0
        assert pipeline_of(host)["moves"] == moved["moves"]  # (and it stays)
    finally:
        stop_all(daemons)


class StageSwarm:
    """Six `--role stage` daemons (2 per stage; the first hosts) and a trainer in this
    process with lag 0, so that its counters can be read at the end."""

    def __init__(self, tmp_path: Path, name: str) -> None:
        env = {**PIPE_ENV, "SHOAL_STRATEGY_OPTIONS": "lag=0,codec=none"}
        host_args = ["--host-experiment", name, "--pipeline-stages", "3", "--role", "stage"]
        self.host = Daemon("host", tmp_path, [*host_args, "--stage", "0"], env)
        self.daemons = [self.host]
        self.tmp_path, self.env = tmp_path, env
        self.dht: DHTNode | None = None

    async def start(self, make_host: Callable[..., Any]) -> None:
        await asyncio.to_thread(self.host.wait_ready)
        join = ["--join", self.host.join_ref, "--bootstrap", self.host.address, "--role", "stage"]
        for k in (0, 1, 1, 2, 2):
            name = f"stage{k}-{len(self.daemons)}"
            self.daemons.append(Daemon(name, self.tmp_path, [*join, "--stage", str(k)], self.env))
        for d in self.daemons[1:]:
            await asyncio.to_thread(d.wait_ready)
        self.dht = await DHTNode.create(await make_host(), bootstrap=[self.host.address])
        ref = parse_experiment_ref(self.host.join_ref)
        manifest = await find_manifest(self.dht, ref, timeout=15)
        task = make_task(manifest.task_config)
        self.trainer = PipelineTrainer(self.dht, manifest.experiment_id, 3, codec="none")
        self.global_batch = manifest.strategy_options["global_batch"]
        # A gate before every request of the trainer (`hold_while_holding`): the samples
        # of the requests waiting at it.
        self.gate = asyncio.Event()
        self.gate.set()
        self.waiting = 0
        request = self.trainer._request_from

        async def gated(stage: int, method: str, key: str, samples: int, tensors: Any) -> Any:
            if not self.gate.is_set():
                self.waiting += samples
                try:
                    await self.gate.wait()
                finally:
                    self.waiting -= samples
            return await request(stage, method, key, samples, tensors)

        self.trainer._request_from = gated  # type: ignore[method-assign]
        self.loop = TrainerLoop(
            self.trainer,
            task.batches(0, 1, 0),
            inputs_of=task.stage_inputs,
            loss_of=task.stage_loss,
            global_batch=self.global_batch,
            lag=0,
        )

    async def hold_while_holding(self, peer: Daemon) -> None:
        """Stop the trainer's requests at a moment `peer` holds gradients for a step not
        taken yet: with no backward coming, its stage cannot step, so the gradients are
        still held when the caller kills it (`release` lets the requests go on)."""
        while True:
            await asyncio.to_thread(wait_for, "the peer to hold gradients",
                                    lambda: pipeline_of(peer)["pending_samples"] > 0, 30,
                                    every=0.02)  # fmt: skip
            self.gate.clear()
            # The requests already sent come back (one more step may happen on them).
            await asyncio.to_thread(wait_for, "the requests in flight to come back",
                                    lambda: self.waiting >= self.loop.started_samples
                                    - self.trainer.counters.samples, 30)  # fmt: skip
            if pipeline_of(peer)["pending_samples"] > 0:
                return
            self.gate.set()

    def release(self) -> None:
        self.gate.set()

    async def until_steps(self, run: asyncio.Future[None], steps: int) -> None:
        while self.loop.steps < steps:
            assert not run.done(), run.exception()
            await asyncio.sleep(0.1)

    async def check_accounting(self, peers: list[Daemon]) -> None:
        """Every stage's step sizes plus the samples its peers hold for steps to come add
        up to exactly the samples the trainer completed: none lost, none counted twice."""
        await asyncio.wait_for(self.trainer.settled(), 60)

        def accounted() -> list[int] | None:
            totals = []
            for s in range(3):
                of_stage = [p for p in (pipeline_of(d) for d in peers) if p["stage"] == s]
                steps: dict[str, int] = {}
                for p in of_stage:
                    steps.update(p["step_samples"])
                totals.append(sum(steps.values()) + sum(p["pending_samples"] for p in of_stage))
            return totals if totals == [self.trainer.counters.samples] * 3 else None

        await asyncio.to_thread(wait_for, "every stage to account for every sample", accounted,
                                30, debug=tails(peers))  # fmt: skip

    async def aclose(self) -> None:
        if self.dht is not None:
            await self.dht.aclose()
        stop_all(self.daemons)


@pytest.mark.timeout(240)
async def test_a_stage_peer_killed_mid_run_loses_no_microbatch_and_counts_none_twice(
    tmp_path: Path, make_host: Callable[..., Any]
) -> None:
    swarm = StageSwarm(tmp_path, "once")
    try:
        await swarm.start(make_host)
        run = asyncio.ensure_future(swarm.loop.run(steps=14))
        await swarm.until_steps(run, 4)
        victim = swarm.daemons[2]  # a stage-1 peer, killed while it holds gradients
        await swarm.hold_while_holding(victim)
        victim.kill()
        swarm.release()
        await asyncio.wait_for(run, 150)
        await swarm.check_accounting([d for d in swarm.daemons if d is not victim])
        assert swarm.trainer.counters.samples >= 14 * swarm.global_batch
        assert sum(swarm.trainer.ledger.replayed) > 0  # what died with the victim went again
    finally:
        await swarm.aclose()


@pytest.mark.timeout(240)
async def test_a_stopped_stage_peer_is_routed_around_and_resyncs_before_serving_again(
    tmp_path: Path, make_host: Callable[..., Any]
) -> None:
    """SIGSTOP a stage peer: training goes on without it (its stage steps once its
    progress report goes stale); after SIGCONT it downloads the stage's state before
    it serves again, and no microbatch is lost or counted twice."""
    swarm = StageSwarm(tmp_path, "stopped")
    stop = asyncio.Event()  # (no step budget: how soon the peer is back varies)
    try:
        await swarm.start(make_host)
        run = asyncio.ensure_future(swarm.loop.run(stop))
        await swarm.until_steps(run, 4)
        victim = swarm.daemons[2]  # a stage-1 peer
        victim.proc.send_signal(signal.SIGSTOP)
        stopped_at = swarm.loop.steps
        # Report stale (10 s) + a step's matchmaking: the stage goes on alone.
        started = time.monotonic()
        await swarm.until_steps(run, stopped_at + 3)
        assert time.monotonic() - started < 10 + 15
        victim.proc.send_signal(signal.SIGCONT)
        # (60 s: under heavy load a woken peer has taken over 30 s to notice that it is
        # behind, 1 run in 6; where that time goes is not pinned down yet.)
        synced = await asyncio.to_thread(
            wait_for, "the woken peer to re-sync", lambda: pipeline_of(victim)["syncs"] >= 1, 60
        )
        assert synced
        served = pipeline_of(victim)["served"]["backward"]
        await swarm.until_steps(run, swarm.loop.steps + 5)
        # (60 s: the trainer routes to the woken peer again once it reads the peer's
        # fresh record and draws it among the stage's peers; CI saw 26 s of the 30
        # this had, on a quick machine.)
        await asyncio.to_thread(
            wait_for, "the woken peer to serve again",
            lambda: pipeline_of(victim)["served"]["backward"] > served, 60,
        )  # fmt: skip
        stop.set()
        await asyncio.wait_for(run, 60)
        await swarm.check_accounting(swarm.daemons)
    finally:
        stop.set()
        swarm.daemons[2].proc.send_signal(signal.SIGCONT)
        await swarm.aclose()
