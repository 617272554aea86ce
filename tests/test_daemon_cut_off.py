"""A restarted peer whose bootstrap peers are all out of reach.

A peer that was in the network before (its data directory keeps the peers it
knew) is cut off, not misconfigured: it starts anyway, and its DHT joins again
through the bootstrap peers once they answer. A first start with an address
nobody answers at fails fast, naming the address (a typo is the likely cause).
(The CI soak restarted a peer during a partition; it exited with "could not
reach any of 3 bootstrap peers" and stayed down.)
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from shoal.peer import daemon
from shoal.peer.config import Config
from shoal.peer.daemon import KNOWN_PEERS_FILE, StartupError, _start_dht
from shoal.transport.host import Host

pytestmark = pytest.mark.timeout(60)

HOST_OPTS = {"max_connections_per_ip": 100_000, "close_grace": 0.1}
NAT = SimpleNamespace(serves_dht=True)


@pytest.fixture
async def gone_address(make_host: Callable[..., Any]) -> str:
    """The full address of a peer that was there and is not any more."""
    other: Host = await make_host(**HOST_OPTS)
    address = str(other.addresses()[0])
    await other.aclose()
    return address


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(daemon, "BOOTSTRAP_ATTEMPTS", 2)
    monkeypatch.setattr(daemon, "BOOTSTRAP_BACKOFF", 0.05)


async def test_a_peer_that_was_in_the_network_starts_cut_off(
    make_host: Callable[..., Any],
    gone_address: str,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    (tmp_path / KNOWN_PEERS_FILE).write_text(json.dumps([gone_address]))
    config = Config(data_dir=tmp_path, bootstrap=(daemon.Multiaddr(gone_address),))
    host: Host = await make_host(**HOST_OPTS)
    caplog.set_level(logging.INFO, logger="shoal.dht")
    dht, _ = await _start_dht(host, config, NAT, None)  # type: ignore[arg-type]
    try:
        assert len(dht.routing_table) == 0
        assert "starting cut off, joining through them again every 30s" in caplog.text
    finally:
        await dht.aclose()


async def test_a_first_start_with_nobody_at_the_address_fails_fast(
    make_host: Callable[..., Any], gone_address: str, tmp_path: Path
) -> None:
    config = Config(data_dir=tmp_path, bootstrap=(daemon.Multiaddr(gone_address),))
    host: Host = await make_host(**HOST_OPTS)
    with pytest.raises(StartupError, match="check the --bootstrap"):
        await _start_dht(host, config, NAT, None)  # type: ignore[arg-type]


async def test_a_peer_that_joined_keeps_the_peers_it_knows_at_once(
    make_host: Callable[..., Any], tmp_path: Path
) -> None:
    """Saved when it joins, not only at a graceful stop: a kill -9 keeps them too."""
    first: Host = await make_host(**HOST_OPTS)
    root, _ = await _start_dht(first, Config(data_dir=tmp_path / "root"), NAT, None)  # type: ignore[arg-type]
    host: Host = await make_host(**HOST_OPTS)
    bootstrap = (first.addresses()[0].with_peer_id(first.peer_id),)
    config = Config(data_dir=tmp_path / "joiner", bootstrap=bootstrap)
    config.data_dir.mkdir()
    dht, _ = await _start_dht(host, config, NAT, None)  # type: ignore[arg-type]
    try:
        assert daemon.load_known_peers(config.data_dir)
    finally:
        await dht.aclose()
        await root.aclose()
