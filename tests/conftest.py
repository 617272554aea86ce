"""Shared fixtures: hosts on loopback, run on uvloop like the daemon."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest
import uvloop

from shoal.transport.host import Host, HostConfig
from shoal.transport.identity import Identity

LOOPBACK = ("/ip4/127.0.0.1/tcp/0",)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `gpu` are skipped, with the reason, where torch sees no CUDA GPU."""
    if not any(item.get_closest_marker("gpu") for item in items):
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; torch sees none here")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


def pytest_asyncio_loop_factories(config: object, item: object) -> dict[str, object]:
    return {"uvloop": uvloop.new_event_loop}


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
async def pair(make_host: Callable[..., asyncio.Future[Host]]) -> tuple[Host, Host]:
    """Two started hosts; the first will dial the second."""
    return await make_host(), await make_host()
