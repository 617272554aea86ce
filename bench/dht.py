"""DHT benchmark: N nodes over several processes on loopback.

    python bench/dht.py [--nodes 64] [--processes 8] [--ops 200]
    python bench/dht.py --one-process 1000 [--ops 50]

Prints one JSON object on stdout (logs go to stderr):

- ``bootstrap_s``: from the moment every worker process is up (Python and
  shoal imported, the seed node listening) until all ``--nodes`` nodes have
  joined, the joins running concurrently;
- ``store_*`` / ``get_*``: latency of one operation at a time (each from a
  random node, on a fresh key; each get reads a key stored from another
  process), p50/p99 in ms, timed inside the worker that runs the operation,
  after ``--warmup`` stores (``cold_store_p50_ms``) have opened connections;
- ``loaded_*``: the same with 80 operations in flight across the processes;
- ``success_rate``: stores acknowledged by at least one replica and gets that
  returned exactly the stored value, over all operations;
- ``rss_MB_per_process``: mean RSS of the worker processes (each holds
  nodes/processes nodes); ``rss_MB_one_node_process``: a process holding a
  single DHT node, i.e. what a DHT-only peer costs;
- ``hivemind``: the same workload on hivemind's DHT when it is installed
  (null otherwise).

Workers talk to the orchestrator in JSON lines (commands on stdin, results on
stdout) and exit when their stdin closes, so nothing outlives the benchmark.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import random
import statistics
import sys
import time
from typing import Any

log = logging.getLogger("bench.dht")
SCRIPT = os.path.abspath(__file__)
LOOPBACK = ("/ip4/127.0.0.1/tcp/0",)
EXPIRATION_S = 600.0
CONCURRENT_OPS = 80


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


# ---------------------------------------------------------------------- worker


class ShoalWorker:
    """Runs this process's nodes; answers one JSON command at a time."""

    def __init__(self, replication: int | None = None) -> None:
        self.nodes: list[Any] = []
        self.hosts: list[Any] = []
        self.replication = replication

    async def _new_node(self, bootstrap: list[str]) -> Any:
        from shoal.dht.node import DHTNode
        from shoal.transport.host import Host, HostConfig
        from shoal.transport.identity import Identity

        # Every node shares 127.0.0.1: lift the per-IP limit meant for strangers.
        host = Host(
            Identity.generate(), HostConfig(listen=LOOPBACK, max_connections_per_ip=100_000)
        )
        await host.start()
        self.hosts.append(host)
        node = await DHTNode.create(
            host, bootstrap=bootstrap, bootstrap_backoff=0.1, replication=self.replication
        )
        self.nodes.append(node)
        return node

    async def seed(self, cmd: dict[str, Any]) -> dict[str, Any]:
        node = await self._new_node([])
        return {"addr": str(node.host.addresses()[0])}

    async def join(self, cmd: dict[str, Any]) -> dict[str, Any]:
        t0 = time.perf_counter()
        await asyncio.gather(*(self._new_node(cmd["bootstrap"]) for _ in range(cmd["count"])))
        return {"join_s": time.perf_counter() - t0, "nodes": len(self.nodes)}

    async def op(self, kind: str, key: str, value: Any) -> tuple[float, bool]:
        node = random.choice(self.nodes)
        t0 = time.perf_counter()
        try:
            if kind == "store":
                ok = await node.store(key, value, time.time() + EXPIRATION_S)
            else:
                got = await node.get(key)
                ok = got is not None and got.value == value
        except Exception as e:
            log.warning("%s %s failed: %r", kind, key, e)
            ok = False
        return (time.perf_counter() - t0) * 1000, ok

    async def ops(self, cmd: dict[str, Any]) -> dict[str, Any]:
        sem = asyncio.Semaphore(cmd["concurrency"])

        async def one(key: str, value: Any) -> tuple[float, bool]:
            async with sem:
                return await self.op(cmd["kind"], key, value)

        results = await asyncio.gather(*(one(k, v) for k, v in cmd["items"]))
        return {"latencies_ms": [r[0] for r in results], "ok": [r[1] for r in results]}

    async def stats(self, cmd: dict[str, Any]) -> dict[str, Any]:
        return {"rss_mb": _rss_mb(), "nodes": len(self.nodes)}

    async def close(self) -> None:
        for node in self.nodes:
            await node.aclose()
        for host in self.hosts:
            await host.aclose()


class HivemindWorker(ShoalWorker):
    """The same commands on hivemind's DHTNode (in-process, no daemon)."""

    async def _new_node(self, bootstrap: list[str]) -> Any:
        from hivemind.dht.node import DHTNode

        node = await DHTNode.create(initial_peers=bootstrap, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        self.nodes.append(node)
        return node

    async def join(self, cmd: dict[str, Any]) -> dict[str, Any]:
        # One at a time: each hivemind node starts its own p2pd daemon, and dozens
        # starting at once on a small machine miss hivemind's 15 s start-up limit.
        t0 = time.perf_counter()
        for _ in range(cmd["count"]):
            await self._new_node(cmd["bootstrap"])
        return {"join_s": time.perf_counter() - t0, "nodes": len(self.nodes)}

    async def seed(self, cmd: dict[str, Any]) -> dict[str, Any]:
        node = await self._new_node([])
        maddrs = await node.p2p.get_visible_maddrs()
        return {"addr": str(maddrs[0])}

    async def op(self, kind: str, key: str, value: Any) -> tuple[float, bool]:
        from hivemind.utils import get_dht_time

        node = random.choice(self.nodes)
        t0 = time.perf_counter()
        try:
            if kind == "store":
                ok = await node.store(key, value, get_dht_time() + EXPIRATION_S)
            else:
                got = await node.get(key)
                ok = got is not None and got.value == value
        except Exception as e:
            log.warning("%s %s failed: %r", kind, key, e)
            ok = False
        return (time.perf_counter() - t0) * 1000, ok

    async def close(self) -> None:
        for node in self.nodes:
            await node.shutdown()


async def run_worker(kind: str, replication: int | None = None) -> None:
    try:
        import uvloop  # noqa: F401  (the loop factory below)
    except ImportError:
        pass
    worker = HivemindWorker() if kind == "hivemind" else ShoalWorker(replication)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    print(json.dumps({"ready": True}), flush=True)
    try:
        while line := await reader.readline():
            cmd = json.loads(line)
            reply = await getattr(worker, cmd["cmd"])(cmd)
            print(json.dumps(reply), flush=True)
    finally:
        await worker.close()


# ---------------------------------------------------------------------- orchestrator


class Proc:
    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    @classmethod
    async def spawn(cls, kind: str, replication: int | None = None) -> Proc:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            SCRIPT,
            "--worker",
            kind,
            *(["--replication", str(replication)] if replication else []),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            limit=64 * 1024 * 1024,
        )
        self = cls(proc)
        await self.reply()
        return self

    async def send(self, cmd: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd).encode() + b"\n")
        await self.proc.stdin.drain()

    async def reply(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = await asyncio.wait_for(self.proc.stdout.readline(), 300)
        if not line:
            raise RuntimeError("worker exited")
        return json.loads(line)

    async def call(self, cmd: dict[str, Any]) -> dict[str, Any]:
        await self.send(cmd)
        return await self.reply()

    async def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            await asyncio.wait_for(self.proc.wait(), 30)
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()


def _split(nodes: int, processes: int) -> list[int]:
    """Nodes per process: one process holds a single node (a DHT-only peer),
    the others share the rest as evenly as they can."""
    if processes == 1:
        return [nodes]
    rest = nodes - 1
    share, extra = divmod(rest, processes - 1)
    return [1] + [share + (i < extra) for i in range(processes - 1)]


async def run_workload(kind: str, opts: argparse.Namespace) -> dict[str, Any]:
    counts = _split(opts.nodes, opts.processes)
    procs = await asyncio.gather(*(Proc.spawn(kind, opts.replication) for _ in counts))
    try:
        # The seed lives in the largest process; it counts as one of its nodes.
        seed = (await procs[-1].call({"cmd": "seed"}))["addr"]
        counts[-1] -= 1
        t0 = time.perf_counter()
        await asyncio.gather(
            *(
                p.call({"cmd": "join", "count": c, "bootstrap": [seed]})
                for p, c in zip(procs, counts, strict=True)
            )
        )
        bootstrap_s = time.perf_counter() - t0
        log.info("%s: %d nodes joined in %.2f s", kind, opts.nodes, bootstrap_s)

        rng = random.Random(opts.seed)
        ok_all: list[bool] = []

        def items(tag: str, n: int) -> list[tuple[str, Any]]:
            return [
                (f"bench/{tag}/{i}/{rng.random()}", {"i": i, "x": rng.random()}) for i in range(n)
            ]

        async def sequential(kind_: str, its: list[tuple[str, Any]], pick: Any) -> list[float]:
            lat: list[float] = []
            for i, it in enumerate(its):
                r = await procs[pick(i)].call(
                    {"cmd": "ops", "kind": kind_, "items": [it], "concurrency": 1}
                )
                lat += r["latencies_ms"]
                ok_all.extend(r["ok"])
            return lat

        async def loaded(kind_: str, its: list[tuple[str, Any]], shift: int) -> list[float]:
            # Each process runs its share of the operations; together 80 in flight.
            shares: list[list[tuple[str, Any]]] = [[] for _ in procs]
            for i, it in enumerate(its):
                shares[(i + shift) % len(procs)].append(it)
            per_proc = max(1, CONCURRENT_OPS // len(procs))
            rs = await asyncio.gather(
                *(
                    p.call({"cmd": "ops", "kind": kind_, "items": s, "concurrency": per_proc})
                    for p, s in zip(procs, shares, strict=True)
                    if s
                )
            )
            lat: list[float] = []
            for r in rs:
                lat += r["latencies_ms"]
                ok_all.extend(r["ok"])
            return lat

        n = len(procs)
        # Cold: the first stores also open most of the connections (Noise
        # handshakes); reported apart from the steady state measured after.
        cold_lat = await sequential("store", items("cold", opts.warmup), lambda i: i % n)
        seq_items = items("seq", opts.ops)
        store_lat = await sequential("store", seq_items, lambda i: i % n)
        # Read each key from another process than the one that wrote it.
        get_lat = await sequential("get", seq_items, lambda i: (i + 1 + i // n) % n)
        load_items = items("load", max(opts.ops, 2 * CONCURRENT_OPS))
        loaded_store = await loaded("store", load_items, 0)
        loaded_get = await loaded("get", load_items, 1)

        stats = await asyncio.gather(*(p.call({"cmd": "stats"}) for p in procs))
        rss = [s["rss_mb"] for s in stats]
        one_node = [s["rss_mb"] for s in stats if s["nodes"] == 1]

        def ms(xs: list[float], q: float) -> float | None:
            v = _percentile(xs, q)
            return None if v is None else round(v, 2)

        return {
            "nodes": opts.nodes,
            "processes": len(procs),
            "bootstrap_s": round(bootstrap_s, 3),
            "cold_store_p50_ms": ms(cold_lat, 0.5),
            "get_p50_ms": ms(get_lat, 0.5),
            "get_p99_ms": ms(get_lat, 0.99),
            "store_p50_ms": ms(store_lat, 0.5),
            "store_p99_ms": ms(store_lat, 0.99),
            "loaded_get_p50_ms": ms(loaded_get, 0.5),
            "loaded_get_p99_ms": ms(loaded_get, 0.99),
            "loaded_store_p50_ms": ms(loaded_store, 0.5),
            "loaded_store_p99_ms": ms(loaded_store, 0.99),
            "success_rate": round(sum(ok_all) / len(ok_all), 4),
            "operations": len(ok_all),
            "rss_MB_per_process": round(statistics.mean(rss), 1),
            "rss_MB_one_node_process": round(one_node[0], 1) if one_node else None,
        }
    finally:
        await asyncio.gather(*(p.close() for p in procs), return_exceptions=True)


async def one_process(opts: argparse.Namespace) -> dict[str, Any]:
    """`--one-process N`: N nodes in this process (how tests simulate big swarms).

    Joins run 64 at a time, each through up to 3 random nodes that already
    joined. Each node keeps at most `--max-dialed` connections it dialed (the
    rest are closed when idle), so N nodes fit in the descriptor limit.
    """
    from shoal.dht.node import DHTNode
    from shoal.transport.host import Host, HostConfig
    from shoal.transport.identity import Identity

    rng = random.Random(opts.seed)
    nodes: list[DHTNode] = []
    hosts: list[Host] = []
    addrs: list[str] = []

    async def new_node(bootstrap: list[str]) -> None:
        host = Host(
            Identity.generate(), HostConfig(listen=LOOPBACK, max_connections_per_ip=100_000)
        )
        hosts.append(host)
        await host.start()
        node = await DHTNode.create(host, bootstrap=bootstrap, max_connections=opts.max_dialed)
        nodes.append(node)
        addrs.append(str(host.addresses()[0]))

    gate = asyncio.Semaphore(64)

    async def join() -> None:
        async with gate:
            await new_node(rng.sample(addrs, min(3, len(addrs))))

    try:
        t0 = time.perf_counter()
        await new_node([])
        await asyncio.gather(*(join() for _ in range(opts.one_process - 1)))
        bootstrap_s = time.perf_counter() - t0
        rss_after_join = _rss_mb()
        ok, lat = 0, []
        for i in range(opts.ops):
            writer, reader = rng.sample(nodes, 2)
            await writer.store(f"one/{i}", i, time.time() + EXPIRATION_S)
            t = time.perf_counter()
            got = await reader.get(f"one/{i}")
            lat.append((time.perf_counter() - t) * 1000)
            ok += got is not None and got.value == i
        return {
            "nodes": len(nodes),
            "bootstrap_s": round(bootstrap_s, 2),
            "rss_MB": round(max(rss_after_join, _rss_mb()), 1),
            "get_p50_ms": round(_percentile(lat, 0.5) or 0, 2),
            "success_rate": ok / opts.ops,
            "max_hops": max(n.stats()["max_hops"] for n in nodes),
            "hop_bound": round(math.log2(len(nodes)) + 2, 1),
        }
    finally:
        await asyncio.gather(*(n.aclose() for n in nodes), return_exceptions=True)
        await asyncio.gather(*(h.aclose() for h in hosts), return_exceptions=True)


def _hivemind_installed() -> bool:
    try:
        import hivemind  # noqa: F401
    except ImportError:
        return False
    return True


async def orchestrate(opts: argparse.Namespace) -> dict[str, Any]:
    result = await run_workload("shoal", opts)
    hm = await run_workload("hivemind", opts) if _hivemind_installed() else None
    result["hivemind"] = hm
    if hm:
        for key in ("get_p50_ms", "store_p50_ms", "bootstrap_s"):
            if hm.get(key) and result.get(key):
                result[f"speedup_{key}"] = round(hm[key] / result[key], 2)
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", choices=("shoal", "hivemind"), help=argparse.SUPPRESS)
    p.add_argument("--nodes", type=int, default=64)
    p.add_argument("--processes", type=int, default=8)
    p.add_argument("--ops", type=int, default=200, help="operations per sequential phase")
    p.add_argument("--warmup", type=int, default=50, help="stores before measuring")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--one-process", type=int, metavar="N", help="instead: N nodes in this one process"
    )
    p.add_argument("--max-dialed", type=int, default=6, help="with --one-process")
    p.add_argument(
        "--replication",
        type=int,
        help="shoal's replicas per record (default k = 20; hivemind stores 5)",
    )
    opts = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s: %(message)s")
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    if opts.worker:
        logging.getLogger().setLevel(logging.WARNING)
        runner(run_worker(opts.worker, opts.replication))
        return
    if opts.one_process:
        logging.getLogger("shoal").setLevel(logging.ERROR)
        print(json.dumps(runner(one_process(opts)), indent=2))
        return
    print(json.dumps(runner(orchestrate(opts)), indent=2))


if __name__ == "__main__":
    main()
