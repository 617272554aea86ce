"""Flood benchmark: a victim peer under attack from another process, against a baseline.

    python bench/flood.py [--seconds 60] [--attacks connect,halfopen,...] [--rate 2000]

The victim (this process) runs a Host with the daemon's limits, an RPC service and
the status server, all on loopback; attacks come from 127.1.x.y (loopback
addresses other than the honest 127.0.0.1) so the victim applies its per-IP and
per-subnet caps to them (`admission_exempt_loopback=False`). An attacker is a
child process (`--attacker`), so the victim's loop pays only for serving it.

Phases: a baseline of `--seconds` without attack, then each attack for
`--seconds`. During every phase an honest prober, twice a second, connects as a
new peer and makes an RPC call, calls over a standing honest connection, and
asks /healthz. Attacks:

- ``connect``: `--rate` TCP connection attempts per second from `--ips`
  addresses (default one), each left silent;
- ``halfopen``: the same, each sending a valid first Noise message then nothing,
  from 256 addresses in 32 /24s;
- ``garbage``: `--rate`/10 connections per second sending 4 KiB of random bytes;
- ``storm``: one authenticated peer making RPC calls as fast as 512 callers can;
- ``streams``: one peer opening 2,000 idle streams every 5 s;
- ``slowloris``: 600 sockets on the status port trickling header lines, reopened
  when closed.

Prints one JSON object: per phase, honest call latency (p50/p99/max ms, failures),
/healthz latency, the victim's RSS growth (MB), log lines written, and the
attacker's own counts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import subprocess
import sys
import time
from typing import Any

SCRIPT = os.path.abspath(__file__)
PROTO = "/shoal/flood-bench/1.0.0"
ATTACKS = ("connect", "halfopen", "garbage", "storm", "streams", "slowloris")
log = logging.getLogger("bench.flood")


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return round(values[min(len(values) - 1, int(q * len(values)))], 1)


def _ip(i: int, per_subnet: int) -> str:
    return f"127.1.{(i // per_subnet) % 250}.{1 + i % per_subnet}"


# --- attacker (child process) ---------------------------------------------------------------


class Attacker:
    def __init__(self, opts: argparse.Namespace) -> None:
        self.opts = opts
        host, port = opts.target.rsplit(":", 1)
        self.target = (host, int(port))
        self.counts = {"attempts": 0, "connected": 0, "refused": 0, "closed_by_victim": 0}
        self.stop = asyncio.Event()

    async def hold(self, src: str, first: bytes) -> None:
        self.counts["attempts"] += 1
        try:
            reader, writer = await asyncio.open_connection(*self.target, local_addr=(src, 0))
        except OSError:
            self.counts["refused"] += 1
            return
        self.counts["connected"] += 1
        try:
            if first:
                writer.write(first)
            while await reader.read(65536):
                pass
            self.counts["closed_by_victim"] += 1
        except OSError:
            self.counts["closed_by_victim"] += 1
        finally:
            writer.transport.abort()

    async def paced(self, rate: float, ips: int, per_subnet: int, first: Any) -> None:
        tasks: set[asyncio.Task[None]] = set()
        t0 = time.perf_counter()
        n = 0
        while not self.stop.is_set():
            due = int((time.perf_counter() - t0) * rate)
            while n < due and len(tasks) < 15000:  # (file descriptors)
                data = first() if callable(first) else first
                task = asyncio.create_task(self.hold(_ip(n % ips, per_subnet), data))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                n += 1
            await asyncio.sleep(0.005)
        for t in tasks:
            t.cancel()

    async def storm(self) -> None:
        from shoal.transport import rpc
        from shoal.transport.host import Host, HostConfig
        from shoal.transport.identity import Identity

        host = Host(Identity.generate(), HostConfig(listen=()))
        await host.start()
        ok = busy = failed = 0

        async def caller() -> None:
            nonlocal ok, busy, failed
            while not self.stop.is_set():
                try:
                    await rpc.call(host, self.opts.peer_addr, PROTO, "nap", b"x" * 100)
                    ok += 1
                except rpc.PeerBusy:
                    busy += 1
                except Exception:
                    failed += 1

        await asyncio.gather(*(caller() for _ in range(512)))
        self.counts.update(calls_ok=ok, calls_busy=busy, calls_failed=failed)
        await host.aclose()

    async def streams(self) -> None:
        from shoal.transport.host import Host, HostConfig
        from shoal.transport.identity import Identity

        host = Host(Identity.generate(), HostConfig(listen=()))
        await host.start()
        opened = 0
        while not self.stop.is_set():
            try:
                conn = await host.connect(self.opts.peer_addr)
                for _ in range(2000):
                    await conn.open_stream(PROTO)
                    opened += 1
            except Exception:
                self.counts["refused"] += 1
            try:
                await asyncio.wait_for(self.stop.wait(), 5)
            except TimeoutError:
                pass
        self.counts["streams_opened"] = opened
        await host.aclose()

    async def slowloris(self) -> None:
        async def one(i: int) -> None:
            while not self.stop.is_set():
                self.counts["attempts"] += 1
                try:
                    _, writer = await asyncio.open_connection(
                        *self.target, local_addr=(_ip(i % 60, 10), 0)
                    )
                    self.counts["connected"] += 1
                    writer.write(b"GET /status HTTP/1.1\r\n")
                    for k in range(10_000):
                        if self.stop.is_set():
                            break
                        writer.write(b"X-%d: y\r\n" % k)
                        await writer.drain()
                        await asyncio.sleep(1.0)
                    writer.transport.abort()
                except (OSError, RuntimeError):  # (uvloop: RuntimeError on a closed transport)
                    self.counts["closed_by_victim"] += 1
                    await asyncio.sleep(0.2)

        await asyncio.gather(*(one(i) for i in range(600)))

    async def run(self) -> dict[str, Any]:
        o = self.opts
        asyncio.get_running_loop().call_later(o.seconds, self.stop.set)
        if o.attacker == "connect":
            await self.paced(o.rate, o.ips, 8, b"")
        elif o.attacker == "halfopen":
            from shoal.transport.identity import Identity
            from shoal.transport.secure import SecureHandshake

            ident = Identity.generate()
            await self.paced(o.rate, 256, 8, lambda: SecureHandshake(ident, True, None).start())
        elif o.attacker == "garbage":
            await self.paced(o.rate / 10, 64, 8, lambda: os.urandom(4096))
        elif o.attacker == "storm":
            await self.storm()
        elif o.attacker == "streams":
            await self.streams()
        elif o.attacker == "slowloris":
            await self.slowloris()
        return self.counts


# --- victim (this process) ------------------------------------------------------------------


class LineCounter(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines = 0
        self.samples: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines += 1
        if len(self.samples) < 12:
            self.samples.append(f"{record.levelname} {record.getMessage()[:160]}")


async def victim(opts: argparse.Namespace) -> dict[str, Any]:
    from shoal.peer.status.server import StatusServer
    from shoal.transport import rpc
    from shoal.transport.host import Host, HostConfig
    from shoal.transport.identity import Identity

    sys.path.insert(0, os.path.join(os.path.dirname(SCRIPT), "..", "tests"))
    from test_status_server import FakeProvider  # a provider with realistic content

    from shoal.peer.status.metrics import Metrics

    counter = LineCounter()
    logging.getLogger("shoal").addHandler(counter)
    logging.getLogger("shoal").setLevel(logging.INFO)
    host = Host(
        Identity.generate(),
        HostConfig(listen=("/ip4/127.0.0.1/tcp/0",), admission_exempt_loopback=False),
    )
    await host.start()
    service = rpc.RpcService(host, PROTO)

    @service.unary("echo")
    async def echo(ctx: rpc.CallContext, payload: Any) -> Any:
        return payload

    @service.unary("nap")
    async def nap(ctx: rpc.CallContext, payload: Any) -> Any:
        await asyncio.sleep(0.02)
        return payload

    provider = FakeProvider()
    status = StatusServer(provider, Metrics(provider), "127.0.0.1", 0)  # type: ignore[arg-type]
    await status.start()
    http_port = int(status.url.rsplit(":", 1)[1])
    addr = str(host.addresses()[0])
    tcp = host.addresses()[0].tcp_endpoint()
    assert tcp is not None
    standing = Host(Identity.generate(), HostConfig(listen=()))
    await standing.start()
    await standing.connect(addr)

    async def phase(name: str) -> dict[str, Any]:
        new_ms: list[float] = []
        call_ms: list[float] = []
        health_ms: list[float] = []
        failures: list[str] = []
        child = None
        rss0, lines0 = _rss_mb(), counter.lines
        if name != "baseline":
            target = f"127.0.0.1:{http_port}" if name == "slowloris" else f"{tcp[0]}:{tcp[1]}"
            child = await asyncio.create_subprocess_exec(
                sys.executable, SCRIPT, "--attacker", name, "--target", target,
                "--peer-addr", addr, "--seconds", str(opts.seconds), "--rate", str(opts.rate),
                "--ips", str(opts.ips), stdout=subprocess.PIPE,
            )  # fmt: skip
            await asyncio.sleep(1.0)  # (the attacker imports and starts)
        t_end = time.perf_counter() + opts.seconds - (1.0 if child else 0.0)
        while time.perf_counter() < t_end:
            t0 = time.perf_counter()
            try:
                fresh = Host(Identity.generate(), HostConfig(listen=(), close_grace=0.1))
                await fresh.start()
                try:
                    await rpc.call(fresh, addr, PROTO, "echo", 1, timeout=10)
                finally:
                    await fresh.aclose()
                new_ms.append((time.perf_counter() - t0) * 1000)
                t1 = time.perf_counter()
                await rpc.call(standing, host.peer_id, PROTO, "echo", 1, timeout=10)
                call_ms.append((time.perf_counter() - t1) * 1000)
                t2 = time.perf_counter()
                await _healthz(("127.0.0.1", http_port))
                health_ms.append((time.perf_counter() - t2) * 1000)
            except Exception as e:
                failures.append(f"{type(e).__name__}: {str(e)[:120]}")
            await asyncio.sleep(max(0.0, 0.5 - (time.perf_counter() - t0)))
        rss_peak = _rss_mb()
        attacker: dict[str, Any] | None = None
        if child is not None:
            out, _ = await child.communicate()
            attacker = json.loads(out.decode() or "null")
        return {
            "honest_new_peer_call_ms": {"p50": _pct(new_ms, 0.5), "p99": _pct(new_ms, 0.99),
                                        "max": _pct(new_ms, 1.0), "n": len(new_ms)},
            "honest_call_ms": {"p50": _pct(call_ms, 0.5), "p99": _pct(call_ms, 0.99),
                               "max": _pct(call_ms, 1.0)},
            "healthz_ms": {"p50": _pct(health_ms, 0.5), "p99": _pct(health_ms, 0.99),
                           "max": _pct(health_ms, 1.0)},
            "honest_failures": len(failures),
            "failure_samples": failures[:3],
            "rss_growth_MB": round(rss_peak - rss0, 1),
            "log_lines": counter.lines - lines0,
            "attacker": attacker,
            "victim_admission": {"evicted": host.admission.evicted,
                                 "pending_now": host.admission.pending},
        }  # fmt: skip

    out: dict[str, Any] = {"seconds_per_phase": opts.seconds, "rate": opts.rate, "ips": opts.ips}
    out["rss_MB_start"] = round(_rss_mb(), 1)
    out["baseline"] = await phase("baseline")
    for name in opts.attacks.split(","):
        out[name] = await phase(name)
        await asyncio.sleep(2)  # (let the victim close what the attack left)
    out["rss_MB_end"] = round(_rss_mb(), 1)
    out["log_samples"] = counter.samples
    await standing.aclose()
    await status.aclose()
    await host.aclose()
    return out


async def _healthz(addr: tuple[str, int]) -> None:
    async with asyncio.timeout(10):
        reader, writer = await asyncio.open_connection(*addr)
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        head = await reader.readline()
        await reader.read()
        writer.close()
    if not head.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"/healthz answered {head!r}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=60.0, help="per phase")
    p.add_argument("--attacks", default=",".join(ATTACKS))
    p.add_argument("--rate", type=float, default=2000.0, help="connection attempts per second")
    p.add_argument("--ips", type=int, default=1, help="source addresses of the connect flood")
    p.add_argument("--attacker", choices=ATTACKS, help=argparse.SUPPRESS)
    p.add_argument("--target", help=argparse.SUPPRESS)
    p.add_argument("--peer-addr", help=argparse.SUPPRESS)
    opts = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    random.seed(1)
    if opts.attacker:
        print(json.dumps(asyncio.run(Attacker(opts).run())), flush=True)
        return
    for name in opts.attacks.split(","):
        if name not in ATTACKS:
            p.error(f"unknown attack {name!r}; one of {', '.join(ATTACKS)}")
    print(json.dumps(asyncio.run(victim(opts)), indent=1))


if __name__ == "__main__":
    main()
