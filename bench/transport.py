"""Transport benchmark: shoal's encrypted multiplexed streams and RPC against plain TCP.

    python bench/transport.py [--total-mib 1024] [--profile auto|always|never]
    python bench/transport.py --baseline cf034cc [--ab-rounds 3] [--total-mib 256]

The second form is an A/B against an older commit in the same run
(bench/baseline.py): one stream run and the RPC runs, alternately with each
code, each side's median and range and the ratio current/baseline.

Prints one JSON object on stdout (logs go to stderr). Every measurement runs
the sender and the receiver in separate processes (this file re-invoked with
``--role ...``), each on uvloop, over 127.0.0.1. Throughputs are medians of
``--runs`` runs, in MB/s with MB = 10^6 bytes, timed by the receiver from its
first read to its last byte (the sender-side rate, start of writing to the
receiver's acknowledgement, is reported beside it as a cross-check).

Beside each rate: ``*_cpu_bound_MBps`` (the rate if neither side ever waited for a
CPU: bytes over the slower side's CPU seconds), page faults per MB on each side,
and ``background_load`` (CPU other processes used during each measurement; the
benchmark first waits up to ``--quiet-wait`` seconds for the machine to be idle).
Profiles (cProfile, top 15 by own time on both sides) are taken in separate runs
when a target is missed, or always with ``--profile always``.

Roles talk to the orchestrator in JSON lines: commands on stdin, results on
stdout; a child exits when its stdin closes, so nothing outlives a crash of
the orchestrator.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import os
import platform
import resource
import statistics
import struct
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

log = logging.getLogger("bench.transport")

MIB = 1024 * 1024
MB = 1_000_000
STREAM_PROTO = "/shoal/bench/stream/1.0.0"
VERIFY_PROTO = "/shoal/bench/verify/1.0.0"
RPC_PROTO = "/shoal/bench/1.0.0"
CTL_PROTO = "/shoal/bench/ctl/1.0.0"
HIVEMIND_HANDLER = "shoal_bench_stream"
LOOPBACK = ("/ip4/127.0.0.1/tcp/0",)
SCRIPT = os.path.abspath(__file__)  # roles re-invoke this file

_SIZE = struct.Struct(">Q")  # bytes the sender will send on this stream/connection
# The receiver's answer: wall clock, CPU clock and minor page faults at its first read
# and at its last byte, and the bytes received in between. CPU seconds per byte move
# less than wall-clock rates when other work shares this 2-core machine; page faults
# show allocator churn (memory handed back to the OS and faulted in again).
_ACK = struct.Struct(">ddddQQQ")

# Targets this benchmark is judged against (2-core machine).
TARGET_STREAM_MBPS = 1000.0
TARGET_STREAM_RATIO = 0.40
TARGET_RPC_CALLS = 10_000.0
TARGET_RPC_P50_MS = 1.0
TARGET_IDLE_RSS_MB = 60.0
TARGET_CONN_KB = 100.0

# Bound on any single wait on a child, so a hung peer fails the run instead of stalling it.
CHILD_TIMEOUT = 120.0


# --- small helpers shared by all roles ------------------------------------------------------------


def _emit(obj: dict[str, Any]) -> None:
    """One JSON line to the orchestrator (stdout is reserved for these)."""
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def rss_kb() -> int:
    """Resident set size of this process in KiB, from /proc (what the kernel charges us)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS in /proc/self/status")


async def _stdin_lines() -> asyncio.StreamReader:
    # A pipe reader on the loop rather than a thread: the idle-RSS role must not
    # grow a thread pool (and its stacks) just to listen for commands.
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    return reader


async def _serve_commands(handle: Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]) -> None:
    """Answer JSON commands from stdin until "stop" or EOF."""
    lines = await _stdin_lines()
    while line := await lines.readline():
        request = json.loads(line)
        if request.get("cmd") == "stop":
            return
        _emit(await handle(request))


def _mbps(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / MB if seconds > 0 else 0.0


def _clocks() -> tuple[float, float, int]:
    """Wall clock, this process's CPU time, and its minor page faults so far."""
    return (
        time.perf_counter(),
        time.process_time(),
        resource.getrusage(resource.RUSAGE_SELF).ru_minflt,
    )


def _run_result(
    acks: list[tuple[float, ...]],
    sent: int,
    start: tuple[float, float, int],
    end: tuple[float, float, int],
) -> dict[str, float]:
    """One throughput run from the receiver's acks (one per stream) and the sender's clocks."""
    # Over several streams: from the receiver's earliest first read to its latest last byte.
    wall = max(a[1] for a in acks) - min(a[0] for a in acks)
    recv_cpu = max(a[3] for a in acks) - min(a[2] for a in acks)
    recv_faults = max(a[5] for a in acks) - min(a[4] for a in acks)
    timed = sum(a[6] for a in acks)
    send_wall, send_cpu = end[0] - start[0], end[1] - start[1]
    # What the run would reach if neither side ever waited for a CPU: the slower
    # side's CPU cost per byte sets the pace.
    cpu_per_byte = max(recv_cpu / timed, send_cpu / sent)
    return {
        "recv_MBps": round(_mbps(timed, wall), 1),
        "send_MBps": round(_mbps(sent, send_wall), 1),
        "recv_cpu_s": round(recv_cpu, 3),
        "send_cpu_s": round(send_cpu, 3),
        "cpu_bound_MBps": round(1 / cpu_per_byte / MB, 1) if cpu_per_byte > 0 else 0.0,
        "recv_minflt_per_MB": round(recv_faults / (timed / MB), 2),
        "send_minflt_per_MB": round((end[2] - start[2]) / (sent / MB), 2),
    }


def _profiler(clock: str) -> Any:
    """A started cProfile profiler timing CPU time ("cpu") or wall-clock time ("wall").

    On a shared 2-core machine a wall-clock profile charges the time a process spends
    preempted (e.g. right after waking its peer with a send) to whatever function was
    running, typically the socket write; a CPU-time profile shows where CPU goes.
    """
    import cProfile

    profiler = cProfile.Profile(time.process_time) if clock == "cpu" else cProfile.Profile()
    profiler.enable()
    return profiler


def _profile_top(profiler: Any, n: int = 15) -> dict[str, Any]:
    """The n functions with the most own time (tottime), as readable rows."""
    import pstats

    stats = pstats.Stats(profiler)
    total = stats.total_tt or 1e-9
    rows = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:n]  # type: ignore[attr-defined]
    top = []
    for (path, line, func), (_cc, ncalls, tottime, cumtime, _callers) in rows:
        where = "/".join(path.split("/")[-2:]) if path != "~" else "~"
        top.append(
            f"{tottime:7.3f}s {tottime / total:6.1%} cum {cumtime:7.3f}s "
            f"{ncalls:>8} {where}:{line}({func})"
        )
    return {"profiled_s": round(total, 3), "top_tottime": top}


# --- plain TCP baseline ---------------------------------------------------------------------------


class _TcpSink(asyncio.BufferedProtocol):
    """Receives a known number of bytes straight into one preallocated buffer, then acks."""

    def __init__(self, total: int, buffer: memoryview) -> None:
        self.total = total
        self.buffer = buffer
        self.got = 0
        self.first_n = 0
        self.first = (0.0, 0.0, 0)
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.buffer  # the payload is discarded, so every read reuses one buffer

    def buffer_updated(self, nbytes: int) -> None:
        if not self.got:
            # The clock starts at the first read; those bytes are not counted as timed.
            self.first, self.first_n = _clocks(), nbytes
        self.got += nbytes
        if self.got >= self.total and self.transport is not None:
            wall, cpu, faults = _clocks()
            first_wall, first_cpu, first_faults = self.first
            timed = self.got - self.first_n
            ack = _ACK.pack(first_wall, wall, first_cpu, cpu, first_faults, faults, timed)
            self.transport.write(ack)


async def role_tcp_server(args: argparse.Namespace) -> None:
    loop = asyncio.get_running_loop()
    buffer = memoryview(bytearray(4 * MIB))
    server = await loop.create_server(
        lambda: _TcpSink(args.total, buffer), "127.0.0.1", 0, reuse_address=True
    )
    _emit({"port": server.sockets[0].getsockname()[1]})
    try:
        await _serve_commands(_no_commands)
    finally:
        server.close()


async def _no_commands(request: dict[str, Any]) -> dict[str, Any]:
    return {"error": f"unknown command {request!r}"}


async def role_tcp_client(args: argparse.Namespace) -> None:
    _emit({"ready": True})
    await _serve_commands(lambda request: _tcp_runs(args, request["runs"]))


async def _tcp_runs(args: argparse.Namespace, count: int) -> dict[str, Any]:
    src = memoryview(os.urandom(args.write_size))
    runs = []
    for _ in range(count):
        reader, writer = await asyncio.open_connection("127.0.0.1", args.port)
        start = _clocks()
        sent = 0
        while sent < args.total:
            n = min(args.write_size, args.total - sent)
            writer.write(src[:n])
            await writer.drain()
            sent += n
        ack = _ACK.unpack(await reader.readexactly(_ACK.size))
        end = _clocks()
        writer.close()
        await writer.wait_closed()
        runs.append(_run_result([ack], args.total, start, end))
        log.info("tcp run: %s", runs[-1])
    return {"runs": runs}


# --- shoal server ---------------------------------------------------------------------------------


async def role_shoal_server(args: argparse.Namespace) -> None:
    import hashlib

    from shoal.transport.connection import Stream
    from shoal.transport.errors import ProtocolViolation
    from shoal.transport.host import Host, HostConfig
    from shoal.transport.identity import Identity
    from shoal.transport.rpc import CallContext, RpcService

    host = Host(Identity.generate(), HostConfig(listen=LOOPBACK))
    await host.start()
    # One preallocated receive region per concurrent stream (the bytes are thrown away).
    region = 8 * MIB
    sink_buffer = memoryview(bytearray(8 * region))
    next_region = 0

    async def sink(stream: Stream) -> None:
        nonlocal next_region
        index, next_region = next_region, (next_region + 1) % 8
        view = sink_buffer[index * region : (index + 1) * region]
        (total,) = _SIZE.unpack(await stream.readexactly(_SIZE.size))
        start = _clocks()
        left, pos = total, 0
        while left:
            if pos == region:
                pos = 0
            n = await stream.readinto(view[pos : pos + min(left, region - pos)])
            if not n:
                raise ProtocolViolation(f"bench stream ended {left} bytes early")
            pos += n
            left -= n
        end = _clocks()
        # Wait for the sender's close before answering: a handler that returns while
        # the remote has not closed yet gets the stream reset, and the sender may see
        # that reset raised from a write whose data was in fact all delivered.
        if await stream.read(1):
            raise ProtocolViolation("bench stream carried more bytes than announced")
        await stream.write(_ACK.pack(start[0], end[0], start[1], end[1], start[2], end[2], total))

    async def verify(stream: Stream) -> None:
        digest = hashlib.sha256()
        while chunk := await stream.read(1 << 20):
            digest.update(chunk)
        await stream.write(digest.digest())

    host.set_handler(STREAM_PROTO, sink)
    host.set_handler(VERIFY_PROTO, verify)

    service = RpcService(host, RPC_PROTO)

    @service.unary("echo")
    async def echo(ctx: CallContext, payload: Any) -> Any:
        return payload

    # The client brackets exactly its measured section with these, so the server's
    # profile covers the same calls as the client's.
    ctl = RpcService(host, CTL_PROTO)
    profiler: Any = None

    @ctl.unary("profile_start")
    async def profile_start(ctx: CallContext, clock: Any) -> None:
        nonlocal profiler
        profiler = _profiler(str(clock))

    @ctl.unary("profile_stop")
    async def profile_stop(ctx: CallContext, payload: Any) -> Any:
        nonlocal profiler
        if profiler is None:
            return None
        profiler.disable()
        result, profiler = _profile_top(profiler), None
        return result

    _emit({"addr": str(host.addresses()[0])})
    try:
        await _serve_commands(_no_commands)
    finally:
        await host.aclose()


# --- shoal client ---------------------------------------------------------------------------------


class ShoalClient:
    """The sending/calling side; one connection to the server, driven by commands."""

    def __init__(self, host: Any, conn: Any, write_size: int) -> None:
        self.host = host
        self.conn = conn
        self.peer = conn.remote_peer
        # Written from, never modified: random so nothing on the path could compress it.
        self.src = memoryview(os.urandom(write_size))
        self.write_size = write_size

    async def handle(self, req: dict[str, Any]) -> dict[str, Any]:
        cmd = req["cmd"]
        if cmd == "verify":
            return await self.verify()
        if cmd == "stream":
            return await self.streams(req["total"], req["streams"], req["runs"], req["profile"])
        if cmd == "rpc":
            return await self.rpc(req)
        return {"error": f"unknown command {cmd!r}"}

    async def verify(self) -> dict[str, Any]:
        """Odd-sized writes of random bytes must arrive intact (a benchmark of garbage is void)."""
        import hashlib

        data = os.urandom(3 * MIB + 12345)
        stream = await self.conn.open_stream(VERIFY_PROTO)
        pos = 0
        for size in (1, 100, 70_000, 65_519, 1_000_003, 8 * MIB):
            await stream.write(memoryview(data)[pos : pos + size])
            pos = min(pos + size, len(data))
        await stream.close()
        remote = await stream.readexactly(32)
        return {"integrity_ok": remote == hashlib.sha256(data).digest()}

    async def _one_stream(self, per_stream: int) -> tuple[float, ...]:
        stream = await self.conn.open_stream(STREAM_PROTO)
        await stream.write(_SIZE.pack(per_stream))
        src, size, sent = self.src, self.write_size, 0
        while sent < per_stream:
            n = min(size, per_stream - sent)
            await stream.write(src[:n])
            sent += n
        await stream.close()
        return _ACK.unpack(await stream.readexactly(_ACK.size))

    async def _stream_run(self, total: int, streams: int) -> dict[str, float]:
        per_stream = total // streams
        start = _clocks()
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(self._one_stream(per_stream)) for _ in range(streams)]
        end = _clocks()
        # Aggregate over streams: earliest first read to latest last byte at the receiver.
        acks = [t.result() for t in tasks]
        return _run_result(acks, per_stream * streams, start, end)

    async def streams(
        self, total: int, streams: int, runs: int, profile: str | None
    ) -> dict[str, Any]:
        out: dict[str, Any] = {"runs": []}
        profiler: Any = None
        if profile:
            await self._ctl("profile_start", profile)
            profiler = _profiler(profile)
        for _ in range(runs):
            out["runs"].append(await self._stream_run(total, streams))
            log.info("shoal %d-stream run: %s", streams, out["runs"][-1])
        if profiler is not None:
            profiler.disable()
            out["profile_sender"] = _profile_top(profiler)
            out["profile_receiver"] = await self._ctl("profile_stop")
        return out

    async def _ctl(self, method: str, payload: Any = None) -> Any:
        from shoal.transport import rpc

        return await rpc.call(self.host, self.peer, CTL_PROTO, method, payload)

    async def rpc(self, req: dict[str, Any]) -> dict[str, Any]:
        from shoal.transport import rpc

        host, peer, payload = self.host, self.peer, b"x" * req["payload_bytes"]
        perf = time.perf_counter

        async def run(duration: float, concurrency: int) -> tuple[float, list[float]]:
            start = perf()
            end = start + duration
            latencies: list[float] = []
            completed = 0

            async def caller() -> None:
                nonlocal completed
                while (t0 := perf()) < end:
                    await rpc.call(host, peer, RPC_PROTO, "echo", payload)
                    t1 = perf()
                    if t1 <= end:
                        completed += 1  # throughput: completions inside the window
                    latencies.append(t1 - t0)

            async with asyncio.TaskGroup() as tg:
                for _ in range(concurrency):
                    tg.create_task(caller())
            return completed / duration, latencies

        await run(req["warmup"], req["concurrency"])  # allocator, caches, stream-id churn
        profiler: Any = None
        if req["profile"]:
            await self._ctl("profile_start", req["profile"])
            profiler = _profiler(req["profile"])
        rates, latencies = [], []
        for _ in range(req["runs"]):
            rate, lat = await run(req["seconds"], req["concurrency"])
            rates.append(round(rate, 1))
            latencies.extend(lat)
            log.info("rpc run: %.0f calls/s", rate)
        out: dict[str, Any] = {"rates": rates, **_percentiles(latencies)}
        if profiler is not None:
            profiler.disable()
            out["profile_caller"] = _profile_top(profiler)
            out["profile_server"] = await self._ctl("profile_stop")
        elif req["unloaded_seconds"]:
            # With N callers in flight, mean latency = N / rate (Little's law), so the
            # loaded p50 mostly measures queueing; one caller shows the round trip itself.
            rate, lat = await run(req["unloaded_seconds"], 1)
            out["unloaded"] = {"calls_per_s": round(rate, 1), **_percentiles(lat)}
            # One caller again, while a bulk stream fills the same connection: do small
            # calls wait behind it? (tests/test_host.py checks only that they finish)
            bulk = asyncio.create_task(self._one_stream(req["bulk_bytes"]))
            during: list[float] = []
            while not bulk.done():
                t0 = perf()
                await rpc.call(host, peer, RPC_PROTO, "echo", payload)
                during.append(perf() - t0)
            await bulk
            out["during_bulk"] = {"calls": len(during), **_percentiles(during)}
        return out


def _percentiles(latencies: list[float]) -> dict[str, Any]:
    lat = sorted(latencies)
    n = len(lat)
    return {
        "calls_measured": n,
        "p50_ms": round(lat[int(0.50 * (n - 1))] * 1000, 3),
        "p99_ms": round(lat[int(0.99 * (n - 1))] * 1000, 3),
        "mean_ms": round(statistics.fmean(lat) * 1000, 3),
        "max_ms": round(lat[-1] * 1000, 3),
    }


async def role_shoal_client(args: argparse.Namespace) -> None:
    from shoal.transport.host import Host, HostConfig
    from shoal.transport.identity import Identity

    host = Host(Identity.generate(), HostConfig(listen=()))
    try:
        conn = await host.connect(args.addr)
        cipher = getattr(conn, "_send_cipher", None)
        _emit({"aead": getattr(cipher, "cipher", None)})
        await _serve_commands(ShoalClient(host, conn, args.write_size).handle)
    finally:
        await host.aclose()


# --- memory: idle host and idle connections -------------------------------------------------------


async def role_idle_server(args: argparse.Namespace) -> None:
    import importlib

    from shoal.transport.host import Host, HostConfig
    from shoal.transport.identity import Identity

    importlib.import_module("shoal.transport.rpc")  # a real daemon has RPC loaded too
    # The default per-IP limit (32) would refuse our N loopback dialers.
    config = HostConfig(listen=LOOPBACK, max_connections_per_ip=args.conns + 16)
    host = Host(Identity.generate(), config)
    await host.start()
    await asyncio.sleep(0.5)  # let start-up garbage settle before reading RSS
    gc.collect()
    before = rss_kb()
    _emit(
        {
            "addr": str(host.addresses()[0]),
            "rss_kb": before,
            "imports_torch": "torch" in sys.modules,
            "imports_numpy": "numpy" in sys.modules,
        }
    )

    async def measure(req: dict[str, Any]) -> dict[str, Any]:
        deadline = time.monotonic() + 30
        # Host has no "connection added" event to wait on, so poll its table.
        while len(host.connections) < req["conns"] and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        await asyncio.sleep(1.0)  # handshake state of the last arrivals is freed by now
        gc.collect()
        after = rss_kb()
        n = len(host.connections)
        return {"connections": n, "rss_kb_before": before, "rss_kb_after": after}

    try:
        await _serve_commands(measure)
    finally:
        await host.aclose()


async def role_dialer(args: argparse.Namespace) -> None:
    from shoal.transport.host import Host, HostConfig
    from shoal.transport.identity import Identity

    # One identity per connection: a host keeps a single connection per peer.
    hosts = [Host(Identity.generate(), HostConfig(listen=())) for _ in range(args.conns)]
    limit = asyncio.Semaphore(32)  # stay well inside the listener's backlog

    async def dial(host: Any) -> None:
        async with limit:
            await host.connect(args.addr)

    t0 = time.perf_counter()
    try:
        async with asyncio.TaskGroup() as tg:
            for h in hosts:
                tg.create_task(dial(h))
        _emit({"connected": len(hosts), "seconds": round(time.perf_counter() - t0, 3)})
        await _serve_commands(_no_commands)
    finally:
        await asyncio.gather(*(h.aclose() for h in hosts), return_exceptions=True)


# --- hivemind baseline (only when installed) ------------------------------------------------------


async def role_hivemind_server(args: argparse.Namespace) -> None:
    try:
        import hivemind
    except Exception as e:  # any import failure means "no baseline", not a crash
        _emit({"unavailable": f"{type(e).__name__}: {e}"})
        return
    p2p = await hivemind.P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])

    async def sink(info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        (total,) = _SIZE.unpack(await reader.readexactly(_SIZE.size))
        start = _clocks()
        left = total
        while left:
            chunk = await reader.read(min(left, 4 * MIB))
            if not chunk:
                raise EOFError(f"hivemind stream ended {left} bytes early")
            left -= len(chunk)
        end = _clocks()
        writer.write(_ACK.pack(start[0], end[0], start[1], end[1], start[2], end[2], total))
        await writer.drain()
        writer.close()

    await p2p.add_binary_stream_handler(HIVEMIND_HANDLER, sink)
    maddrs = [str(m) for m in await p2p.get_visible_maddrs()]
    _emit({"maddrs": maddrs, "peer_id": p2p.peer_id.to_base58()})
    try:
        await _serve_commands(_no_commands)
    finally:
        await p2p.shutdown()


async def role_hivemind_client(args: argparse.Namespace) -> None:
    import hivemind

    p2p = await hivemind.P2P.create(initial_peers=args.maddrs)
    try:
        _emit({"ready": True})
        await _serve_commands(lambda request: _hivemind_runs(args, p2p))
    finally:
        await p2p.shutdown()


async def _hivemind_runs(args: argparse.Namespace, p2p: Any) -> dict[str, Any]:
    import hivemind

    peer = hivemind.PeerID.from_base58(args.peer_id)
    src = memoryview(os.urandom(args.write_size))
    runs = []
    for _ in range(args.runs):
        _, reader, writer = await p2p.call_binary_stream_handler(peer, HIVEMIND_HANDLER)
        start = _clocks()
        writer.write(_SIZE.pack(args.total))
        sent = 0
        while sent < args.total:
            n = min(args.write_size, args.total - sent)
            writer.write(src[:n])
            await writer.drain()
            sent += n
        ack = _ACK.unpack(await reader.readexactly(_ACK.size))
        end = _clocks()
        writer.close()
        runs.append(_run_result([ack], args.total, start, end))
        log.info("hivemind run: %s", runs[-1])
    return {"runs": runs}


# --- orchestrator ---------------------------------------------------------------------------------

_OUR_PIDS = {os.getpid()}  # the orchestrator and every role it started


class Child:
    """A role process; JSON lines both ways, killed if it outlives the orchestrator's use."""

    def __init__(self, role: str, proc: asyncio.subprocess.Process) -> None:
        self.role = role
        self.proc = proc

    @classmethod
    async def start(cls, role: str, *args: object, env: dict[str, str] | None = None) -> Child:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            SCRIPT,
            "--role",
            role,
            *map(str, args),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            limit=16 * MIB,
            env=env,
        )
        _OUR_PIDS.add(proc.pid)
        return cls(role, proc)

    async def recv(self, timeout: float = CHILD_TIMEOUT) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = await asyncio.wait_for(self.proc.stdout.readline(), timeout)
        if not line:
            rc = await asyncio.wait_for(self.proc.wait(), 10)
            raise RuntimeError(f"{self.role} exited (code {rc}) without answering")
        return json.loads(line)

    async def request(self, timeout: float = CHILD_TIMEOUT, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        await self.proc.stdin.drain()
        return await self.recv(timeout)

    async def stop(self) -> None:
        if self.proc.returncode is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(b'{"cmd": "stop"}\n')
                self.proc.stdin.close()
            except (BrokenPipeError, ConnectionResetError):
                pass
            try:
                await asyncio.wait_for(self.proc.wait(), 15)
            except TimeoutError:
                log.warning("%s did not stop; killing it", self.role)
                self.proc.kill()
                await self.proc.wait()


class Children:
    """Owns every child process of a phase: all are stopped (or killed) on the way out."""

    def __init__(self) -> None:
        self._children: list[Child] = []

    async def start(self, role: str, *args: object, env: dict[str, str] | None = None) -> Child:
        child = await Child.start(role, *args, env=env)
        self._children.append(child)
        return child

    async def __aenter__(self) -> Children:
        return self

    async def __aexit__(self, *exc: object) -> None:
        # Clients first, so servers see orderly closes.
        for child in reversed(self._children):
            await child.stop()


def _machine_ticks() -> tuple[int, int]:
    """(busy, total) CPU ticks of the whole machine since boot, from /proc/stat."""
    with open("/proc/stat") as f:
        # user nice system idle iowait irq softirq steal (guest time is already in user)
        values = [int(v) for v in f.readline().split()[1:9]]
    idle = values[3] + values[4]  # idle + iowait
    return sum(values) - idle, sum(values)


def _other_process_ticks() -> dict[int, int]:
    """utime + stime of every process that is not part of this benchmark."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in _OUR_PIDS:
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                data = f.read()
        except OSError:  # it exited while we looked
            continue
        fields = data[data.rindex(")") + 2 :].split()
        out[int(name)] = int(fields[11]) + int(fields[12])
    return out


class LoadMonitor:
    """Other people's load on this (shared) machine, around every measurement.

    Before each measurement we wait (up to `max_wait`) for the machine to look idle,
    then record how much CPU other processes used while we measured. A measurement
    taken while other work ran is reported as such, not silently.
    """

    QUIET = 0.15  # machine-wide busy fraction that counts as idle

    def __init__(self, max_wait: float) -> None:
        self.max_wait = max_wait
        self.hz = os.sysconf("SC_CLK_TCK")
        self.cpus = os.cpu_count() or 1
        self.report: dict[str, dict[str, float]] = {}

    async def _busy_fraction(self, seconds: float = 0.5) -> float:
        busy0, total0 = _machine_ticks()
        await asyncio.sleep(seconds)
        busy1, total1 = _machine_ticks()
        return (busy1 - busy0) / max(total1 - total0, 1)

    async def quiet(self) -> float:
        deadline = time.monotonic() + self.max_wait
        busy = await self._busy_fraction()
        while busy >= self.QUIET and time.monotonic() < deadline:
            busy = await self._busy_fraction()
        if busy >= self.QUIET:
            log.warning("machine still %.0f%% busy with other work; measuring anyway", busy * 100)
        return busy

    async def measure(self, name: str, coro: Awaitable[dict[str, Any]]) -> dict[str, Any]:
        busy_before = await self.quiet()
        wall0, before = time.monotonic(), _other_process_ticks()
        try:
            return await coro
        finally:
            wall, after = time.monotonic() - wall0, _other_process_ticks()
            # A lower bound: processes that started and ended in between are not seen.
            other = sum(t - before.get(pid, 0) for pid, t in after.items()) / self.hz
            self.report[name] = {
                "busy_before_pct": round(busy_before * 100, 1),
                "other_cpu_pct": round(100 * other / (wall * self.cpus), 1),
                "seconds": round(wall, 1),
            }


def _median(runs: list[dict[str, float]], key: str) -> float:
    return round(statistics.median(r[key] for r in runs), 1)


def _throughput(prefix: str, runs: list[dict[str, float]]) -> dict[str, Any]:
    return {
        f"{prefix}_MBps": _median(runs, "recv_MBps"),
        f"{prefix}_send_side_MBps": _median(runs, "send_MBps"),
        f"{prefix}_cpu_bound_MBps": _median(runs, "cpu_bound_MBps"),
        f"{prefix}_recv_minflt_per_MB": _median(runs, "recv_minflt_per_MB"),
        f"{prefix}_send_minflt_per_MB": _median(runs, "send_minflt_per_MB"),
        f"{prefix}_runs": runs,
    }


async def bench_transfers(opts: argparse.Namespace, mon: LoadMonitor) -> dict[str, Any]:
    """Plain TCP and shoal throughput, then shoal RPC; every role in its own process.

    The throughput runs are interleaved (TCP, 1 stream, 8 streams; again; ...): the
    speed of this shared machine drifts by up to 2x within minutes, and interleaving
    makes each shoal run and its TCP baseline see the same conditions.
    """
    out: dict[str, Any] = {}
    async with Children() as kids:
        tcp_server = await kids.start("tcp-server", "--total", opts.total)
        port = (await tcp_server.recv())["port"]
        tcp_client = await kids.start(
            "tcp-client",
            *("--port", port, "--total", opts.total, "--write-size", opts.tcp_write_size),
        )
        await tcp_client.recv()
        server = await kids.start("shoal-server")
        addr = (await server.recv())["addr"]
        client = await kids.start("shoal-client", "--addr", addr, "--write-size", opts.write_size)
        out["aead"] = (await client.recv())["aead"]
        out["integrity_ok"] = (await client.request(cmd="verify"))["integrity_ok"]

        async def one_round() -> dict[str, Any]:
            result = {"plain_tcp": (await tcp_client.request(cmd="run", runs=1))["runs"]}
            for streams, key in ((1, "shoal_stream"), (8, "shoal_8stream")):
                request = client.request(
                    cmd="stream", total=opts.total, streams=streams, runs=1, profile=None
                )
                result[key] = (await request)["runs"]
            return result

        runs: dict[str, list[dict[str, float]]] = {}
        for i in range(opts.runs):
            for key, value in (await mon.measure(f"transfer_round_{i + 1}", one_round())).items():
                runs.setdefault(key, []).extend(value)
        for key, value in runs.items():
            out.update(_throughput(key, value))
        out["ratio_shoal_vs_tcp_per_round"] = [
            round(s["recv_MBps"] / t["recv_MBps"], 3)
            for s, t in zip(runs["shoal_stream"], runs["plain_tcp"], strict=True)
        ]
        rpc_cmd = {
            "cmd": "rpc",
            "concurrency": opts.rpc_concurrency,
            "seconds": opts.rpc_seconds,
            "warmup": 1.0,
            "runs": opts.runs,
            "payload_bytes": opts.rpc_payload,
            "unloaded_seconds": 1.0,
            "bulk_bytes": 1 << 30,
        }
        r = await mon.measure("rpc", client.request(**rpc_cmd, profile=None))
        out["rpc_calls_per_s"] = round(statistics.median(r["rates"]), 1)
        out["rpc_p50_ms"] = r["p50_ms"]
        out["rpc_p99_ms"] = r["p99_ms"]
        out["rpc_max_ms"] = r["max_ms"]
        out["rpc_runs_calls_per_s"] = r["rates"]
        # Little's law check: rate x mean latency should equal the callers in flight.
        out["rpc_mean_in_flight"] = round(out["rpc_calls_per_s"] * r["mean_ms"] / 1000, 1)
        out["rpc_1caller_calls_per_s"] = r["unloaded"]["calls_per_s"]
        out["rpc_1caller_p50_ms"] = r["unloaded"]["p50_ms"]
        out["rpc_1caller_p99_ms"] = r["unloaded"]["p99_ms"]
        out["rpc_during_bulk_p50_ms"] = r["during_bulk"]["p50_ms"]
        out["rpc_during_bulk_p99_ms"] = r["during_bulk"]["p99_ms"]
        out["rpc_during_bulk_calls"] = r["during_bulk"]["calls"]

        # Profiles come from separate, shorter runs: cProfile slows the code it watches.
        stream = out["shoal_stream_MBps"]
        stream_missed = (
            stream < TARGET_STREAM_MBPS or stream < TARGET_STREAM_RATIO * out["plain_tcp_MBps"]
        )
        rpc_missed = (
            out["rpc_calls_per_s"] < TARGET_RPC_CALLS or out["rpc_p50_ms"] >= TARGET_RPC_P50_MS
        )
        profiles: dict[str, Any] = {}
        if opts.profile == "always" or (opts.profile == "auto" and stream_missed):
            request = client.request(
                cmd="stream",
                total=opts.profile_total,
                streams=1,
                runs=1,
                profile=opts.profile_clock,
            )
            r = await mon.measure("profile_stream", request)
            run = r["runs"][0]
            profiles["stream_note"] = (
                f"1 stream, {opts.profile_total / MB:.0f} MB under cProfile "
                f"({opts.profile_clock} clock): "
                f"{run['recv_MBps']} MB/s (CPU-bound {run['cpu_bound_MBps']} MB/s)"
            )
            profiles["stream_sender"] = r["profile_sender"]
            profiles["stream_receiver"] = r["profile_receiver"]
        if opts.profile == "always" or (opts.profile == "auto" and rpc_missed):
            request = client.request(
                **{**rpc_cmd, "runs": 1, "unloaded_seconds": 0}, profile=opts.profile_clock
            )
            r = await mon.measure("profile_rpc", request)
            profiles["rpc_note"] = (
                f"{opts.rpc_concurrency} callers, {opts.rpc_seconds}s under cProfile "
                f"({opts.profile_clock} clock): "
                f"{r['rates'][0]} calls/s"
            )
            profiles["rpc_caller"] = r["profile_caller"]
            profiles["rpc_server"] = r["profile_server"]
        if profiles:
            out["profiles"] = profiles
    return out


async def bench_memory(opts: argparse.Namespace, mon: LoadMonitor) -> dict[str, Any]:
    async with Children() as kids:
        server = await kids.start("idle-server", "--conns", opts.conns)
        idle = await server.recv()
        dialer = await kids.start("dialer", "--addr", idle["addr"], "--conns", opts.conns)
        dialed = await dialer.recv()
        after = await server.request(cmd="measure", conns=opts.conns)
    n = after["connections"]
    grown = after["rss_kb_after"] - after["rss_kb_before"]
    return {
        "idle_rss_MB": round(idle["rss_kb"] * 1024 / MB, 1),
        "idle_imports_torch": idle["imports_torch"],
        "idle_imports_numpy": idle["imports_numpy"],
        # KiB of RSS growth per connection, as the kernel counts it (1 KB = 1024 B here).
        "rss_per_conn_KB": round(grown / n, 1) if n else None,
        "idle_conns": n,
        "idle_conns_dial_s": dialed["seconds"],
    }


async def bench_hivemind(opts: argparse.Namespace, mon: LoadMonitor) -> dict[str, Any]:
    async with Children() as kids:
        server = await kids.start("hivemind-server")
        info = await server.recv()
        if "unavailable" in info:
            log.info("hivemind baseline skipped: %s", info["unavailable"])
            return {"hivemind_stream_MBps": None, "hivemind_unavailable": info["unavailable"]}
        client = await kids.start(
            "hivemind-client",
            *("--peer-id", info["peer_id"], "--total", opts.total, "--runs", opts.runs),
            *("--write-size", opts.tcp_write_size, "--maddrs", *info["maddrs"]),
        )
        await client.recv(timeout=60)
        request = client.request(timeout=300, cmd="run")
        runs = (await mon.measure("hivemind", request))["runs"]
    return _throughput("hivemind_stream", runs)


def _targets(r: dict[str, Any]) -> dict[str, bool]:
    return {
        "stream_ge_1000MBps": r["shoal_stream_MBps"] >= TARGET_STREAM_MBPS,
        "stream_ge_40pct_tcp": r["shoal_stream_MBps"] >= TARGET_STREAM_RATIO * r["plain_tcp_MBps"],
        "rpc_ge_10k_per_s": r["rpc_calls_per_s"] >= TARGET_RPC_CALLS,
        "rpc_p50_lt_1ms": r["rpc_p50_ms"] < TARGET_RPC_P50_MS,
        "idle_rss_lt_60MB": r["idle_rss_MB"] < TARGET_IDLE_RSS_MB,
        "conn_lt_100KB": r["rss_per_conn_KB"] is not None and r["rss_per_conn_KB"] < TARGET_CONN_KB,
        "no_torch_at_idle": not r["idle_imports_torch"],
    }


AB_KEYS = (
    "rpc_cpu_us_per_call",
    "shoal_stream_MBps",
    "rpc_calls_per_s",
    "rpc_p50_ms",
    "rpc_p99_ms",
    "rpc_1caller_p50_ms",
    "rpc_during_bulk_p50_ms",
)


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far."""
    with open(f"/proc/{pid}/stat") as f:
        data = f.read()
    fields = data[data.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _ab_side(opts: argparse.Namespace, env: dict[str, str]) -> dict[str, Any]:
    """One side's run: a server and a client of that side's code, one stream run, RPC."""
    async with Children() as kids:
        server = await kids.start("shoal-server", env=env)
        addr = (await server.recv())["addr"]
        client = await kids.start(
            "shoal-client", "--addr", addr, "--write-size", opts.write_size, env=env
        )
        await client.recv()
        request = client.request(cmd="stream", total=opts.total, streams=1, runs=1, profile=None)
        stream = (await request)["runs"][0]
        r = await client.request(
            cmd="rpc",
            concurrency=opts.rpc_concurrency,
            seconds=opts.rpc_seconds,
            warmup=0.5,
            runs=1,
            payload_bytes=opts.rpc_payload,
            unloaded_seconds=0,
            bulk_bytes=0,
            profile=None,
        )
        # CPU per call, both processes (the warm-up included): what the code costs,
        # which the load of others on this machine moves far less than calls/s.
        before = [_cpu_seconds(k.proc.pid) for k in (server, client)]
        r = await client.request(
            cmd="rpc",
            concurrency=opts.rpc_concurrency,
            seconds=opts.rpc_seconds,
            warmup=0.001,  # (run() divides by it; a few calls)
            runs=1,
            payload_bytes=opts.rpc_payload,
            unloaded_seconds=0,
            bulk_bytes=0,
            profile=None,
        )
        cpu = sum(_cpu_seconds(k.proc.pid) for k in (server, client)) - sum(before)
        calls = r["calls_measured"]
        r1 = await client.request(
            cmd="rpc",
            concurrency=1,
            seconds=0.5,
            warmup=0.001,  # (run() divides by it; a few calls)
            runs=1,
            payload_bytes=opts.rpc_payload,
            unloaded_seconds=1.0,
            bulk_bytes=opts.total,
            profile=None,
        )
        r.update(unloaded=r1["unloaded"], during_bulk=r1["during_bulk"])
    return {
        "rpc_cpu_us_per_call": round(cpu / calls * 1e6, 1),
        "shoal_stream_MBps": round(stream["recv_MBps"], 1),
        "rpc_calls_per_s": r["rates"][0],
        "rpc_p50_ms": r["p50_ms"],
        "rpc_p99_ms": r["p99_ms"],
        "rpc_1caller_p50_ms": r["unloaded"]["p50_ms"],
        "rpc_during_bulk_p50_ms": r["during_bulk"]["p50_ms"],
    }


async def orchestrate_ab(opts: argparse.Namespace) -> dict[str, Any]:
    """The current code against `--baseline`'s, alternately (bench/baseline.py): the
    roles are this file's, each side's processes import that side's shoal."""
    sys.path.insert(0, os.path.dirname(SCRIPT))
    from baseline import checkout, compare, env_for, order

    runs: dict[str, list[dict[str, Any]]] = {"current": [], "baseline": []}
    mon = LoadMonitor(opts.quiet_wait)
    with checkout(opts.baseline) as tree:
        envs = {"current": env_for(None), "baseline": env_for(tree)}
        for i in range(opts.ab_rounds):
            for side in order(i):
                result = await mon.measure(f"{side}_{i + 1}", _ab_side(opts, envs[side]))
                log.info("%s: %s", side, result)
                runs[side].append(result)
    return {**compare(runs, AB_KEYS, opts.baseline), "background_load": mon.report}


JUDGED_KEYS = (
    "plain_tcp_MBps",
    "shoal_stream_MBps",
    "shoal_8stream_MBps",
    "rpc_calls_per_s",
    "rpc_p50_ms",
    "rpc_p99_ms",
    "idle_rss_MB",
    "rss_per_conn_KB",
    "hivemind_stream_MBps",
)


async def orchestrate(opts: argparse.Namespace) -> dict[str, Any]:
    import uvloop

    result: dict[str, Any] = {}
    mon = LoadMonitor(opts.quiet_wait)
    t0 = time.monotonic()
    log.info("throughput (plain TCP and shoal, interleaved) and RPC")
    result.update(await bench_transfers(opts, mon))
    log.info("memory")
    result.update(await bench_memory(opts, mon))
    try:
        result.update(await bench_hivemind(opts, mon))
    except Exception as e:  # an optional baseline must not cost the whole report
        log.exception("hivemind baseline failed")
        result.update({"hivemind_stream_MBps": None, "hivemind_error": repr(e)[:300]})
    tcp = result["plain_tcp_MBps"]
    result["ratio_shoal_vs_tcp"] = round(result["shoal_stream_MBps"] / tcp, 3)
    result["ratio_8stream_vs_tcp"] = round(result["shoal_8stream_MBps"] / tcp, 3)
    result["ratio_cpu_bound_shoal_vs_tcp"] = round(
        result["shoal_stream_cpu_bound_MBps"] / result["plain_tcp_cpu_bound_MBps"], 3
    )
    result["targets_met"] = _targets(result)
    result["background_load"] = mon.report
    result.update(
        {
            "python": platform.python_version(),
            "loop": "uvloop",
            "uvloop_version": uvloop.__version__,
            "cpus": os.cpu_count(),
            "total_bytes": opts.total,
            "shoal_write_bytes": opts.write_size,
            "tcp_write_bytes": opts.tcp_write_size,
            "rpc_concurrency": opts.rpc_concurrency,
            "rpc_payload_bytes": opts.rpc_payload,
            "rpc_seconds_per_run": opts.rpc_seconds,
            "idle_conns_requested": opts.conns,
            "runs": opts.runs,
            "bench_seconds": round(time.monotonic() - t0, 1),
        }
    )
    # The judged keys first, then everything else (profiles last: they are long).
    ordered = {k: result[k] for k in JUDGED_KEYS}
    ordered.update({k: v for k, v in result.items() if k not in ordered and k != "profiles"})
    if "profiles" in result:
        ordered["profiles"] = result["profiles"]
    return ordered


# --- entry point ----------------------------------------------------------------------------------

ROLES: dict[str, Callable[[argparse.Namespace], Awaitable[None]]] = {
    "tcp-server": role_tcp_server,
    "tcp-client": role_tcp_client,
    "shoal-server": role_shoal_server,
    "shoal-client": role_shoal_client,
    "idle-server": role_idle_server,
    "dialer": role_dialer,
    "hivemind-server": role_hivemind_server,
    "hivemind-client": role_hivemind_client,
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--role", choices=sorted(ROLES), help=argparse.SUPPRESS)
    p.add_argument("--total-mib", type=int, default=1024, help="bytes per throughput run")
    p.add_argument("--write-mib", type=int, default=8, help="shoal stream write size")
    p.add_argument("--tcp-write-kib", type=int, default=1024, help="plain TCP write size")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--rpc-seconds", type=float, default=2.0, help="per measured RPC run")
    p.add_argument("--rpc-concurrency", type=int, default=64)
    p.add_argument("--rpc-payload", type=int, default=32, help="echo payload bytes")
    p.add_argument("--conns", type=int, default=200, help="idle connections for RSS/conn")
    p.add_argument("--profile-mib", type=int, default=256, help="bytes of the profiled run")
    p.add_argument(
        "--quiet-wait",
        type=float,
        default=10.0,
        help="seconds to wait, before each measurement, for other load on the machine to stop",
    )
    p.add_argument(
        "--profile",
        choices=("auto", "always", "never"),
        default="auto",
        help="cProfile both sides of the stream/RPC case (auto: when its target is missed)",
    )
    p.add_argument(
        "--profile-clock",
        choices=("wall", "cpu"),
        default="wall",
        help="cProfile's timer: wall clock (default, cheap) or process CPU time (robust to "
        "preemption, but each timer read is a syscall, so it distorts more)",
    )
    p.add_argument(
        "--baseline",
        help="A/B: this commit's (or checkout's) code against the current, alternately "
        "(stream throughput and RPC only)",
    )
    p.add_argument("--ab-rounds", type=int, default=3, help="A/B rounds (one run of each)")
    # Internal: arguments of the roles.
    for name in ("--port", "--total", "--write-size"):
        p.add_argument(name, type=int, help=argparse.SUPPRESS)
    p.add_argument("--addr", help=argparse.SUPPRESS)
    p.add_argument("--peer-id", help=argparse.SUPPRESS)
    p.add_argument("--maddrs", nargs="*", help=argparse.SUPPRESS)
    opts = p.parse_args(argv)
    if opts.role is None:
        opts.total = opts.total_mib * MIB
        opts.write_size = opts.write_mib * MIB
        opts.tcp_write_size = opts.tcp_write_kib * 1024
        opts.profile_total = opts.profile_mib * MIB
    return opts


def main(argv: list[str] | None = None) -> int:
    import uvloop

    opts = parse_args(argv)
    name = opts.role or "main"
    logging.basicConfig(
        stream=sys.stderr,
        level=logging.INFO,
        format=f"%(asctime)s {name:>15} %(levelname)s %(name)s: %(message)s",
    )
    if opts.role is not None:
        uvloop.run(ROLES[opts.role](opts))
        return 0
    result = uvloop.run(orchestrate_ab(opts) if opts.baseline else orchestrate(opts))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
