"""docker/compose.yaml: `docker-compose up` gives a local swarm whose status pages answer,
and its `nat` profile adds a joiner behind a NAT router that trains with the others."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from docker_harness import (
    BUILD_TIMEOUT,
    COMPOSE_FILE,
    PEER_ENV,
    QUICK_ROUNDS,
    ComposeProject,
    Engine,
    committed,
    compose_unavailable,
    wait_for,
)

pytestmark = [pytest.mark.container, pytest.mark.slow, pytest.mark.timeout(BUILD_TIMEOUT + 400)]

PUBLISHED = ("host", "joiner1", "joiner2")  # services with a status port on 127.0.0.1
STATUS_PORT_VARIABLES = {s: f"SHOAL_{s.upper()}_STATUS_PORT" for s in PUBLISHED}
START_TIMEOUT = 90.0
ROUND_TIMEOUT = 120.0


@pytest.fixture
def router_image(engine: Engine) -> str:
    """The nat profile's router image (Debian + iptables), built from docker/."""
    tag = "localhost/shoal-nat-router:test"
    engine.run(
        "build",
        "--file",
        str(COMPOSE_FILE.with_name("nat-router.Dockerfile")),
        "--tag",
        tag,
        str(COMPOSE_FILE.parent),
        timeout=300,
        env={"DOCKER_BUILDKIT": "0"},
    )
    return tag


@pytest.fixture
def project(engine: Engine, image: str, router_image: str) -> Iterator[ComposeProject]:
    reason = compose_unavailable()
    if reason:
        pytest.skip(reason)
    env = {**QUICK_ROUNDS, **PEER_ENV, "SHOAL_IMAGE": image, "SHOAL_NAT_ROUTER_IMAGE": router_image}
    created = ComposeProject(engine, "nat", STATUS_PORT_VARIABLES, env)
    try:
        yield created
    finally:
        created.down()


def test_compose_up_gives_a_swarm_with_status_pages_and_a_trained_peer_behind_nat(
    project: ComposeProject,
) -> None:
    project.up()

    def every_page_shows_a_committed_round() -> list[dict[str, Any]] | None:
        statuses = [project.status(service) for service in PUBLISHED]
        if all(s["experiment"] == "default" and committed(s) for s in statuses):
            return statuses
        return None

    statuses = wait_for(
        "the three status pages to show a committed round of the default experiment",
        every_page_shows_a_committed_round,
        START_TIMEOUT + ROUND_TIMEOUT,
        debug=project.logs,
    )
    assert len({s["peer_id"] for s in statuses}) == 3

    # The joiner behind the NAT: private (AutoNAT's verdict), reachable through relays,
    # and committing rounds with the others.
    def natted_peer_trains() -> dict[str, Any] | None:
        status = project.status("natted-joiner")
        last = committed(status)
        if last and last["group_size"] >= 2 and status["reachability"] == "private":
            return status
        return None

    natted = wait_for(
        "the NAT'd joiner to be private and commit a round with the others",
        natted_peer_trains,
        ROUND_TIMEOUT,
        debug=project.logs,
    )
    assert natted["experiment"] == "default"
    assert natted["peer_id"] not in {s["peer_id"] for s in statuses}
    assert any("/p2p-circuit/" in a for a in natted["addresses"]), natted["addresses"]
