"""Shared fixtures: hosts on loopback, run on uvloop like the daemon."""

from __future__ import annotations

import asyncio
import os
import random
import sys
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import uvloop
from cpu_report import pytest_runtest_protocol
from timeouts import pytest_timeout_cancel_timer, pytest_timeout_set_timer, tracked

from shoal.transport.host import Host, HostConfig
from shoal.transport.identity import Identity

# pytest-timeout's hooks: a test past its timeout fails instead of ending its worker
# (which would hang xdist's loadgroup scheduler); see tests/timeouts.py.
# (and cpu_report's: each test's CPU time beside its wall time, when asked for)
__all__ = ["pytest_runtest_protocol", "pytest_timeout_cancel_timer", "pytest_timeout_set_timer"]

LOOPBACK = ("/ip4/127.0.0.1/tcp/0",)

if "PYTEST_XDIST_WORKER" in os.environ:
    # Two workers share the cores: torch's intra-op threads, one per core in each
    # worker and in each daemon a test starts, would oversubscribe them, and
    # spinning OpenMP threads made a 2 s training test take 72 s beside a swarm.
    # (Set before torch loads; inherited by the processes tests start.)
    os.environ.setdefault("OMP_NUM_THREADS", "1")


# Tests that keep both cores busy (swarms of daemons or processes, containers, the
# soak: those marked `slow` or `container`) run one after another on one xdist worker
# (pyproject: `-n 2 --dist loadgroup`); the quick ones and the lab's own run beside
# them on the other. Two such swarms at once would each see half the machine, and
# their deadlines (the soak's commit gap) are about a swarm, not a scheduler.
ONE_AT_A_TIME = pytest.mark.xdist_group("one-at-a-time")


@pytest.hookimpl(tryfirst=True)  # (before xdist reads the groups)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Slow tests join the one-at-a-time group; tests marked `gpu` are skipped, with the
    reason, where torch sees no CUDA GPU."""
    for item in items:
        if item.get_closest_marker("slow") or item.get_closest_marker("container"):
            item.add_marker(ONE_AT_A_TIME)
    if not any(item.get_closest_marker("gpu") for item in items):
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; torch sees none here")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


def pytest_collection_finish(session: pytest.Session) -> None:
    """On an xdist worker of `--dist loadgroup`: the groups must have applied (xdist
    names a grouped test `...@group`), or slow tests run two at once and their swarms
    see half the machine (pytest 9.2.0 derives a node's ID anew and ignores the name
    xdist 3.8.0 sets: two compose projects clashed). Refused at once, not flaky."""
    if not session.config.getoption("loadgroup", False):  # (xdist sets it on its workers)
        return
    ungrouped = [i.nodeid for i in session.items
                 if i.get_closest_marker("xdist_group") and "@" not in i.nodeid]  # fmt: skip
    if ungrouped:
        why = (
            f"pytest-xdist did not group {len(ungrouped)} tests ({ungrouped[0]}, ...): "
            "this pytest and pytest-xdist do not work together (pyproject pins pytest)"
        )
        print(why, file=sys.stderr, flush=True)  # (a worker's error reaches the controller garbled)
        raise pytest.UsageError(why)


def pytest_asyncio_loop_factories(config: object, item: object) -> dict[str, object]:
    return {"uvloop": tracked(uvloop.new_event_loop)}


@pytest.fixture
async def make_host() -> AsyncIterator[Callable[..., asyncio.Future[Host]]]:
    """Factory of started hosts on 127.0.0.1 (random ports), all closed at teardown."""
    hosts: list[Host] = []

    async def make(**config: object) -> Host:
        config.setdefault("listen", LOOPBACK)
        host = Host(Identity.generate(), HostConfig(**config))  # type: ignore[arg-type]
        await host.start()
        hosts.append(host)
        return host

    yield make  # type: ignore[misc]
    await asyncio.gather(*(h.aclose() for h in hosts), return_exceptions=True)


@pytest.fixture
async def dht_swarm(
    make_host: Callable[..., asyncio.Future[Host]],
) -> AsyncIterator[Callable[..., Any]]:
    """Factory of DHT nodes on loopback hosts, each bootstrapped from one made before
    (`await dht_swarm(n, **DHTNode.create options)`), all closed at teardown."""
    from shoal.dht.node import DHTNode

    nodes: list[DHTNode] = []
    opts = {"max_connections_per_ip": 100_000, "max_connections": 100_000, "close_grace": 0.1}

    async def make(n: int, **options: Any) -> list[DHTNode]:
        out = []
        for _ in range(n):
            host = await make_host(**opts)
            boot = [str(random.choice(nodes).host.addresses()[0])] if nodes else []
            node = await DHTNode.create(host, bootstrap=boot, hop_timeout=1.0, **options)
            nodes.append(node)
            out.append(node)
        return out

    yield make
    await asyncio.gather(*(n.aclose() for n in nodes), return_exceptions=True)


@pytest.fixture
async def pair(make_host: Callable[..., asyncio.Future[Host]]) -> tuple[Host, Host]:
    """Two started hosts; the first will dial the second."""
    return await make_host(), await make_host()
