"""Protocol versions: peers say theirs at connection, and incompatible ones are told why.

In-process hosts on loopback, each with its own (patched) protocol version: the
compatibility rule, both sides' warnings, the dialer's error, the streams of an
incompatible peer, software from before versions, and what /status, /metrics and
`shoal status` show.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any

import aiohttp
import msgpack
import pytest
from waiting import eventually

from shoal.dht.node import BootstrapError, DHTNode
from shoal.peer.status.cli import format_status
from shoal.peer.status.metrics import Metrics
from shoal.peer.status.server import StatusServer
from shoal.transport import host as host_module
from shoal.transport.errors import ConnectionLost, DialError, StreamReset
from shoal.transport.host import Host
from shoal.transport.identity import Identity, PeerID
from shoal.transport.version import (
    HELLO_PROTOCOL,
    PROTOCOL_VERSION,
    SOFTWARE_VERSION,
    Hello,
    IncompatibleProtocol,
    MismatchLog,
    ProtocolVersion,
    agent,
    compatible,
    refusal_message,
)

pytestmark = pytest.mark.timeout(30)

ECHO = "/shoal/test-echo/1.0.0"
LOGGER = "shoal.transport.version"
UPGRADE = "pip install -U shoal"


def hello(major: int, minor: int = 0, *, oldest: int | None = None, software: str = "") -> Hello:
    return Hello(
        ProtocolVersion(major, minor),
        major if oldest is None else oldest,
        software or f"shoal {major}.{minor}.7",
    )


async def echo(stream: Any) -> None:
    await stream.write(await stream.read())


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelname == "WARNING"]


@pytest.fixture
async def versioned(
    make_host: Callable[..., Any],
) -> Callable[[Hello], Any]:
    """A started host on loopback speaking `hello`, serving ECHO."""

    async def make(said: Hello) -> Host:
        host = await make_host()
        host.versions.local = said
        host.set_handler(ECHO, echo)
        return host

    return make


async def closed_between(a: Host, b: Host) -> None:
    await eventually(lambda: not a.open_connections() and not b.open_connections(), "closed")


# --- the rule -----------------------------------------------------------------------------------


def test_same_major_is_compatible_whatever_the_minors() -> None:
    assert compatible(hello(1, 0), hello(1, 7))
    assert compatible(hello(3, 2), hello(3, 2))
    assert not compatible(hello(1, 9), hello(2, 0))
    assert not compatible(hello(2, 0), hello(1, 9))  # symmetric


def test_a_release_that_still_speaks_an_older_major_is_compatible_with_it() -> None:
    assert compatible(hello(2, 0, oldest=1), hello(1, 4))
    assert compatible(hello(1, 4), hello(2, 0, oldest=1))
    assert not compatible(hello(3, 0, oldest=2), hello(1, 4))


def test_the_protocol_version_is_not_the_package_version_and_the_agent_names_both() -> None:
    assert Hello().protocol == PROTOCOL_VERSION
    assert agent() == f"shoal/{SOFTWARE_VERSION} protocol/{PROTOCOL_VERSION}"
    from shoal.transport.nat.config import NatConfig

    assert NatConfig().agent == agent()


def test_a_hello_ignores_unknown_keys_and_rejects_malformed_ones() -> None:
    wire = {**hello(1, 2).to_wire(), "later": {"feature": True}}
    assert Hello.from_wire(wire) == hello(1, 2)
    assert Hello.from_wire({"protocol": [4, 1]}).oldest == 4  # optional fields default
    for bad in (
        [1, 0],
        {"protocol": "1.0"},
        {"protocol": [1]},
        {"protocol": [1, -1]},
        {"protocol": [True, 0]},
        {"protocol": [1, 0], "oldest": 2},  # older than itself cannot be newer
        {"protocol": [1, 0], "software": 7},
    ):
        with pytest.raises(ValueError):
            Hello.from_wire(bad)
    # Another peer's words end up in logs and on the status page: printable and bounded.
    odd = Hello.from_wire({"protocol": [1, 0], "software": "shoal\x1b[2J\n" + "x" * 500})
    assert odd.software.startswith("shoal?[2J?xx") and len(odd.software) == 64


def test_the_refusal_fits_a_reset_reason_and_is_written_for_its_reader() -> None:
    ours, theirs = hello(2, 1, software="shoal 0.3.0"), hello(1, 0, software="shoal 0.1.0")
    told = refusal_message(ours, theirs)  # what the 1.0 peer reads: it must upgrade
    assert len(told.encode()) <= 256
    assert "this peer speaks 1.0 (shoal 0.1.0)" in told and "2.1 (shoal 0.3.0)" in told
    assert f"upgrade this peer: {UPGRADE}" in told


def test_the_mismatch_log_counts_every_connection_warns_once_per_peer_and_is_bounded() -> None:
    seen = MismatchLog(max_entries=2, warn_interval=600)
    ours = hello(1)
    p, q, r = (Identity.generate().peer_id for _ in range(3))
    assert seen.record(p, ours, hello(2), now=0.0, wall=100.0)
    assert not seen.record(p, ours, hello(2), now=10.0, wall=110.0)  # rate-limited
    assert seen.record(p, ours, hello(2), now=700.0, wall=800.0)  # ... per interval
    assert seen.record(q, ours, hello(3), now=701.0, wall=801.0)  # per peer
    (latest, first) = seen.entries()
    assert (latest.peer, first.peer) == (q, p)
    assert (first.count, first.first_seen, first.last_seen) == (3, 100.0, 800.0)
    seen.record(r, ours, hello(2), now=702.0, wall=802.0)
    assert [m.peer for m in seen.entries()] == [r, q]  # the oldest went
    assert seen.total == 5


# --- on the wire --------------------------------------------------------------------------------


async def test_compatible_minors_connect_and_each_learns_the_others_version(versioned) -> None:
    a, b = await versioned(hello(1, 0)), await versioned(hello(1, 3))
    conn = await a.connect(b.addresses()[0])
    stream = await conn.open_stream(ECHO)
    await stream.write(b"minor")
    await stream.close()
    assert await stream.read() == b"minor"
    assert a.versions.peer_version(b.peer_id) == hello(1, 3)  # features: check its minor
    await eventually(lambda: b.versions.peer_version(a.peer_id) is not None, "b read a's hello")
    assert b.versions.peer_version(a.peer_id) == hello(1, 0)
    assert a.versions.describe(conn) == "1.3"
    assert a.versions.status()["version_mismatches"] == []
    assert HELLO_PROTOCOL not in a.protocols  # the host's own business


@pytest.mark.parametrize("dialer_is_older", [True, False])
async def test_an_incompatible_peer_is_refused_on_both_sides_naming_both_versions(
    versioned, caplog: pytest.LogCaptureFixture, dialer_is_older: bool
) -> None:
    old, new = hello(1, 4, software="shoal 0.1.0"), hello(2, 0, software="shoal 0.3.0")
    a, b = (
        await versioned(old if dialer_is_older else new),
        await versioned(new if dialer_is_older else old),
    )
    older, newer = (a, b) if dialer_is_older else (b, a)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        with pytest.raises(IncompatibleProtocol) as raised:
            await a.connect(b.addresses()[0])
        await closed_between(a, b)
        await eventually(lambda: len(warnings(caplog)) == 2, "a warning on each side")
    error = str(raised.value)  # the dialer's, from its own point of view
    assert "1.4 (shoal 0.1.0)" in error and "2.0 (shoal 0.3.0)" in error
    assert isinstance(raised.value, DialError) and raised.value.theirs == (b.versions.local)
    if dialer_is_older:
        assert f"upgrade this peer: {UPGRADE}" in error
    else:
        assert "the other peer runs an older shoal and must upgrade" in error
    by_side = {
        older: f"upgrade this peer: {UPGRADE}",
        newer: "the other peer runs an older shoal and must upgrade",
    }
    for side, action in by_side.items():
        other = b if side is a else a
        (line,) = [w for w in warnings(caplog) if str(other.peer_id) in w]
        assert "1.4 (shoal 0.1.0)" in line and "2.0 (shoal 0.3.0)" in line and action in line
        (entry,) = side.versions.status()["version_mismatches"]
        assert entry["peer_id"] == str(other.peer_id) and entry["action"].startswith(action)
        assert (entry["ours"], entry["theirs"]) == (
            str(side.versions.local.protocol),
            str(other.versions.local.protocol),
        )


async def test_streams_an_incompatible_peer_opens_anyway_fail_with_the_reason(
    versioned, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = await versioned(hello(2)), await versioned(hello(1))

    async def no_wait(conn: Any, timeout: float) -> Any:
        return conn  # an application that uses the connection before the hello is read

    monkeypatch.setattr(a.versions, "checked", no_wait)
    conn = await a.connect(b.addresses()[0])
    stream = await conn.open_stream(ECHO)  # right behind our hello: held by b, then refused
    with pytest.raises((StreamReset, ConnectionLost)) as raised:
        await stream.write(b"x")
        await stream.read()
    assert "2.0" in str(raised.value) and "1.0" in str(raised.value)
    await closed_between(a, b)
    assert conn.close_reason is not None and "incompatible peer" in conn.close_reason


async def test_repeated_dials_are_all_refused_and_counted_with_one_warning_per_peer(
    versioned, caplog: pytest.LogCaptureFixture
) -> None:
    a, b = await versioned(hello(1)), await versioned(hello(2))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for _ in range(3):
            with pytest.raises(IncompatibleProtocol):
                await a.connect(b.addresses()[0])
            await closed_between(a, b)
    assert len(warnings(caplog)) == 2  # one per side, not one per dial
    for side in (a, b):
        status = side.versions.status()
        assert status["version_mismatches_total"] == 3
        assert status["version_mismatches"][0]["count"] == 3


class _NoVersions:
    """What software from before protocol versions looks like: no hello, no checks."""

    def __init__(self, host: Host, dispatch: Callable[..., None]) -> None:
        self.local = None

    def hold(self, stream: Any) -> bool:
        return False  # the hello is an unknown protocol, refused as such

    async def checked(self, conn: Any, timeout: float) -> Any:
        return conn


async def test_a_peer_without_versions_is_recorded_as_unknown_and_served_both_ways(
    versioned, make_host, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with monkeypatch.context() as patch:
        patch.setattr(host_module, "VersionGate", _NoVersions)
        old = await make_host()
    old.set_handler(ECHO, echo)
    new, dialed_by_old = await versioned(hello(1)), await versioned(hello(1))
    with caplog.at_level(logging.INFO, logger=LOGGER):
        # New dials old: the hello is refused as unknown; the dial succeeds.
        conn = await new.connect(old.addresses()[0])
        assert new.versions.describe(conn) == "unknown"
        assert new.versions.peer_version(old.peer_id) is None
        # Old dials new: its first stream is not a hello; it is served at once.
        stream = await old.open_stream(dialed_by_old.addresses()[0], ECHO)
        await stream.write(b"from before")
        await stream.close()
        assert await stream.read() == b"from before"
    for side in (new, dialed_by_old):
        status = side.versions.status()
        assert status["peers_without_version"] == 1 and status["version_mismatches"] == []
    assert not warnings(caplog)
    assert any("from before protocol versions" in r.getMessage() for r in caplog.records)
    assert new.connection(old.peer_id) is conn and conn.is_open  # not disconnected


async def test_a_garbled_hello_closes_the_connection(versioned, make_host) -> None:
    a = await versioned(hello(1))
    b = await versioned(hello(1))
    conn = await a.connect(b.addresses()[0])
    theirs = b.connection(a.peer_id)
    assert theirs is not None
    # A second hello on the same connection, unreadable: a broken peer, not a version.
    stream = await conn.open_stream(HELLO_PROTOCOL)
    await stream.write(msgpack.packb({"protocol": "one"}))
    await stream.close()
    await eventually(lambda: not conn.is_open, "the connection closed")
    assert "bad hello" in str(theirs.close_reason)


# --- what people see ----------------------------------------------------------------------------


class _VersionsOnly:
    """A StatusProvider that knows only the host's versions (the daemon adds the rest)."""

    def __init__(self, host: Host) -> None:
        self.host = host

    def status(self) -> dict[str, Any]:
        return {"peer_id": str(self.host.peer_id), **self.host.versions.status()}

    async def peers(self) -> list[dict[str, Any]]:
        return []

    def history(self) -> list[dict[str, Any]]:
        return []

    def swarm(self) -> dict[str, Any]:
        return {"peers": {}, "self": str(self.host.peer_id)}


async def test_status_metrics_and_the_cli_show_the_mismatches(versioned) -> None:
    a, b = await versioned(hello(1)), await versioned(hello(2, 1, software="shoal 0.3.0"))
    for _ in range(2):
        with pytest.raises(IncompatibleProtocol):
            await a.connect(b.addresses()[0])
    provider = _VersionsOnly(a)
    async with (
        StatusServer(provider, Metrics(provider), port=0) as server,
        aiohttp.ClientSession() as http,
    ):
        async with http.get(server.url + "/status") as response:
            status = json.loads(await response.text())
        async with http.get(server.url + "/metrics") as response:
            metrics = await response.text()
    assert status["protocol_version"] == "1.0" and status["version_mismatches_total"] == 2
    (entry,) = status["version_mismatches"]
    assert {k: entry[k] for k in ("peer_id", "theirs", "ours", "software", "count")} == {
        "peer_id": str(b.peer_id),
        "theirs": "2.1",
        "ours": "1.0",
        "software": "shoal 0.3.0",
        "count": 2,
    }
    assert entry["first_seen"] <= entry["last_seen"]
    assert "shoal_version_mismatches_total 2.0" in metrics
    text = format_status(status, [], server.url)
    assert "protocol version mismatches (1 peer, 2 connections refused)" in text
    (row,) = [line for line in text.splitlines() if str(b.peer_id) in line]
    assert "2.1" in row and "shoal 0.3.0" in row and f"upgrade this peer: {UPGRADE}" in row


def test_the_cli_shows_the_protocol_and_no_mismatch_table_when_there_is_none() -> None:
    peer = str(PeerID.from_public_key(Identity.generate().public_key_bytes))
    status = {"peer_id": peer, "protocol_version": "1.0", "peers_without_version": 2}
    text = format_status(status, [], "http://127.0.0.1:8080")
    assert "protocol      1.0 (2 connected peers run shoal from before protocol versions)" in text
    assert "mismatch" not in text
    assert "protocol" in format_status({"peer_id": peer}, [], "x")  # an older daemon: "-"


async def test_the_hello_costs_no_round_trip_to_a_peer_that_already_spoke(versioned) -> None:
    a, b = await versioned(hello(1)), await versioned(hello(1))
    first = await a.connect(b.addresses()[0])
    again = await asyncio.wait_for(a.connect(b.peer_id), 1.0)  # known: no waiting
    assert again is first


HOSTILE = '<img src=x onerror="document.body.dataset.pwned = 1">'
CARD_STATE = """
const card = document.getElementById('version-mismatches');
return {
  shown: !card.hidden && card.getBoundingClientRect().height > 0,
  rows: [...document.querySelectorAll('#mismatches tbody tr')].map((r) => r.dataset.peerId),
  text: card.textContent,
  brand: document.getElementById('shoal-version').textContent,
  images: card.querySelectorAll('img').length,
  pwned: document.body.dataset.pwned !== undefined,
};
"""


@pytest.mark.timeout(60)
async def test_the_status_page_shows_a_warning_card_with_what_to_do(versioned, tmp_path) -> None:
    page = pytest.importorskip("test_status_page_browser")  # its chromium and helpers
    page._need_browser()
    a, b = await versioned(hello(1)), await versioned(hello(2, software=HOSTILE))
    with pytest.raises(IncompatibleProtocol):
        await a.connect(b.addresses()[0])
    provider = _VersionsOnly(a)
    async with StatusServer(provider, Metrics(provider), port=0) as server:
        driver = await asyncio.to_thread(page._start_chromium, tmp_path / "profile")
        try:
            await asyncio.to_thread(driver.get, server.url + "/")
            state = await page.wait_for(
                driver, CARD_STATE, lambda s: s["shown"] and s["rows"], "the warning card"
            )
        finally:
            await asyncio.to_thread(driver.quit)
    assert state["rows"] == [str(b.peer_id)]
    assert "upgrade this peer (pip install -U shoal)" in state["text"]
    assert HOSTILE in state["text"] and not state["images"] and not state["pwned"]
    assert "protocol 1.0" in state["brand"]


async def test_a_dht_bootstrap_to_an_incompatible_peer_stops_at_the_first_try(
    versioned, caplog: pytest.LogCaptureFixture
) -> None:
    newer = await versioned(hello(2, 0, software="shoal 0.3.0"))
    older = await versioned(hello(1, 0, software="shoal 0.1.0"))
    with caplog.at_level(logging.INFO, logger="shoal.dht"), pytest.raises(BootstrapError) as raised:
        await DHTNode.create(
            older, bootstrap=[str(newer.addresses()[0])], bootstrap_attempts=3,
            bootstrap_backoff=5.0,
            # (A dial that times out is retried, rightly; on a loaded machine the default
            # 1 s hop could, and this test is about the answer, not the clock.)
            hop_timeout=10.0,
        )  # fmt: skip
    assert "2.0 (shoal 0.3.0)" in str(raised.value)
    tries = [r for r in caplog.records if "bootstrap peer" in r.getMessage()]
    assert len(tries) == 1, [r.getMessage() for r in tries]
