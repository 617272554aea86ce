"""/status's pipeline drawing data (peer/status/pipeline_status.py) from a real in-process swarm:
every stage's peers with their numbers, the microbatch flow, and the trainer's bans."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest

from shoal.peer.status.pipeline_status import PipelineStatus
from shoal.peer.training.tasks.bytegpt import make_task
from shoal.pipeline.directory import read_stages

from .pipeline_swarm import EXPERIMENT, TINY, Swarm, loop_for

CONTRACT = {"stage": None, "trainer": True, "microbatches": 0}  # PipelineRun's own keys


@pytest.mark.timeout(60)
async def test_the_status_shows_each_peer_the_flow_through_it_and_the_peers_routed_around(
    make_host: Callable[..., Any],
) -> None:
    task = make_task(TINY)
    swarm = Swarm(make_host)
    try:
        for k, module in enumerate(task.make_stages(5, 2)):
            for _ in range(2 - k):  # stage 0: two peers; stage 1: one
                await swarm.stage_peer(k, module, global_batch=8)
        trainer = await swarm.trainer(2, codec="none")
        loop = loop_for(trainer, task, shard=0, global_batch=8, lag=0, concurrency=2)
        view = PipelineStatus()
        me = trainer.dht.peer_id

        def extend(now: float, **parts: Any) -> dict[str, Any]:
            status = {**CONTRACT, "stages": [{"stage": 0, "peers": 2}]}
            parts = {"self_id": me, "trainer": trainer, "server": None, **parts}
            return view.extend(status, directory=directory, now=now, wall=time.time(), **parts)

        directory = await read_stages(trainer.dht, EXPERIMENT, 2)
        extend(1000.0)  # the counters before: all zero
        await loop.run(steps=3)
        # (Stage peers tell trainers of a step before their DHT record says it.)
        async with asyncio.timeout(10):
            while True:
                directory = await read_stages(trainer.dht, EXPERIMENT, 2)
                if all(r.version == 3 for records in directory for r in records):
                    break
        status = extend(1004.0)

        # PipelineRun's keys stay as they were; a stage row it lacked is added.
        assert {k: status[k] for k in CONTRACT} == CONTRACT
        assert [s["stage"] for s in status["stages"]] == [0, 1] and status["stages"][0][
            "peers"
        ] == 2
        flow = status["flow"]
        assert flow["window_s"] == 4.0
        assert flow["microbatches_per_s"] == trainer.counters.microbatches / 4 > 0
        assert flow["samples_per_s"] == trainer.counters.samples / 4
        assert flow["served_per_s"] is None  # (this peer serves no stage)
        for k in (0, 1):
            servers = status["stages"][k]["servers"]
            records = directory[k]
            assert [s["peer_id"] for s in servers] == [str(r.peer) for r in records]
            for server, record in zip(servers, records, strict=True):
                answered = trainer.served_by.get(record.peer, 0)
                assert server["flow"] == answered / 4
                assert server["throughput"] == record.samples_per_s
                assert server["version"] == record.version == 3  # three steps taken
                assert server["measured"] > 0 and server["in_flight"] == 0
                assert not server["banned"] and not server["self"]
                assert 0 <= server["age_s"] < 60
            # Every request of a microbatch went through one peer of each stage, both ways.
            stage_rate = flow["stages"][k]["requests_per_s"]
            assert stage_rate == sum(s["flow"] for s in servers) == 2 * flow["microbatches_per_s"]
        assert status["bans"] == []

        # A request to a stage-0 peer fails: the trainer bans it, and the status says so.
        victim = directory[0][0].peer
        ban = trainer.balancers[0].failed(victim, time.monotonic())
        status = extend(time.monotonic())
        assert status["bans"] == [
            {"peer_id": str(victim), "stage": 0, "ban_s": pytest.approx(ban, abs=1)}
        ]
        banned = [s for s in status["stages"][0]["servers"] if s["banned"]]
        assert [s["peer_id"] for s in banned] == [str(victim)]

        # A stage peer's own view: its box is live (queue, version), its flow what it served.
        own = swarm.of_stage(1)[0]
        mine = PipelineStatus()
        before = sum(own.server.served.values())
        mine.extend({}, self_id=own.server.dht.peer_id, directory=directory, trainer=None,
                    server=own.server, now=0.0)  # fmt: skip
        # Another trainer's microbatches (a TrainerLoop runs once, a trainer's keys once).
        other = await swarm.trainer(2, codec="none")
        await loop_for(other, task, shard=0, global_batch=8, lag=0, seed=1).run(steps=1)
        served = sum(own.server.served.values()) - before
        status = mine.extend({}, self_id=own.server.dht.peer_id, directory=directory,
                             trainer=None, server=own.server, now=2.0)  # fmt: skip
        (box,) = status["stages"][1]["servers"]
        assert box["self"] and box["version"] == own.server.version == 4
        assert box["queue"] == own.server.queued and box["flow"] == served / 2 > 0
        assert status["flow"]["served_per_s"]["backward"] > 0
        assert status["flow"]["microbatches_per_s"] is None and status["bans"] == []
    finally:
        await swarm.aclose()


def test_a_monitor_shows_the_directory_and_no_rates_until_two_samples() -> None:
    """Neither trainer nor server (a monitor): the stages' records only; a single sample
    gives no rate (null, not a made-up 0)."""
    view = PipelineStatus()
    from shoal.pipeline.directory import StageRecord
    from shoal.transport.identity import Identity

    peer = Identity.generate().peer_id
    record = StageRecord(peer, forward=30.0, backward=15.0, queue=3, version=7, at=100.0)
    status = view.extend({}, self_id=Identity.generate().peer_id, directory=[[record], []],
                         trainer=None, server=None, now=0.0, wall=110.0)  # fmt: skip
    (box,) = status["stages"][0]["servers"]
    assert box == {
        "peer_id": str(peer),
        "self": False,
        "throughput": pytest.approx(10.0),  # 1 / (1/30 + 1/15)
        "measured": None,
        "queue": 3,
        "in_flight": None,
        "version": 7,
        "flow": None,
        "banned": False,
        "ban_s": None,
        "age_s": 10.0,
    }
    assert status["stages"][1]["servers"] == []
    assert status["flow"] == {
        "window_s": None,
        "microbatches_per_s": None,
        "samples_per_s": None,
        "stages": [{"stage": 0, "requests_per_s": None}, {"stage": 1, "requests_per_s": None}],
        "served_per_s": None,
    }
    assert status["bans"] == []
