"""Floods and exhaustion: each attack costs the attacker, not the honest peers or the log.

One victim per test: a Host serving an echo RPC service and a status server, all
on loopback, with the limits of the daemon except shorter timeouts (handshake 2 s,
first RPC message 1.5 s, keep-alive 2 s) so that each case runs in seconds.
Attackers connect from 127.1.x.y (other /24s than the honest peers on
127.0.0.1), and the victim applies its per-IP and per-subnet caps to loopback.

Every test checks three things while the attack runs: honest work goes on (a new
honest peer connects and calls, /healthz answers), memory stays bounded (RSS
growth), and the attack writes a handful of log lines, not one per event. Each
prints its figure; bench/flood.py runs the larger-scale versions.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import struct
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from shoal.averaging.allreduce import AllReduceConfig, AllReduceOutcome, AllReduceService
from shoal.averaging.group import Group, Member, make_round_id
from shoal.peer.status.http import HttpLimits
from shoal.peer.status.metrics import Metrics
from shoal.peer.status.server import StatusServer
from shoal.transport import rpc
from shoal.transport.connection import ConnectionConfig
from shoal.transport.errors import TransportError
from shoal.transport.host import Host, HostConfig
from shoal.transport.identity import Identity
from shoal.transport.rpc import PeerBusy, RpcLimits, RpcService
from shoal.transport.secure import SecureHandshake

from .test_status_server import FakeProvider
from .waiting import eventually

PROTO = "/shoal/flood-test/1.0.0"
HANDSHAKE_TIMEOUT = 2.0
FIRST_MESSAGE_TIMEOUT = 1.5
KEEPALIVE = 2.0
LOOPBACK = ("/ip4/127.0.0.1/tcp/0",)
FAST_ROUNDS = {"heartbeat_interval": 0.05, "stall_timeout": 5.0, "decision_timeout": 5.0}
# Log records an attack may cause: the first few per kind, across a few kinds.
MAX_ATTACK_LOG_LINES = 20


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def attacker_ip(i: int, per_subnet: int = 8) -> str:
    """Attack sources: `per_subnet` addresses in each /24 of 127.1.0.0/16."""
    return f"127.1.{i // per_subnet}.{1 + i % per_subnet}"


@dataclass
class Victim:
    host: Host
    service: RpcService
    status: StatusServer
    endpoint: tuple[str, int]
    http: tuple[str, int]
    honest_ms: list[float] = field(default_factory=list)
    healthz_ms: list[float] = field(default_factory=list)
    # The victim and two honest peers average 64k floats, as a training round would.
    averagers: list[AllReduceService] = field(default_factory=list)
    round_ms: list[float] = field(default_factory=list)

    async def allreduce_round(self, stall_timeout: float | None = None) -> float:
        """One all-reduce round of the victim with two honest peers; returns its time in ms.
        `stall_timeout`: this round's, for FAST_ROUNDS' (tests hold floods to those)."""
        hosts = [s.host for s in self.averagers]
        members = tuple(Member(h.peer_id, tuple(h.addresses()), 1.0) for h in hosts)
        round_id = make_round_id("flood", [m.peer_id for m in members], os.urandom(16))
        group = Group("flood", round_id, members)
        t0 = time.perf_counter()
        inputs = [[torch.full((1 << 16,), float(i))] for i in range(len(hosts))]
        outs = await asyncio.gather(
            *(
                s.run(group, ts, 1.0, stall_timeout=stall_timeout)
                for s, ts in zip(self.averagers, inputs, strict=True)
            )
        )
        for out in outs:
            assert isinstance(out, AllReduceOutcome) and out.committed, out
        assert all(float(ts[0][0]) == 1.0 for ts in inputs)  # the mean of 0, 1, 2
        ms = (time.perf_counter() - t0) * 1000
        self.round_ms.append(ms)
        return ms

    async def honest_call(self, timeout: float = 10.0) -> float:
        """A new honest peer connects and makes a call; returns its time in ms."""
        t0 = time.perf_counter()
        peer = Host(Identity.generate(), HostConfig(listen=(), close_grace=0.1))
        await peer.start()
        try:
            addr = self.host.addresses()[0]
            assert await rpc.call(peer, addr, PROTO, "echo", "hi", timeout=timeout) == "hi"
            ms = (time.perf_counter() - t0) * 1000
        finally:
            await peer.aclose()
        self.honest_ms.append(ms)
        return ms

    async def healthz(self, timeout: float = 5.0) -> float:
        ms = await http_get_ms(self.http, "/healthz", timeout)
        self.healthz_ms.append(ms)
        return ms


async def http_get_ms(addr: tuple[str, int], path: str, timeout: float) -> float:
    t0 = time.perf_counter()
    async with asyncio.timeout(timeout):
        reader, writer = await asyncio.open_connection(*addr)
        writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        head = await reader.readline()
        await reader.read()
        writer.close()
    assert head.startswith(b"HTTP/1.1 200"), head
    return (time.perf_counter() - t0) * 1000


@pytest.fixture
async def victim() -> AsyncIterator[Victim]:
    host = Host(
        Identity.generate(),
        HostConfig(
            listen=("/ip4/127.0.0.1/tcp/0",),
            admission_exempt_loopback=False,
            close_grace=0.1,
            connection=ConnectionConfig(handshake_timeout=HANDSHAKE_TIMEOUT),
        ),
    )
    await host.start()
    limits = RpcLimits(first_message_timeout=FIRST_MESSAGE_TIMEOUT, default_timeout=2.0)
    service = RpcService(host, PROTO, limits)

    @service.unary("echo")
    async def echo(ctx: rpc.CallContext, payload: Any) -> Any:
        return payload

    @service.unary("nap")
    async def nap(ctx: rpc.CallContext, payload: Any) -> Any:
        await asyncio.sleep(0.02)  # a handler that waits on something, like most do
        return payload

    @service.stream("download")
    async def download(ctx: rpc.CallContext, nbytes: Any) -> AsyncIterator[Any]:
        block = b"x" * 65536
        for _ in range(int(nbytes) // len(block)):
            yield block

    provider = FakeProvider()
    status = StatusServer(
        provider,  # type: ignore[arg-type]
        Metrics(provider),  # type: ignore[arg-type]
        "127.0.0.1",
        0,
        http_limits=HttpLimits(keepalive_timeout=KEEPALIVE),
    )
    await status.start()
    port = int(status.url.rsplit(":", 1)[1])
    tcp = host.addresses()[0].tcp_endpoint()
    assert tcp is not None
    v = Victim(host, service, status, (str(tcp[0]), int(tcp[1])), ("127.0.0.1", port))
    peers = []
    for _ in range(2):
        peer = Host(Identity.generate(), HostConfig(listen=LOOPBACK, close_grace=0.1))
        await peer.start()
        peers.append(peer)
    v.averagers = [AllReduceService(h, AllReduceConfig(**FAST_ROUNDS)) for h in [host, *peers]]
    # (Its buffers and threads exist before RSS is measured. Not yet a flood's round: a
    # first dial on a loaded machine has taken longer than FAST_ROUNDS' 5 s stall.)
    await v.allreduce_round(stall_timeout=30.0)
    v.round_ms.clear()
    yield v
    await asyncio.gather(*(a.aclose() for a in v.averagers), return_exceptions=True)
    await asyncio.gather(
        status.aclose(), host.aclose(), *(p.aclose() for p in peers), return_exceptions=True
    )


@pytest.fixture
def attack_log(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.INFO, logger="shoal")
    return caplog


def attack_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [f"{r.levelname} {r.getMessage()}" for r in caplog.records if r.name.startswith("shoal")]


def assert_quiet_log(caplog: pytest.LogCaptureFixture, events: int) -> int:
    lines = attack_lines(caplog)
    assert len(lines) <= MAX_ATTACK_LOG_LINES, f"{len(lines)} lines for {events} events:\n" + (
        "\n".join(lines[:40])
    )
    assert not any(r.exc_info for r in caplog.records), "a traceback in the log"
    return len(lines)


async def open_raw(dest: tuple[str, int], src_ip: str) -> tuple[Any, Any] | None:
    try:
        return await asyncio.open_connection(*dest, local_addr=(src_ip, 0))
    except OSError:
        return None


async def closed_within(conns: list[tuple[Any, Any]], timeout: float) -> float:
    """Seconds until the server closed every connection (reads EOF or a reset)."""
    t0 = time.perf_counter()

    async def until_closed(reader: asyncio.StreamReader) -> None:
        try:
            while await reader.read(65536):
                pass
        except OSError:
            pass

    async with asyncio.timeout(timeout):
        await asyncio.gather(*(until_closed(r) for r, _ in conns))
    return time.perf_counter() - t0


def close_all(conns: list[tuple[Any, Any]]) -> None:
    for _, w in conns:
        w.transport.abort()


async def open_many(
    dest: tuple[str, int], n: int, first: bytes = b"", per_subnet: int = 8
) -> list[tuple[Any, Any]]:
    conns: list[tuple[Any, Any]] = []
    for start in range(0, n, 250):  # batches: the listen backlog is finite
        batch = await asyncio.gather(
            *(open_raw(dest, attacker_ip(i, per_subnet)) for i in range(start, min(n, start + 250)))
        )
        for c in batch:
            if c is not None:
                if first:
                    c[1].write(first)
                conns.append(c)
    return conns


@pytest.mark.timeout(60)
async def test_two_thousand_silent_connections(victim: Victim, attack_log) -> None:
    rss0 = rss_mb()
    t0 = time.perf_counter()
    conns = await open_many(victim.endpoint, 2000)
    opened = time.perf_counter() - t0
    during = [await victim.honest_call(), await victim.healthz(), await victim.allreduce_round()]
    closed = await closed_within(conns, HANDSHAKE_TIMEOUT + 8)
    growth = rss_mb() - rss0
    lines = assert_quiet_log(attack_log, len(conns))
    assert victim.host.admission.pending == 0
    close_all(conns)
    print(
        f"\n2,000 silent connections from {2000 // 8} IPs in {2000 // 64} /24s (opened in "
        f"{opened:.1f} s): all closed {closed:.1f} s later (handshake timeout "
        f"{HANDSHAKE_TIMEOUT:g} s; {victim.host.admission.evicted} evicted for newcomers); "
        f"honest connect+call {during[0]:.0f} ms, /healthz {during[1]:.0f} ms, all-reduce "
        f"round (3 peers) {during[2]:.0f} ms; "
        f"RSS {growth:+.1f} MB; {lines} log lines"
    )
    assert growth < 64


@pytest.mark.timeout(60)
async def test_a_half_open_handshake_flood_does_not_lock_honest_peers_out(
    victim: Victim, attack_log
) -> None:
    """Valid first handshake messages, then silence: more than the half-open slots."""
    first = SecureHandshake(Identity.generate(), True, None).start()
    rss0 = rss_mb()
    conns = await open_many(victim.endpoint, 1200, first=first)
    # Every half-open slot is taken; honest peers still get in (the oldest goes).
    assert victim.host.admission.pending > 0
    during = [await victim.honest_call() for _ in range(5)]
    round_ms = await victim.allreduce_round()
    closed = await closed_within(conns, HANDSHAKE_TIMEOUT + 8)
    growth = rss_mb() - rss0
    lines = assert_quiet_log(attack_log, len(conns))
    close_all(conns)
    print(
        f"\nhalf-open flood of {len(conns)} handshakes: honest connect+call max "
        f"{max(during):.0f} ms, all-reduce round {round_ms:.0f} ms, "
        f"{victim.host.admission.evicted} half-open evicted, all closed "
        f"in {closed:.1f} s; RSS {growth:+.1f} MB; {lines} log lines"
    )
    assert growth < 64


@pytest.mark.timeout(30)
async def test_garbage_after_connect(victim: Victim, attack_log) -> None:
    garbage = os.urandom(4096)
    conns = await open_many(victim.endpoint, 50, first=garbage)
    closed = await closed_within(conns, 5)
    await victim.honest_call()
    lines = assert_quiet_log(attack_log, 50)
    close_all(conns)
    print(f"\ngarbage after connect: 50 of 50 closed in {closed * 1000:.0f} ms; {lines} log lines")


@pytest.mark.timeout(30)
async def test_an_oversized_handshake_frame_is_cut_at_once(victim: Victim, attack_log) -> None:
    huge = struct.pack(">H", 0xFFFF) + b"\0" * 1024  # a length prefix far over the limit
    conns = await open_many(victim.endpoint, 100, first=huge)
    closed = await closed_within(conns, 5)
    lines = assert_quiet_log(attack_log, 100)
    close_all(conns)
    print(
        f"\noversized handshake frames: 100 of 100 closed in {closed * 1000:.0f} ms; {lines} lines"
    )


async def attacker_host() -> Host:
    host = Host(Identity.generate(), HostConfig(listen=(), close_grace=0.1))
    await host.start()
    return host


@pytest.mark.timeout(30)
async def test_a_stream_flood_of_idle_streams(victim: Victim, attack_log) -> None:
    """Thousands of streams opened on one connection and never written to."""
    attacker = await attacker_host()
    try:
        rss0 = rss_mb()
        conn = await attacker.connect(victim.host.addresses()[0])
        streams = []
        for _ in range(2000):
            streams.append(await conn.open_stream(PROTO))
        await asyncio.sleep(0)  # (let the victim see them)
        during = await victim.honest_call()
        round_ms = await victim.allreduce_round()
        t0 = time.perf_counter()

        async def reset(stream: Any) -> None:
            try:
                while await stream.read(65536):
                    pass
            except Exception:
                pass

        async with asyncio.timeout(FIRST_MESSAGE_TIMEOUT + 10):
            await asyncio.gather(*(reset(s) for s in streams))
        drained = time.perf_counter() - t0
        growth = rss_mb() - rss0
        assert victim.service.in_flight(attacker.peer_id) == 0
        assert victim.service.silent_streams >= 1000
        lines = assert_quiet_log(attack_log, 2000)
        print(
            f"\n2,000 idle streams on one connection: all ended {drained:.1f} s later "
            f"({victim.service.silent_streams} reset as silent, first message due in "
            f"{FIRST_MESSAGE_TIMEOUT:g} s); honest connect+call {during:.0f} ms, all-reduce "
            f"round {round_ms:.0f} ms; "
            f"RSS {growth:+.1f} MB; {lines} log lines"
        )
        assert growth < 64
    finally:
        await attacker.aclose()


@pytest.mark.timeout(30)
async def test_an_oversized_rpc_message_resets_its_stream_only(victim: Victim, attack_log) -> None:
    attacker = await attacker_host()
    try:
        conn = await attacker.connect(victim.host.addresses()[0])
        for _ in range(50):
            stream = await conn.open_stream(PROTO)
            await stream.write(rpc.FRAME.pack(0xFFFFFFF0, rpc.MSG))  # 4 GiB announced
            with pytest.raises(Exception):  # noqa: B017 (the victim resets it)
                await stream.read(1)
        assert conn.is_open  # the connection survives; only the streams went
        assert await rpc.call(attacker, victim.host.peer_id, PROTO, "echo", 1) == 1
        await victim.honest_call()
        lines = assert_quiet_log(attack_log, 50)
        print(f"\n50 RPC frames announcing 4 GiB: 50 streams reset, connection kept; {lines} lines")
    finally:
        await attacker.aclose()


@pytest.mark.timeout(40)
async def test_an_rpc_storm_from_one_peer(victim: Victim, attack_log) -> None:
    attacker = await attacker_host()
    stop = asyncio.Event()
    calls = {"ok": 0, "busy": 0, "other": 0}
    peak = 0
    try:
        await attacker.connect(victim.host.addresses()[0])

        async def storm() -> None:
            while not stop.is_set():
                try:
                    await rpc.call(attacker, victim.host.peer_id, PROTO, "nap", b"x" * 100)
                    calls["ok"] += 1
                except PeerBusy:
                    calls["busy"] += 1
                except Exception:
                    calls["other"] += 1

        rss0 = rss_mb()
        workers = [asyncio.create_task(storm()) for _ in range(512)]
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 3:
            await victim.honest_call()
            await victim.healthz()
            await victim.allreduce_round()
            slots = victim.service._slots.get(attacker.peer_id)
            peak = max(peak, slots.running if slots is not None else 0)
        stop.set()
        await asyncio.gather(*workers)
        seconds = time.perf_counter() - t0
        growth = rss_mb() - rss0
        lines = assert_quiet_log(attack_log, sum(calls.values()))
        honest = sorted(victim.honest_ms)
        print(
            f"\nRPC storm from one peer, 512 concurrent callers (20 ms handler), {seconds:.1f} s: "
            f"{calls['ok'] / seconds:,.0f} calls/s served, at most {peak} running at once "
            f"(cap {victim.service.limits.max_concurrent_per_peer}); honest connect+call p50 "
            f"{honest[len(honest) // 2]:.0f} ms, max {honest[-1]:.0f} ms over {len(honest)}; "
            f"/healthz max {max(victim.healthz_ms):.0f} ms; all-reduce rounds max "
            f"{max(victim.round_ms):.0f} ms over {len(victim.round_ms)}; "
            f"RSS {growth:+.1f} MB; {lines} lines"
        )
        assert calls["ok"] > 0 and calls["other"] == 0
        assert peak <= victim.service.limits.max_concurrent_per_peer
        assert growth < 64
    finally:
        stop.set()
        await attacker.aclose()


@pytest.mark.timeout(30)
async def test_a_slow_reader_holds_a_handler_only_until_its_deadline(
    victim: Victim, attack_log
) -> None:
    """Calls that ask for 64 MiB each and never read: bounded memory, bounded time."""
    attacker = await attacker_host()
    try:
        rss0 = rss_mb()
        conn = await attacker.connect(victim.host.addresses()[0])
        streams = []
        for _ in range(32):
            s = await conn.open_stream(PROTO)
            await s.write(rpc.pack_message(["download", None, 64 << 20]))
            streams.append(s)
        await victim.honest_call()
        t0 = time.perf_counter()
        await asyncio.sleep(0.5)
        held = victim.service.in_flight(attacker.peer_id)
        # The handlers end at default_timeout (2 s here).
        await eventually(lambda: not victim.service.in_flight(attacker.peer_id), "handlers end", 10)
        ended = time.perf_counter() - t0
        growth = rss_mb() - rss0
        lines = assert_quiet_log(attack_log, 32)
        print(
            f"\n32 calls for 64 MiB never read: {held} handlers held, ended {ended:.1f} s "
            f"later (default deadline 2 s), 2 GiB asked, RSS {growth:+.1f} MB; {lines} lines"
        )
        assert growth < 64
    finally:
        await attacker.aclose()


@pytest.mark.timeout(40)
async def test_status_slowloris(victim: Victim, attack_log) -> None:
    """300 sockets trickling request headers from 10 addresses."""
    rss0 = rss_mb()
    conns = await open_many(victim.http, 300, per_subnet=10)

    async def trickle(writer: asyncio.StreamWriter) -> None:
        try:
            writer.write(b"GET /status HTTP/1.1\r\n")
            for i in range(100):
                writer.write(b"X-%d: y\r\n" % i)
                await asyncio.sleep(0.3)
        except OSError:
            pass

    trickles = [asyncio.create_task(trickle(w)) for _, w in conns]
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < KEEPALIVE + 1:
        await victim.healthz()
        await asyncio.sleep(0.1)
    closed = await closed_within(conns, KEEPALIVE + 5)
    for t in trickles:
        t.cancel()
    growth = rss_mb() - rss0
    lines = assert_quiet_log(attack_log, len(conns))
    close_all(conns)
    print(
        f"\nstatus slowloris, {len(conns)} sockets trickling headers: all closed within "
        f"{KEEPALIVE + 1 + closed:.1f} s (keep-alive {KEEPALIVE:g} s); /healthz max "
        f"{max(victim.healthz_ms):.0f} ms over {len(victim.healthz_ms)}; RSS {growth:+.1f} MB; "
        f"{lines} log lines"
    )
    assert growth < 64


@pytest.mark.timeout(30)
async def test_an_oversized_status_request_is_a_4xx_and_one_line(
    victim: Victim, attack_log
) -> None:
    answers = []
    for path_len, header_len in ((100_000, 0), (10, 100_000), (10, 9000)):
        reader, writer = await asyncio.open_connection(*victim.http)
        header = f"X-Big: {'y' * header_len}\r\n" if header_len else ""
        writer.write(f"GET /{'a' * path_len} HTTP/1.1\r\nHost: x\r\n{header}\r\n".encode())
        try:
            answers.append((await asyncio.wait_for(reader.readline(), 5)).decode().strip())
        except (OSError, TimeoutError):
            answers.append("closed")
        writer.close()
    for _ in range(50):
        reader, writer = await asyncio.open_connection(*victim.http)
        writer.write(b"GET /" + b"a" * 100_000 + b" HTTP/1.1\r\n\r\n")
        await reader.read()
        writer.close()
    await victim.healthz()
    lines = assert_quiet_log(attack_log, 53)
    assert all(a.split()[1].startswith("4") for a in answers), answers
    assert not any(r.levelno >= logging.ERROR for r in attack_log.records)
    print(f"\noversized status requests: answered {answers}; 53 requests, {lines} log lines")


@pytest.mark.timeout(20)
async def test_a_busy_service_answers_peer_busy_at_once() -> None:
    host = Host(Identity.generate(), HostConfig(listen=("/ip4/127.0.0.1/tcp/0",)))
    caller = Host(Identity.generate(), HostConfig(listen=()))
    await host.start()
    await caller.start()
    try:
        service = RpcService(
            host, PROTO, RpcLimits(max_concurrent_per_peer=2, max_queued_per_peer=3)
        )
        release = asyncio.Event()

        @service.unary("wait")
        async def wait(ctx: rpc.CallContext, payload: Any) -> Any:
            await release.wait()
            return payload

        addr = host.addresses()[0]
        await caller.connect(addr)
        calls = [
            asyncio.create_task(rpc.call(caller, host.peer_id, PROTO, "wait", i)) for i in range(5)
        ]
        await eventually(lambda: service.in_flight(caller.peer_id) == 5, "5 calls in")
        with pytest.raises(PeerBusy, match="5 calls from this peer"):
            await rpc.call(caller, host.peer_id, PROTO, "wait", 99)
        release.set()
        assert await asyncio.gather(*calls) == list(range(5))  # queued ones ran, in order
    finally:
        await caller.aclose()
        await host.aclose()


@pytest.mark.timeout(60)
async def test_a_handshake_flood_at_the_limit_does_not_keep_a_rounds_member_out(
    attack_log,
) -> None:
    """At `max_connections` with every connection busy, a few handshakes still run in
    case their peer is a round's member (transport/admission.py). A flood of silent
    handshakes holds at most that reserve, one per address, and a member from another
    subnet still gets its handshake and its place past the limit."""
    config = HostConfig(
        listen=("/ip4/127.0.0.1/tcp/0",),
        max_connections=3,
        admission_exempt_loopback=False,
        close_grace=0.1,
        connection=ConnectionConfig(handshake_timeout=HANDSHAKE_TIMEOUT),
    )
    host = Host(Identity.generate(), config)
    peers = [Host(Identity.generate(), HostConfig(listen=LOOPBACK, close_grace=0.1))]
    peers += [Host(Identity.generate(), HostConfig(listen=(), close_grace=0.1)) for _ in range(4)]
    *busy_peers, member, stranger = peers
    streams: list[Any] = []
    await asyncio.gather(host.start(), *(p.start() for p in peers))
    try:
        for h in (host, *peers):
            h.set_handler(PROTO, _hold_open)
        addr = host.addresses()[0]
        streams = [await p.open_stream(addr, PROTO) for p in busy_peers]
        await eventually(lambda: host.admission.established_count == 3, "at the limit")
        first = SecureHandshake(Identity.generate(), True, None).start()
        conns = await open_many(victim_endpoint(host), 400, first=first)
        assert 0 < host.admission.pending_at_limit <= 8
        with host.protecting([member.peer_id]):
            streams.append(await member.open_stream(addr, PROTO))
            with pytest.raises(TransportError):
                await stranger.open_stream(addr, PROTO)
        assert member.peer_id in host.connections and host.admission.established_count == 4
        closed = await closed_within(conns, HANDSHAKE_TIMEOUT + 8)
        lines = assert_quiet_log(attack_log, len(conns))
        close_all(conns)
        assert host.admission.pending_at_limit == 0
        print(
            f"\nhandshake flood of {len(conns)} at the connection limit: the member got in, "
            f"{host.admission.evicted} half-open evicted, all closed in {closed:.1f} s; "
            f"{lines} log lines"
        )
    finally:
        for stream in streams:
            stream.reset()
        await asyncio.gather(host.aclose(), *(p.aclose() for p in peers))


async def _hold_open(stream: Any) -> None:
    while await stream.read():
        pass


def victim_endpoint(host: Host) -> tuple[str, int]:
    tcp = host.addresses()[0].tcp_endpoint()
    assert tcp is not None
    return (str(tcp[0]), int(tcp[1]))


def test_attacker_addresses_are_local() -> None:
    """127.1.x.y are loopback on Linux: the attack sources above need no setup."""
    s = socket.socket()
    try:
        s.bind((attacker_ip(100), 0))
    finally:
        s.close()
