"""A swarm from plain `docker run`: a host and two joiners on a user-defined network.

The issue's acceptance run: every peer's /status shows the same experiment and
a committed averaging round; after `docker kill` of a joiner the other two go
on; `docker stop` of the host shuts it down gracefully within docker's grace
period with a checkpoint in its volume; the restarted container has the same
peer ID and resumes from that checkpoint.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from docker_harness import (
    BUILD_TIMEOUT,
    P2P_PORT,
    PEER_ENV,
    QUICK_ROUNDS,
    Container,
    ContainerSet,
    committed,
    wait_for,
)

pytestmark = [pytest.mark.container, pytest.mark.slow, pytest.mark.timeout(BUILD_TIMEOUT + 300)]

# docker's default grace period is 10 s; a graceful stop must leave a good margin.
STOP_BUDGET = 8.0
START_TIMEOUT = 60.0
ROUND_TIMEOUT = 90.0


def agreed_round(peers: list[Container], group_size: int) -> dict[str, Any] | None:
    """A round that every peer reports as its last, committed, with the same fingerprint."""
    rounds = [committed(p.status(), group_size) for p in peers]
    if None in rounds:
        return None
    keys = {(r["outer_step"], r["fingerprint"]) for r in rounds}  # type: ignore[index]
    return rounds[0] if len(keys) == 1 else None


def test_docker_run_swarm_trains_survives_a_kill_and_a_stopped_host_restarts_as_itself(
    containers: ContainerSet,
    image: str,
    record_property: pytest.RecordProperty,
) -> None:
    network = containers.network("net")
    host_volume = containers.volume("host-data")
    started = time.monotonic()
    host = containers.run(
        "host", network=network, volume=host_volume, env={**QUICK_ROUNDS, **PEER_ENV}
    )
    host_status = wait_for(
        "the host's /status to name its experiment",
        lambda: (s := host.status())["experiment"] and s,
        START_TIMEOUT,
        debug=containers.debug,
    )
    host_id, experiment = host_status["peer_id"], host_status["experiment"]
    assert experiment == "default"  # `shoal run` with no options hosts the default experiment

    join = {
        "SHOAL_JOIN": f"{experiment}@{host_id}",
        "SHOAL_BOOTSTRAP": f"/dns4/{host.name}/tcp/{P2P_PORT}/p2p/{host_id}",
        **PEER_ENV,
    }
    joiners = [containers.run(f"joiner{i}", network=network, env=join) for i in (1, 2)]
    swarm = [host, *joiners]

    first = wait_for(
        "a round committed by all three peers",
        lambda: agreed_round(swarm, group_size=3),
        START_TIMEOUT + ROUND_TIMEOUT,
        debug=containers.debug,
    )
    to_first_round = time.monotonic() - started
    statuses = [p.status() for p in swarm]
    assert {s["experiment"] for s in statuses} == {"default"}
    assert len({s["peer_id"] for s in statuses}) == 3
    assert host.exec("shoal-healthcheck").returncode == 0  # the image's HEALTHCHECK command

    # docker kill (SIGKILL) of a joiner: the host and the other joiner go on without it.
    joiners[1].kill()
    after_kill = wait_for(
        "a round committed by the two survivors",
        lambda: agreed_round([host, joiners[0]], group_size=2),
        ROUND_TIMEOUT,
        debug=containers.debug,
    )
    assert after_kill["outer_step"] > first["outer_step"]

    # docker stop: SIGTERM, a checkpoint in the volume, exit 0 well inside the grace period.
    step_before_stop = host.status()["step"]
    stop_seconds = host.stop()
    state = host.state()
    assert state["ExitCode"] == 0, f"not a graceful exit: {state}\n{host.tail()}"
    assert stop_seconds < STOP_BUDGET, f"docker stop took {stop_seconds:.1f}s\n{host.tail()}"
    checkpoints = containers.one_off(
        "find", "/data/checkpoints", "-name", "*.pt", "-size", "+0", volume=host_volume
    )
    assert "latest.pt" in checkpoints, f"no checkpoint in the volume: {checkpoints!r}"

    # The same container, restarted: same peer ID (the key is in the volume), and
    # training resumes from the checkpoint rather than from step 0.
    host.start()
    restarted = wait_for(
        "the restarted host's /status with its step",
        lambda: (s := host.status())["step"] is not None and s,
        START_TIMEOUT,
        debug=host.tail,
    )
    assert restarted["peer_id"] == host_id
    assert restarted["experiment"] == experiment
    assert restarted["step"] >= step_before_stop

    metrics = {
        "to_first_round_s": round(to_first_round, 1),
        "docker_stop_s": round(stop_seconds, 2),
    }
    for key, value in metrics.items():
        record_property(key, value)
    print(f"container-metrics: {json.dumps(metrics)}")
