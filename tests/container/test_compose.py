"""docker/compose.yaml: `docker-compose up` gives a local swarm whose status pages answer,
and its `nat` profile adds a joiner behind a NAT router that trains with the others."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from docker_harness import (
    BUILD_TIMEOUT,
    CALL_TIMEOUT,
    COMPOSE_FILE,
    PEER_ENV,
    QUICK_ROUNDS,
    Engine,
    EngineError,
    committed,
    compose_command,
    compose_unavailable,
    get_json,
    wait_for,
)

pytestmark = [pytest.mark.container, pytest.mark.slow, pytest.mark.timeout(BUILD_TIMEOUT + 400)]

PUBLISHED = ("host", "joiner1", "joiner2")  # services with a status port on 127.0.0.1
START_TIMEOUT = 90.0
ROUND_TIMEOUT = 120.0


class ComposeProject:
    """docker-compose on docker/compose.yaml under a unique project name."""

    def __init__(self, engine: Engine, image: str, router_image: str) -> None:
        self.engine = engine
        self.name = f"shoal-test-{uuid.uuid4().hex[:6]}"
        self.ports = {service: _free_port() for service in PUBLISHED}
        self.env = {
            **QUICK_ROUNDS,
            **PEER_ENV,
            "SHOAL_IMAGE": image,
            "SHOAL_NAT_ROUTER_IMAGE": router_image,
            "SHOAL_HOST_STATUS_PORT": str(self.ports["host"]),
            "SHOAL_JOINER1_STATUS_PORT": str(self.ports["joiner1"]),
            "SHOAL_JOINER2_STATUS_PORT": str(self.ports["joiner2"]),
        }

    def run(self, *args: str, timeout: float = CALL_TIMEOUT, check: bool = True) -> str:
        command = [*(compose_command() or []), "--project-name", self.name]
        command += ["--file", str(COMPOSE_FILE), "--profile", "nat", *args]
        done = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**_without_shoal_variables(), **self.env},
            check=False,
        )
        if check and done.returncode != 0:
            raise EngineError(f"{' '.join(command)}: {done.returncode}\n{done.stderr.strip()}")
        return done.stdout.strip()

    def container(self, service: str) -> str:
        return self.run("ps", "--quiet", service).splitlines()[0]

    def status(self, service: str) -> dict[str, Any]:
        if service in self.ports:
            return get_json(f"http://127.0.0.1:{self.ports[service]}/status")  # type: ignore[no-any-return]
        # Behind the NAT nothing is published: ask from inside its network namespace.
        fetch = (
            "import sys, urllib.request; "
            "sys.stdout.write(urllib.request.urlopen('http://127.0.0.1:8080/status', "
            "timeout=3).read().decode())"
        )
        out = self.engine.out("exec", self.container(service), "python3", "-c", fetch)
        return json.loads(out)  # type: ignore[no-any-return]

    def logs(self) -> str:
        return self.run("logs", "--no-color", "--tail", "40", check=False)

    def down(self) -> None:
        """Remove the project's containers, networks and volumes, whatever state they are in."""
        self.run("down", "--volumes", "--timeout", "10", timeout=120, check=False)
        # A container sharing another's network namespace can make the first `down`
        # fail to remove that other one (podman); clear what is left by label.
        label = f"label=com.docker.compose.project={self.name}"
        left = self.engine.out("ps", "--all", "--quiet", "--filter", label).split()
        if left:
            self.engine.run("rm", "--force", "--volumes", *left, check=False)
            self.run("down", "--volumes", "--timeout", "10", timeout=120, check=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _without_shoal_variables() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")}


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
    created = ComposeProject(engine, image, router_image)
    try:
        yield created
    finally:
        created.down()


def test_compose_up_gives_a_swarm_with_status_pages_and_a_trained_peer_behind_nat(
    project: ComposeProject,
) -> None:
    project.run("up", "--detach", "--no-build", timeout=180)

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
