"""docker/compose.yaml's `pipeline` profile: a bootstrap hosting a 3-stage pipelined
experiment, 6 stage peers and 2 trainers. The trainers' loss falls within 5 minutes of
`up`; every stage peer's memory budget is what its container's limit leaves;
`docker kill` of a stage peer costs the trainers' throughput for a few seconds
at most (back within 20 s), and of a trainer, nothing to the other."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from docker_harness import BUILD_TIMEOUT, ComposeProject, Engine, compose_unavailable, wait_for

pytestmark = [pytest.mark.container, pytest.mark.slow, pytest.mark.timeout(BUILD_TIMEOUT + 420)]

STAGE_PEERS = [f"pipe-stage{k}{ab}" for k in range(3) for ab in "ab"]
TRAINERS = ["pipe-trainer1", "pipe-trainer2"]
SERVICES = ["pipe-bootstrap", *STAGE_PEERS, *TRAINERS]
PORT_VARIABLES = {s: f"SHOAL_PIPE_{s.removeprefix('pipe-').upper()}_PORT" for s in SERVICES}

LOSS_DEADLINE = 300.0  # the "loss falls within 5 minutes", from `up`
# A byte model starts near ln 256 = 5.55; a full nat less is learning, not noise.
LOSS_DROP = 1.0
RECOVERY_DEADLINE = 20.0
RATE_WINDOW = 4.0  # seconds of microbatches a throughput reading spans
RECOVERED = 0.5  # of the throughput before the kill
MEMORY_LIMIT = 1 << 30  # the profile's default mem_limit (SHOAL_PIPE_MEM_LIMIT) of each peer


@pytest.fixture
def project(engine: Engine, image: str) -> Iterator[ComposeProject]:
    reason = compose_unavailable()
    if reason:
        pytest.skip(reason)
    created = ComposeProject(engine, "pipeline", PORT_VARIABLES, {"SHOAL_IMAGE": image})
    try:
        yield created
    finally:
        created.down()


class Throughput:
    """Microbatches the trainers completed, read from their /status: a rate over the last
    RATE_WINDOW seconds of readings (a trainer that does not answer counts as stopped)."""

    def __init__(self, project: ComposeProject, trainers: list[str]) -> None:
        self.project = project
        self.trainers = trainers
        self.readings: list[tuple[float, int]] = []

    def read(self) -> float | None:
        total = 0
        for service in self.trainers:
            try:
                total += self.project.status(service)["pipeline"]["microbatches"]
            except OSError:
                pass  # (its last count is lost with it: the rate then falls, as it should)
        now = time.monotonic()
        self.readings.append((now, total))
        past = [(t, n) for t, n in self.readings if t <= now - RATE_WINDOW]
        if not past:
            return None
        t0, n0 = past[-1]
        return max(0, total - n0) / (now - t0)


def test_the_pipeline_profile_trains_and_routes_around_a_killed_stage_peer_and_trainer(
    project: ComposeProject,
) -> None:
    started = time.monotonic()
    # Naming the trainers starts what they depend on: the bootstrap and the stage
    # peers (the profile-less default swarm stays down).
    project.up(*TRAINERS)
    metrics: dict[str, Any] = {}

    def losses() -> list[float | None]:
        return [project.status(t)["loss"] for t in TRAINERS]

    def losses_below(bound: float) -> list[float] | None:
        now = losses()
        return [x for x in now if x is not None and x < bound] if None not in now else None

    first = wait_for("both trainers' first loss", lambda: losses_below(float("inf")),
                     LOSS_DEADLINE, debug=project.logs)  # fmt: skip
    metrics["first_loss_s"] = round(time.monotonic() - started, 1)
    target = max(first) - LOSS_DROP
    fallen = wait_for(
        f"both trainers' loss below {target:.2f} (from {first})",
        lambda: (below := losses_below(target)) and len(below) == len(TRAINERS) and below,
        LOSS_DEADLINE - (time.monotonic() - started),
        interval=2.0,
        debug=project.logs,
    )
    metrics["loss_fell_s"] = round(time.monotonic() - started, 1)
    metrics["loss"] = [round(x, 3) for x in first + fallen]

    # Every status page shows the pipeline: 3 stages of 2 peers (the bootstrap's too).
    for service in SERVICES:
        pipeline = project.status(service)["pipeline"]
        servers = [[s["peer_id"] for s in st["servers"]] for st in pipeline["stages"]]
        assert [len(ids) for ids in servers] == [2, 2, 2], (service, servers)
    boot = project.status("pipe-bootstrap")["pipeline"]
    assert boot["role"] == "monitor" and boot["stage"] is None and not boot["trainer"]

    # Every stage peer runs in its container's memory limit: its budget is what that
    # limit left when it started (no --max-memory given), and its stage fits it.
    for service in STAGE_PEERS:
        limit = project.engine.inspect("container", project.container(service))["HostConfig"]
        pipeline = project.status(service)["pipeline"]
        budget, cost = pipeline["memory_budget_bytes"], pipeline["stage_memory_bytes"]
        assert limit["Memory"] == MEMORY_LIMIT, (service, limit["Memory"])
        assert 0 < cost <= budget < MEMORY_LIMIT, (service, cost, budget)

    # The throughput before, then `docker kill` of a stage-1 peer.
    meter = Throughput(project, TRAINERS)
    before = wait_for("a throughput reading", meter.read, 30, interval=1.0)
    victim = "pipe-stage1a"
    victim_id = project.status(victim)["peer_id"]
    container = project.container(victim)
    killed_at = time.monotonic()
    project.engine.run("kill", container)

    at_kill = meter.readings[-1][1]
    progress: list[float] = []  # when the first microbatch after the kill was seen

    def recovered() -> float | None:
        rate = meter.read()
        if not progress and meter.readings[-1][1] > at_kill:
            progress.append(time.monotonic() - killed_at)
        fresh = meter.readings[-1][0] - killed_at >= RATE_WINDOW  # all of it after the kill
        return rate if fresh and rate is not None and rate >= RECOVERED * before else None

    after = wait_for(f"the throughput back to {RECOVERED:.0%} of {before:.1f} microbatches/s",
                     recovered, RECOVERY_DEADLINE, interval=1.0,
                     debug=project.logs)  # fmt: skip
    metrics["recovered_s"] = round(time.monotonic() - killed_at, 1)  # (>= RATE_WINDOW)
    metrics["first_microbatch_after_kill_s"] = round(progress[0], 1)
    metrics["microbatches_per_s"] = {"before": round(before, 1), "after_kill": round(after, 1)}
    assert not project.engine.inspect("container", container)["State"]["Running"]  # no restart

    # The trainers route around the dead peer: it is on their pages as banned.
    def victim_banned() -> bool:
        return any(
            victim_id in {b["peer_id"] for b in project.status(t)["pipeline"]["bans"]}
            for t in TRAINERS
        )

    wait_for("a trainer to show the killed peer as banned", victim_banned, 20, interval=1.0)

    # A trainer killed: the other trains on.
    project.engine.run("kill", project.container("pipe-trainer2"))
    alone = Throughput(project, ["pipe-trainer1"])
    alone.read()
    survivor = wait_for("the other trainer to go on alone", alone.read, RECOVERY_DEADLINE,
                        interval=1.0, debug=project.logs)  # fmt: skip
    metrics["microbatches_per_s"]["one_trainer"] = round(survivor, 1)
    metrics["total_s"] = round(time.monotonic() - started, 1)
    print(f"container-metrics: {json.dumps({'compose_pipeline': metrics})}")
