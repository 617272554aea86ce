"""Fixtures of the container tests: the engine (or a skip saying why there is none), the
image built once per session from the checkout, and a set of containers that is
always removed, with every container's log printed when the test failed."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from docker_harness import ContainerSet, Engine, container_set, engine_unavailable


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "container: builds docker/Dockerfile and runs containers (needs docker or podman; "
        "as root, ../shared/lab/containers.sh up provides one)",
    )


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> object:
    report = yield
    setattr(item, f"report_{report.when}", report)  # the containers fixture reads it
    return report


@pytest.fixture(scope="session")
def engine() -> Engine:
    reason = engine_unavailable()
    if reason:
        pytest.skip(reason)
    return Engine()


@pytest.fixture(scope="session")
def image(engine: Engine) -> str:
    """The image built from this checkout (layers cached between sessions)."""
    from docker_harness import IMAGE, PREBUILT_IMAGE

    if PREBUILT_IMAGE:
        return PREBUILT_IMAGE
    seconds = engine.build_image(IMAGE)
    size_mb = engine.image_size(IMAGE) / 1e6
    metrics = {"build_s": round(seconds, 1), "image_mb": round(size_mb)}
    print(f"container-metrics: {json.dumps(metrics)}")
    return IMAGE


@pytest.fixture
def containers(engine: Engine, request: pytest.FixtureRequest) -> Iterator[ContainerSet]:
    label = request.node.name.removeprefix("test_")[:20].rstrip("_").replace("_", "-")
    with container_set(engine, label) as created:
        yield created
        call = getattr(request.node, "report_call", None)
        if call is not None and call.failed:
            for container in created.containers:
                print(f"--- logs of {container.name} ---\n{container.logs()}")
