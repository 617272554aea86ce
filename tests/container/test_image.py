"""The image from docker/Dockerfile: what it declares and where a peer keeps its identity."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from docker_harness import BUILD_TIMEOUT, ContainerSet, Engine

pytestmark = [pytest.mark.container, pytest.mark.slow, pytest.mark.timeout(BUILD_TIMEOUT + 120)]


def test_image_runs_shoal_run_as_a_non_root_user_with_ports_volume_and_healthcheck(
    engine: Engine, image: str
) -> None:
    config = engine.inspect("image", image)["Config"]
    assert config["Entrypoint"] == ["shoal", "run"]
    assert config["User"] == "shoal"
    assert list(config["Volumes"]) == ["/data"]
    assert set(config["ExposedPorts"]) == {"31337/tcp", "8080/tcp"}
    env = dict(item.split("=", 1) for item in config["Env"])
    assert env["SHOAL_DATA_DIR"] == "/data"
    assert env["SHOAL_STATUS_ADDR"] == "0.0.0.0:8080"  # reachable through a published port
    # podman's Docker API leaves Healthcheck out of `inspect`; the history has the instruction.
    history = engine.out("history", "--no-trunc", "--format", "{{.CreatedBy}}", image)
    assert "HEALTHCHECK" in history and "shoal-healthcheck" in history


def test_the_code_is_read_only_for_the_user_that_runs_it(engine: Engine, image: str) -> None:
    probe = "id -u; test -w /opt/shoal/bin && echo writable || echo read-only"
    out = engine.out("run", "--rm", "--entrypoint", "sh", image, "-c", probe)
    assert out.splitlines() == ["10001", "read-only"]


def test_the_identity_lives_in_the_volume_and_survives_new_containers(
    containers: ContainerSet, image: str
) -> None:
    volume = containers.volume("identity")
    first = containers.one_off("shoal", "id", volume=volume)
    second = containers.one_off("shoal", "id", volume=volume)
    assert first.startswith("12D3KooW")
    assert second == first
    modes = containers.one_off(
        "stat",
        "-c",
        "%a %U %n",
        "/data",
        "/data/identity.key",
        volume=volume,
    )
    assert modes.splitlines() == ["700 shoal /data", "600 shoal /data/identity.key"]
    assert containers.one_off("shoal", "id", volume=containers.volume("other")) != first
