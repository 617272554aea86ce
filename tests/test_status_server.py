"""The HTTP status endpoint, its Prometheus metrics and `shoal status`.

Every server here listens on 127.0.0.1 with port 0 and serves a fake provider
shaped like the daemon's (peer IDs from real identities, multiaddrs, a history
of samples). The rules tested: each endpoint's schema; errors as JSON without a
traceback; every handler bounded in time; a busy port as OSError; the address
syntax of --status-addr; and the terminal command against a live and a closed port.
"""

from __future__ import annotations

import asyncio
import io
import json
import math
import socket
import time
from collections.abc import AsyncIterator
from importlib import resources
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from shoal.peer import __version__
from shoal.peer.status.cli import status_command
from shoal.peer.status.metrics import Metrics
from shoal.peer.status.server import STATUS_KEYS, StatusServer, parse_status_addr
from shoal.transport.identity import Identity

pytestmark = pytest.mark.timeout(30)

PEERS_TIMEOUT = 0.5  # short, so that the hanging-provider test is quick
CLIENT_TIMEOUT = aiohttp.ClientTimeout(total=5)


class FakeProvider:
    """What the daemon's provider returns for a peer 40 steps into an experiment."""

    def __init__(self, n_peers: int = 3) -> None:
        self.ids = [str(Identity.generate().peer_id) for _ in range(n_peers + 1)]
        self.peer_id = self.ids[0]
        self.started = time.time() - 95.0
        self.loss: float | None = 2.25
        self.val_loss: float | None = 2.5
        self.step: int | None = 40
        self.status_calls = 0
        self.peers_calls = 0

    def addresses(self, peer_id: str, port: int) -> list[str]:
        return [
            f"/ip4/127.0.0.1/tcp/{port}/p2p/{peer_id}",
            f"/ip4/10.0.0.7/tcp/{port}/p2p/{peer_id}",
        ]

    def status(self) -> dict[str, Any]:
        self.status_calls += 1
        kinds = ("direct", "relayed", "holepunched")
        return {
            "peer_id": self.peer_id,
            "version": __version__,
            "addresses": self.addresses(self.peer_id, 31337),
            "reachability": "public",
            "connections": [
                {
                    "peer_id": pid,
                    "kind": kinds[i % 3],
                    "bytes_sent": 1000 * (i + 1),
                    "bytes_received": 2000 * (i + 1),
                }
                for i, pid in enumerate(self.ids[1:])
            ],
            "dht_peers": 7,
            "experiment": "bytegpt-tiny",
            "step": self.step,
            "loss": self.loss,
            "val_loss": self.val_loss,
            "tokens_per_s": 1234.5,
            "outer_step": 12,
            "last_commit_at": time.time() - 30,
            "device": {
                "kind": "cuda",
                "name": "NVIDIA L4",
                "memory_used_bytes": 3 * 2**30,
                "memory_total_bytes": 24 * 2**30,
            },
            "mfu": 0.25,
            "loop_lag_ms": {"p50_ms": 0.4, "p99_ms": 12.5, "max_ms": 80.0, "window_s": 60.0},
            "last_round": {
                "group_size": 4,
                "duration_s": 1.75,
                "outcome": "committed",
                "fingerprint": "9f2c41d0aa",
            },
            "bytes_sent": 123_456,
            "bytes_received": 654_321,
            "connections_trimmed": 12,
            "bytes_sent_by_protocol": {
                "/shoal/averaging/1.0.0": 100_000,
                "/shoal/dht/1.0.0": 20_000,
            },
            "uptime_s": time.time() - self.started,
            "config": {"listen": "/ip4/127.0.0.1/tcp/31337", "status_addr": "127.0.0.1:8080"},
            "verification": {
                "banned": [self.ids[3]],
                "convictions": [
                    {"peer": self.ids[3], "round": 9, "accusers": self.ids[1:3], "at": 1.0}
                ],
                "convicted_self": False,
                "rejected_evidence": 0,
                "enabled": True,
                "audits_done": 7,
                "audits_passed": 6,
                "audits_failed": 1,
                "shuns": 2,
                "probation": False,
            },
            "pipeline": {
                "stage": 1,
                "trainer": True,
                "stages": [
                    {"stage": 0, "peers": 2, "throughput": 410.5, "peer_ids": self.ids[1:3]},
                    {"stage": 1, "peers": 1, "throughput": None, "peer_ids": [self.peer_id]},
                ],
                "microbatches": 57,
            },
        }

    async def peers(self) -> list[dict[str, Any]]:
        self.peers_calls += 1
        now = time.time()
        return [
            {
                "peer_id": pid,
                "step": 40 - i,
                "loss": 2.25 + 0.01 * i,
                "val_loss": None if i == 3 else 2.5 + 0.01 * i,  # an older peer: none
                "tokens_per_s": 1200.0 + i,
                "addresses": self.addresses(pid, 31337 + i),
                "updated_at": now - 3 * i,
                "self": i == 0,
            }
            for i, pid in enumerate(self.ids)
        ]

    def history(self) -> list[dict[str, Any]]:
        t0 = self.started
        return [
            {
                "t": t0 + 2 * i,
                "step": i,
                "loss": 5.0 * math.exp(-i / 20) + 1.0,
                "val_loss": None if i < 10 else 5.2 * math.exp(-(i // 10) / 2) + 1.0,
                "tokens_per_s": 1200.0,
                "bytes_sent": 3000 * i,
                "bytes_received": 5000 * i,
            }
            for i in range(41)
        ]

    def swarm(self) -> dict[str, Any]:
        # What the daemon's SwarmHistory gives: a series per peer, one that left included.
        series = {
            pid: [
                {
                    "t": self.started + 15 * k,
                    "step": 10 * k,
                    "loss": 3.0 - 0.1 * k - 0.01 * i,
                    "val_loss": None if k < 2 else 3.1 - 0.1 * k,
                }
                for k in range(5 - i)
            ]
            for i, pid in enumerate(self.ids)
        }
        series[self.ids[1]][-1]["loss"] = math.nan  # a diverged peer
        return {"peers": series, "self": self.peer_id}


class HangingPeersProvider(FakeProvider):
    """peers() waits on a DHT that never answers."""

    def __init__(self) -> None:
        super().__init__()
        self.cancelled = asyncio.Event()

    async def peers(self) -> list[dict[str, Any]]:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        raise AssertionError("unreachable")


class BrokenProvider(FakeProvider):
    """status() has a bug the first time it is called, then works."""

    def status(self) -> dict[str, Any]:
        if self.status_calls == 0:
            self.status_calls += 1
            raise KeyError("a bug in the daemon: secret internals")
        return super().status()


@pytest.fixture
async def provider() -> FakeProvider:
    return FakeProvider()


async def start_server(provider: FakeProvider) -> StatusServer:
    server = StatusServer(provider, Metrics(provider), "127.0.0.1", 0, peers_timeout=PEERS_TIMEOUT)
    await server.start()
    return server


@pytest.fixture
async def server(provider: FakeProvider) -> AsyncIterator[StatusServer]:
    server = await start_server(provider)
    yield server
    await server.aclose()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as session:
        yield session


async def get(http: aiohttp.ClientSession, url: str) -> tuple[int, str, str]:
    async with http.get(url) as response:
        return response.status, response.content_type, await response.text()


# --- the endpoints ------------------------------------------------------------------------------


async def test_url_names_the_real_port_when_started_on_port_0(server: StatusServer) -> None:
    assert server.url.startswith("http://127.0.0.1:")
    assert int(server.url.rsplit(":", 1)[1]) > 0


async def test_status_has_every_documented_key_with_its_type(
    server: StatusServer, http: aiohttp.ClientSession, provider: FakeProvider
) -> None:
    status_code, content_type, body = await get(http, server.url + "/status")
    assert (status_code, content_type) == (200, "application/json")
    status = json.loads(body)
    assert set(STATUS_KEYS) <= status.keys()
    assert status["peer_id"] == provider.peer_id and status["peer_id"].startswith("12D3KooW")
    assert status["version"] == __version__
    assert all(isinstance(a, str) and a.startswith("/ip4/") for a in status["addresses"])
    assert status["reachability"] in ("public", "private", "unknown")
    assert len(status["connections"]) == 3
    for conn in status["connections"]:
        assert conn.keys() == {"peer_id", "kind", "bytes_sent", "bytes_received"}
        assert conn["kind"] in ("direct", "relayed", "holepunched")
        assert isinstance(conn["bytes_sent"], int) and isinstance(conn["bytes_received"], int)
    assert isinstance(status["dht_peers"], int)
    assert isinstance(status["experiment"], str)
    assert isinstance(status["step"], int)
    assert isinstance(status["loss"], float) and isinstance(status["tokens_per_s"], float)
    assert isinstance(status["val_loss"], float)
    assert status["last_round"].keys() == {"group_size", "duration_s", "outcome", "fingerprint"}
    assert isinstance(status["bytes_sent"], int) and isinstance(status["bytes_received"], int)
    assert isinstance(status["uptime_s"], float) and status["uptime_s"] >= 95


async def test_unknown_and_non_finite_values_are_served_as_null(
    server: StatusServer, http: aiohttp.ClientSession, provider: FakeProvider
) -> None:
    """JSON has no NaN: a diverged loss must not make the page's JSON.parse fail."""
    provider.loss = math.nan
    provider.step = None
    _, _, body = await get(http, server.url + "/status")
    assert "NaN" not in body
    status = json.loads(body)
    assert status["loss"] is None and status["step"] is None


async def test_peers_lists_the_swarm_with_step_throughput_and_addresses(
    server: StatusServer, http: aiohttp.ClientSession, provider: FakeProvider
) -> None:
    status_code, content_type, body = await get(http, server.url + "/peers")
    assert (status_code, content_type) == (200, "application/json")
    peers = json.loads(body)
    assert [p["peer_id"] for p in peers] == provider.ids
    for peer in peers:
        assert {
            "peer_id",
            "step",
            "loss",
            "val_loss",
            "tokens_per_s",
            "addresses",
            "updated_at",
            "self",
        } <= peer.keys()
        assert peer["addresses"] and all(
            a.endswith("/p2p/" + peer["peer_id"]) for a in peer["addresses"]
        )
    assert [p["self"] for p in peers] == [True, False, False, False]


async def test_history_is_the_providers_samples(
    server: StatusServer, http: aiohttp.ClientSession, provider: FakeProvider
) -> None:
    status_code, _, body = await get(http, server.url + "/history")
    assert status_code == 200
    history = json.loads(body)
    assert history == provider.history()
    assert history[0].keys() == {
        "t",
        "step",
        "loss",
        "val_loss",
        "tokens_per_s",
        "bytes_sent",
        "bytes_received",
    }


async def test_swarm_is_every_peers_series_with_non_finite_values_as_null(
    server: StatusServer, http: aiohttp.ClientSession, provider: FakeProvider
) -> None:
    status_code, content_type, body = await get(http, server.url + "/swarm")
    assert (status_code, content_type) == (200, "application/json")
    assert "NaN" not in body
    swarm = json.loads(body)
    assert swarm["self"] == provider.peer_id
    assert list(swarm["peers"]) == provider.ids
    expected = provider.swarm()["peers"]
    for pid, series in swarm["peers"].items():
        assert all(p.keys() == {"t", "step", "loss", "val_loss"} for p in series)
        assert [p["t"] for p in series] == sorted(p["t"] for p in series)  # oldest first
        assert [p["val_loss"] for p in series] == [p["val_loss"] for p in expected[pid]]
    assert swarm["peers"][provider.ids[1]][-1]["loss"] is None


async def test_metrics_are_prometheus_text_read_from_the_status(
    server: StatusServer, http: aiohttp.ClientSession, provider: FakeProvider
) -> None:
    server.metrics.observe_round("committed", 1.75, 4)
    server.metrics.observe_round("committed", 0.4, 3)
    server.metrics.observe_round("aborted", 12.0, 2)
    status_code, content_type, body = await get(http, server.url + "/metrics")
    assert status_code == 200 and content_type == "text/plain"
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(body)
        for s in family.samples
    }
    assert not [name for name, _ in samples if name.endswith("_created")]  # timestamps, not counts
    assert samples[("shoal_step", ())] == 40
    assert samples[("shoal_loss", ())] == 2.25
    assert samples[("shoal_val_loss", ())] == 2.5
    assert samples[("shoal_tokens_per_second", ())] == 1234.5
    assert samples[("shoal_bytes_sent_total", ())] == 123_456
    assert samples[("shoal_bytes_received_total", ())] == 654_321
    for protocol, sent in (("/shoal/averaging/1.0.0", 100_000), ("/shoal/dht/1.0.0", 20_000)):
        assert samples[("shoal_protocol_bytes_sent_total", (("protocol", protocol),))] == sent
    assert samples[("shoal_dht_peers", ())] == 7
    assert samples[("shoal_connections_trimmed_total", ())] == 12
    assert samples[("shoal_uptime_seconds", ())] >= 95
    for kind in ("direct", "relayed", "holepunched"):
        assert samples[("shoal_connections", (("kind", kind),))] == 1
    info_labels = (
        ("experiment", "bytegpt-tiny"),
        ("peer_id", provider.peer_id),
        ("reachability", "public"),
        ("version", __version__),
    )
    assert samples[("shoal_info", info_labels)] == 1
    assert samples[("shoal_device_info", (("kind", "cuda"), ("name", "NVIDIA L4")))] == 1
    assert samples[("shoal_mfu", ())] == 0.25
    assert samples[("shoal_event_loop_lag_p99_seconds", ())] == 0.0125
    assert samples[("shoal_event_loop_lag_max_seconds", ())] == 0.08
    assert samples[("shoal_device_memory_used_bytes", ())] == 3 * 2**30
    assert samples[("shoal_device_memory_total_bytes", ())] == 24 * 2**30
    assert samples[("shoal_rounds_total", (("outcome", "committed"),))] == 2
    assert samples[("shoal_rounds_total", (("outcome", "aborted"),))] == 1
    assert samples[("shoal_round_duration_seconds_count", ())] == 3
    assert samples[("shoal_round_duration_seconds_bucket", (("le", "2.5"),))] == 2
    assert samples[("shoal_round_group_size_sum", ())] == 9
    assert samples[("shoal_banned_peers", ())] == 1
    assert samples[("shoal_convictions_total", ())] == 1
    assert samples[("shoal_audits_total", (("result", "passed"),))] == 6
    assert samples[("shoal_audits_total", (("result", "failed"),))] == 1
    assert samples[("shoal_shuns_total", ())] == 2
    assert any(name == "process_resident_memory_bytes" for name, _ in samples)
    # A pipelined experiment: its stages and who serves them.
    assert samples[("shoal_pipeline_stage_peers", (("stage", "0"),))] == 2
    assert samples[("shoal_pipeline_stage_throughput", (("stage", "0"),))] == 410.5
    assert ("shoal_pipeline_stage_throughput", (("stage", "1"),)) not in samples  # not measured
    server_row = ("shoal_pipeline_stage_server", (("peer_id", provider.peer_id), ("stage", "1")))
    assert samples[server_row] == 1
    assert samples[("shoal_pipeline_serving_stage", ())] == 1
    assert samples[("shoal_pipeline_microbatches_total", ())] == 57


async def test_metrics_leave_out_values_not_known_yet(provider: FakeProvider) -> None:
    provider.loss = provider.val_loss = None
    provider.step = None
    names = {f.name for f in text_string_to_metric_families(Metrics(provider).render()[0].decode())}
    assert "shoal_loss" not in names and "shoal_step" not in names
    assert "shoal_val_loss" not in names  # before the first round that changed the model
    assert "shoal_tokens_per_second" in names
    assert "shoal_rounds" in names  # zero before the first round, not missing


async def test_two_peers_in_one_process_export_only_their_own_numbers() -> None:
    """Each Metrics has its own registry (not prometheus_client's global one)."""
    a, b = FakeProvider(), FakeProvider()
    metrics_a, metrics_b = Metrics(a), Metrics(b)
    metrics_a.observe_round("committed", 1.0, 2)
    text_b = metrics_b.render()[0].decode()
    assert a.peer_id not in text_b and b.peer_id in text_b
    assert 'shoal_rounds_total{outcome="committed"} 0.0' in text_b


async def test_healthz_answers_without_asking_for_peers(
    server: StatusServer, http: aiohttp.ClientSession, provider: FakeProvider
) -> None:
    status_code, content_type, body = await get(http, server.url + "/healthz")
    assert (status_code, content_type) == (200, "application/json")
    health = json.loads(body)
    assert health["ok"] is True and health["uptime_s"] >= 0
    assert provider.peers_calls == 0


async def test_the_page_is_self_contained_html(
    server: StatusServer, http: aiohttp.ClientSession
) -> None:
    async with http.get(server.url + "/") as response:
        body = await response.text()
        assert response.status == 200 and response.content_type == "text/html"
        assert "default-src 'none'" in response.headers["Content-Security-Policy"]
    assert 'id="loss-curve"' in body and 'id="peers"' in body
    assert "http://" not in body and "https://" not in body  # no CDN, no external font


async def test_the_pages_style_and_script_are_its_package_files_served_as_stored(
    server: StatusServer, http: aiohttp.ClientSession
) -> None:
    static = resources.files("shoal.peer.status").joinpath("static")
    page = static.joinpath("index.html").read_text("utf-8")
    assert "<script>" not in page and '<script src="app.js">' in page  # nothing inline
    for name, content_type in (("style.css", "text/css"), ("app.js", "text/javascript")):
        async with http.get(server.url + "/" + name) as response:
            assert response.status == 200 and response.content_type == content_type
            assert "script-src 'self'" in response.headers["Content-Security-Policy"]
            assert response.headers["X-Content-Type-Options"] == "nosniff"
            assert await response.text() == static.joinpath(name).read_text("utf-8")


async def test_unknown_path_and_wrong_method_are_json_errors(
    server: StatusServer, http: aiohttp.ClientSession
) -> None:
    status_code, content_type, body = await get(http, server.url + "/nope")
    assert (status_code, content_type) == (404, "application/json")
    assert "error" in json.loads(body)
    async with http.post(server.url + "/status", data=b"x") as response:
        assert response.status == 405 and response.content_type == "application/json"
        assert "GET" in response.headers["Allow"]
        assert "error" in await response.json()


# --- bounded in time, errors without tracebacks -------------------------------------------------


async def test_peers_that_hang_answer_503_within_the_timeout(http: aiohttp.ClientSession) -> None:
    provider = HangingPeersProvider()
    async with StatusServer(
        provider, Metrics(provider), "127.0.0.1", 0, peers_timeout=PEERS_TIMEOUT
    ) as server:
        started = time.monotonic()
        status_code, content_type, body = await get(http, server.url + "/peers")
        elapsed = time.monotonic() - started
        assert (status_code, content_type) == (503, "application/json")
        assert "error" in json.loads(body)
        assert PEERS_TIMEOUT <= elapsed < PEERS_TIMEOUT + 2.0
        assert provider.cancelled.is_set()  # the provider's wait was cancelled, not leaked
        status_code, _, _ = await get(http, server.url + "/status")  # and the server goes on
        assert status_code == 200


async def test_a_provider_bug_is_a_500_json_without_traceback_and_the_server_goes_on(
    http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    provider = BrokenProvider()
    async with StatusServer(provider, Metrics(provider), "127.0.0.1", 0) as server:
        status_code, content_type, body = await get(http, server.url + "/status")
        assert (status_code, content_type) == (500, "application/json")
        error = json.loads(body)["error"]
        assert "KeyError" in error
        assert "Traceback" not in body and "secret internals" not in body
        assert "secret internals" in caplog.text  # the operator finds it in the log
        status_code, _, body = await get(http, server.url + "/status")
        assert status_code == 200 and json.loads(body)["peer_id"] == provider.peer_id


async def test_a_busy_port_raises_oserror(server: StatusServer, provider: FakeProvider) -> None:
    port = int(server.url.rsplit(":", 1)[1])
    second = StatusServer(provider, Metrics(provider), "127.0.0.1", port)
    with pytest.raises(OSError):
        await second.start()
    await second.aclose()  # harmless after a failed start


async def test_aclose_stops_listening(provider: FakeProvider) -> None:
    server = await start_server(provider)
    port = int(server.url.rsplit(":", 1)[1])
    await server.aclose()
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=2):
        pass


# --- --status-addr ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("127.0.0.1:8080", ("127.0.0.1", 8080)),
        ("0.0.0.0:8080", ("0.0.0.0", 8080)),
        ("[::1]:8080", ("::1", 8080)),
        ("[::]:9000", ("::", 9000)),
        ("localhost:8081", ("localhost", 8081)),
        (":8080", ("127.0.0.1", 8080)),  # only the port changes: public only when asked
        ("9090", ("127.0.0.1", 9090)),
        (" 127.0.0.1:0 ", ("127.0.0.1", 0)),
    ],
)
def test_parse_status_addr_accepts(text: str, expected: tuple[str, int]) -> None:
    assert parse_status_addr(text) == expected


@pytest.mark.parametrize(
    ("text", "hint"),
    [
        ("", "empty"),
        ("127.0.0.1", "port"),
        ("127.0.0.1:", "port"),
        ("127.0.0.1:http", "port"),
        ("127.0.0.1:65536", "port"),
        ("127.0.0.1:-1", "port"),
        ("::1:8080", "brackets"),
        ("[::1]", "HOST:PORT"),
        ("[nothost]:8080", "IPv6"),
        ("http://127.0.0.1:8080", "not a URL"),
        ("my host:8080", "no host name"),
    ],
)
def test_parse_status_addr_rejects_with_a_clear_message(text: str, hint: str) -> None:
    with pytest.raises(ValueError, match=hint):
        parse_status_addr(text)


# --- shoal status -------------------------------------------------------------------------------


async def run_status_command(*args: Any, **kwargs: Any) -> tuple[int, str, str]:
    # In a thread: the command is synchronous and the server runs on this event loop.
    out, err = io.StringIO(), io.StringIO()
    code = await asyncio.to_thread(status_command, *args, out, err=err, **kwargs)
    return code, out.getvalue(), err.getvalue()


async def test_status_command_prints_the_peer_its_connections_and_the_swarm(
    server: StatusServer, provider: FakeProvider
) -> None:
    code, out, err = await run_status_command(server.url)
    assert (code, err) == (0, "")
    assert provider.peer_id in out
    lines = out.splitlines()
    assert any(line.split() == ["step", "40"] for line in lines)
    assert any(line.split() == ["loss", "2.2500"] for line in lines)
    assert any(line.split() == ["val", "loss", "2.5000"] for line in lines)
    assert "VAL LOSS" in out and "2.5200" in out  # a peer's, in the table
    assert any(line.split()[:2] == ["last", "round"] and "committed" in line for line in lines)
    assert any(line.split()[:4] == ["swarm", "round", "12", "(committed"] for line in lines)
    assert "connections (3)" in out and "peers (4)" in out
    for pid in provider.ids:
        assert pid in out
    assert "(this peer)" in out


async def test_status_command_json_is_the_raw_status(
    server: StatusServer, provider: FakeProvider
) -> None:
    code, out, _ = await run_status_command(server.url, json_output=True)
    assert code == 0
    assert json.loads(out)["peer_id"] == provider.peer_id


async def test_status_command_reads_shoal_status_addr(
    server: StatusServer, provider: FakeProvider
) -> None:
    port = server.url.rsplit(":", 1)[1]
    code, out, _ = await run_status_command(None, environ={"SHOAL_STATUS_ADDR": f"0.0.0.0:{port}"})
    assert code == 0 and provider.peer_id in out


async def test_status_command_with_the_endpoint_turned_off_says_so() -> None:
    code, out, err = await run_status_command(None, environ={"SHOAL_STATUS_ADDR": "off"})
    assert (code, out) == (1, "")
    assert err.startswith("shoal: error: SHOAL_STATUS_ADDR: off: the status endpoint is off")


async def test_status_command_shows_status_even_when_peers_time_out(
    http: aiohttp.ClientSession,
) -> None:
    provider = HangingPeersProvider()
    async with StatusServer(
        provider, Metrics(provider), "127.0.0.1", 0, peers_timeout=PEERS_TIMEOUT
    ) as server:
        code, out, _ = await run_status_command(server.url)
    assert code == 0 and provider.peer_id in out
    assert "peers: unavailable (HTTP 503" in out


async def test_status_command_against_a_closed_port_is_one_error_line() -> None:
    with socket.socket() as sock:  # a port that nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    code, out, err = await run_status_command(url)
    assert code == 1 and out == ""
    assert err.count("\n") == 1
    assert err.startswith(f"shoal: error: cannot reach a shoal peer at {url}: connection refused;")
    assert "shoal run" in err and "--status-addr" in err


def test_shoal_status_subcommand_dispatches_to_the_status_command(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from shoal.peer.cli import main as shoal_main  # here: the daemon's imports are heavy

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    assert shoal_main(["status", f"127.0.0.1:{port}", "--json"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("shoal: error: cannot reach a shoal peer at http://127.0.0.1:")
