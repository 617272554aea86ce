"""Rebalancing: stage peers moving to the stage that limits the pipeline, measured.

    python bench/rebalance.py [--period 6] [--window 15] [--seconds-per-sample 0.004]

Prints one JSON object on stdout (logs go to stderr):

    {"starved": {"layout_before": [3, 3, 3, 1], "layout_after": [...],
                 "first_move_s": seconds from the movers' start to the first move done,
                 "first_move_limit_s": 2.5 periods (+ jitter) + the move's drain and download,
                 "samples_per_s_before": ..., "samples_per_s_after": ...,
                 "speedup": after / before, "min_serving_peers": per stage, over the run},
     "balanced": {"layout": [3, 3, 3, 3], "speed_jitter": 0.1, "periods": 10,
                  "moves": ..., "returns": moves back to a stage the peer had left},
     "newcomer": {"stage": the stage it picked, "least_capacity_stage": ...,
                  "download_s": ..., "first_request_s": from its start to its first
                  request served, "limit_s": download_s + 10},
     ...}

Everything runs in this process on loopback, like bench/pipeline.py: a DHT node and host
per stage peer, a `TrainerLoop` driving microbatches, and each stage peer's `StageMover`
(the daemon's mover, with the period given). Compute is modelled by an artificial delay
(`Paced` from bench/pipeline.py: `samples x --seconds-per-sample / speed`, x2.5 for a
backward), so a stage's capacity is the sum of its peers' speeds. `starved` measures the
throughput of the layout [3, 3, 3, 1] with the movers off, then turns them on and
measures again once the first move is done and one more period passed. `balanced` runs
movers on [3, 3, 3, 3] whose peers' speeds are drawn from 1 +- 10 % for 10 periods.
`newcomer` adds a peer to that swarm, which picks the stage with the least capacity.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import logging
import random
import sys
import time
from typing import Any

from pipeline import Paced, close_nodes, loopback_node  # bench/pipeline.py
from shoal.dht.node import DHTNode
from shoal.peer.training.tasks.bytegpt import make_task
from shoal.pipeline.directory import least_capacity_stage, read_stages
from shoal.pipeline.mover import StageMover
from shoal.pipeline.rebalance import RebalancePolicy
from shoal.pipeline.stage_peer import StagePeer
from shoal.pipeline.trainer import PipelineTrainer
from shoal.pipeline.trainer_loop import TrainerLoop

log = logging.getLogger("bench.rebalance")

EXPERIMENT = "bench-rebalance"
HOST_OPTS = {"max_connections_per_ip": 100_000, "close_grace": 0.1}
STAGES = 4


class Swarm:
    """Stage peers with movers, and one trainer, on loopback."""

    def __init__(self, opts: argparse.Namespace, seed: int) -> None:
        self.opts = opts
        self.task = make_task({"d_model": 32, "n_layers": STAGES, "n_heads": 1, "context": 32,
                               "batch_size": opts.microbatch})  # fmt: skip
        self.modules = self.task.make_stages(0, STAGES)
        self.rng = random.Random(seed)
        self.nodes: list[DHTNode] = []
        self.movers: list[StageMover] = []
        self.policy = RebalancePolicy(period_s=opts.period)
        self.stop = asyncio.Event()
        self.tasks: list[asyncio.Task[Any]] = []
        self.min_serving = [10**9] * STAGES

    async def node(self) -> DHTNode:
        return await loopback_node(self.nodes)

    def _factory(self, dht: DHTNode, speed: float):  # type: ignore[no-untyped-def]
        async def make(stage: int) -> StagePeer:
            paced = Paced(copy.deepcopy(self.modules[stage]), self.opts.seconds_per_sample, speed)
            return StagePeer(dht, EXPERIMENT, stage, paced, hyper={"lr": 1e-3},
                             global_batch=self.opts.global_batch)  # fmt: skip

        return make

    async def add_peer(self, stage: int | None, speed: float) -> StageMover:
        """A stage peer (at `stage`, or the least capacity's) with its mover (not running)."""
        dht = await self.node()
        if stage is None:
            stage = least_capacity_stage(await read_stages(dht, EXPERIMENT, STAGES))
        make = self._factory(dht, speed)
        peer = await make(stage)
        await peer.start(sync=bool(self.serving(stage)))
        mover = StageMover(dht, EXPERIMENT, STAGES, peer, make, policy=self.policy,
                           rng=random.Random(self.rng.random()))  # fmt: skip
        self.movers.append(mover)
        return mover

    def serving(self, stage: int) -> list[StagePeer]:
        return [m.peer for m in self.movers if m.peer.stage == stage and not m.peer.server.draining]

    def layout(self) -> list[int]:
        return [sum(1 for m in self.movers if m.peer.stage == s) for s in range(STAGES)]

    async def train(self) -> PipelineTrainer:
        trainer = PipelineTrainer(await self.node(), EXPERIMENT, STAGES, codec="none")
        loop = TrainerLoop(trainer, self.task.batches(0, 1, 0), inputs_of=self.task.stage_inputs,
                           loss_of=self.task.stage_loss, global_batch=self.opts.global_batch,
                           lag=1, concurrency=self.opts.concurrency)  # fmt: skip
        self.tasks.append(asyncio.ensure_future(loop.run(self.stop)))
        self.tasks.append(asyncio.ensure_future(self._watch()))
        return trainer

    def start_movers(self) -> None:
        for m in self.movers:
            self.tasks.append(asyncio.ensure_future(m.run(self.stop)))

    async def _watch(self) -> None:
        while not self.stop.is_set():
            for s in range(STAGES):
                self.min_serving[s] = min(self.min_serving[s], len(self.serving(s)))
            await asyncio.sleep(0.02)

    async def aclose(self) -> None:
        self.stop.set()
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await asyncio.gather(*(m.peer.aclose() for m in self.movers), return_exceptions=True)
        await close_nodes(self.nodes)


async def rate(trainer: PipelineTrainer, seconds: float) -> float:
    samples, started = trainer.counters.samples, time.monotonic()
    await asyncio.sleep(seconds)
    return (trainer.counters.samples - samples) / (time.monotonic() - started)


async def starved(opts: argparse.Namespace) -> dict[str, Any]:
    swarm = Swarm(opts, seed=1)
    try:
        for stage in (0, 0, 0, 1, 1, 1, 2, 2, 2, 3):
            await swarm.add_peer(stage, 1.0)
        before_layout = swarm.layout()
        trainer = await swarm.train()
        await asyncio.sleep(opts.warmup)
        before = await rate(trainer, opts.window)
        started = time.monotonic()
        swarm.start_movers()
        while not any(m.moves for m in swarm.movers):  # noqa: ASYNC110 (a bench's poll)
            await asyncio.sleep(0.05)
        first_move = time.monotonic() - started
        await asyncio.sleep(opts.period)  # the trainers' view of the stages settles
        after = await rate(trainer, opts.window)
        return {
            "layout_before": before_layout,
            "layout_after": swarm.layout(),
            "moves": [m.moves[0][:2] for m in swarm.movers if m.moves],
            "first_move_s": round(first_move, 2),
            "first_move_limit_s": round(2.5 * opts.period * (1 + swarm.policy.jitter) + 10, 2),
            "samples_per_s_before": round(before, 2),
            "samples_per_s_after": round(after, 2),
            "speedup": round(after / before, 3) if before else None,
            "min_serving_peers": swarm.min_serving,
        }
    finally:
        await swarm.aclose()


async def balanced(opts: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    swarm = Swarm(opts, seed=2)
    rng = random.Random(3)
    try:
        for stage in range(STAGES):
            for _ in range(3):
                await swarm.add_peer(stage, rng.uniform(1 - opts.jitter, 1 + opts.jitter))
        await swarm.train()
        await asyncio.sleep(opts.warmup)
        swarm.start_movers()
        await asyncio.sleep(10 * opts.period)
        moves = [(i, a, b) for i, m in enumerate(swarm.movers) for a, b, _ in m.moves]
        returns = [(i, a, b) for i, a, b in moves if (i, b, a) in moves]
        report = {"layout": [3] * STAGES, "speed_jitter": opts.jitter, "periods": 10,
                  "moves": len(moves), "returns": len(returns)}  # fmt: skip

        # A newcomer: it picks the stage with the least capacity, downloads its state,
        # and serves.
        dht = await swarm.node()
        records = await read_stages(dht, EXPERIMENT, STAGES)
        pick = least_capacity_stage(records)
        started = time.monotonic()
        peer = await swarm._factory(dht, 1.0)(pick)
        await peer.optimizer.sync(60.0)
        download = time.monotonic() - started
        await peer.start(sync=False)
        swarm.movers.append(StageMover(dht, EXPERIMENT, STAGES, peer, swarm._factory(dht, 1.0),
                                       policy=swarm.policy))  # fmt: skip
        while peer.server.served["forward"] + peer.server.served["backward"] == 0:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        first = time.monotonic() - started
        newcomer = {"stage": pick, "capacities": [len(r) for r in records],
                    "download_s": round(download, 3), "first_request_s": round(first, 3),
                    "limit_s": round(download + 10, 3)}  # fmt: skip
        return report, newcomer
    finally:
        await swarm.aclose()


async def run(opts: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = {
        "period_s": opts.period,
        "seconds_per_sample": opts.seconds_per_sample,
    }
    result["starved"] = await starved(opts)
    result["balanced"], result["newcomer"] = await balanced(opts)
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--period", type=float, default=6.0, help="the movers' period (s)")
    p.add_argument("--window", type=float, default=15.0, help="throughput window (s)")
    p.add_argument("--warmup", type=float, default=8.0)
    p.add_argument("--seconds-per-sample", type=float, default=0.02)
    p.add_argument("--microbatch", type=int, default=8)
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--jitter", type=float, default=0.1)
    opts = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    print(json.dumps(asyncio.run(run(opts))))


if __name__ == "__main__":
    main()
