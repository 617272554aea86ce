"""The DHT workload: real Hosts and DHTNodes join over the simulated network, store keys,
look them up (hops, latency, keys found) and churn; the figures as one dict."""

from __future__ import annotations

import asyncio
import gc
import logging
import random
import time
from bisect import bisect_left, bisect_right
from collections import Counter
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

from scenario import Scenario, sim_ip
from simnet import SimHost, SimNetwork
from vtime import EPOCH, freeze_setup

from shoal.dht.node import DHTNode
from shoal.dht.routing import ID_BITS, bucket_range, key_id, node_id
from shoal.transport.host import Host, HostConfig
from shoal.transport.identity import Identity
from shoal.transport.multiaddr import Multiaddr

log = logging.getLogger("sim.dht")
PORT = 4001
T = TypeVar("T")


@dataclass(eq=False)
class SimPeer:
    index: int
    sim: SimHost
    kind: str
    host: Host | None = None
    node: DHTNode | None = None
    joined_at: float | None = None
    left_at: float | None = None
    join_s: float | None = None

    @property
    def live(self) -> bool:
        return self.node is not None and self.left_at is None

    def addr(self) -> str:
        return f"/ip4/{self.sim.ip}/tcp/{PORT}/p2p/{self.host.peer_id}"  # type: ignore[union-attr]


@dataclass
class DHTRun:
    """One run of the DHT workload of `scenario` over `net` (on the running loop)."""

    scenario: Scenario
    net: SimNetwork
    rng: random.Random
    peers: list[SimPeer] = field(default_factory=list)
    join_failures: int = 0
    departures: int = 0
    arrivals: int = 0
    # Told of each peer once its node is up, and when it leaves (a workload's own code
    # on every peer, newcomers included).
    on_join: Callable[[SimPeer], None] | None = None
    on_leave: Callable[[SimPeer], None] | None = None
    _closing: set[asyncio.Task[None]] = field(default_factory=set)

    def _options(self) -> dict[str, Any]:
        return dict(self.scenario.workload.get("dht_options", {}))

    def _new_sim_host(self) -> SimPeer:
        i = len(self.peers)
        kind, link, nat = self.scenario.draw_link(self.rng)
        if i == 0:
            nat = False  # the bootstrap peer is reachable
        peer = SimPeer(i, self.net.add_host(sim_ip(i), link, nat=nat), kind)
        self.peers.append(peer)
        return peer

    async def _start(self, peer: SimPeer, bootstrap: list[str]) -> None:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        identity = Identity.from_seed(self.rng.randbytes(32))  # reproducible runs
        listen = (f"/ip4/{peer.sim.ip}/tcp/{PORT}",)
        # (`max_connections` in the workload: each host's limit, its trimming from 3/4)
        limit = int(self.scenario.workload.get("max_connections", HostConfig().max_connections))
        host = Host(identity, HostConfig(listen=listen, max_connections=limit))
        await host.start()
        peer.host = host
        nat = peer.sim.nat
        try:
            peer.node = await DHTNode.create(
                host,
                bootstrap=bootstrap,
                serves=(lambda: False) if nat else None,
                **self._options(),
            )
        except Exception as e:
            log.info("peer %d failed to join: %r", peer.index, e)
            self.join_failures += 1
            peer.left_at = loop.time()
            await host.aclose()
            return
        peer.joined_at = loop.time()
        peer.join_s = peer.joined_at - t0
        if self.on_join is not None:
            self.on_join(peer)

    def start_peer(self, bootstrap: list[str]) -> asyncio.Task[None]:
        peer = self._new_sim_host()
        loop = asyncio.get_running_loop()
        return loop.create_task(self._start(peer, bootstrap), context=peer.sim.context.copy())

    @staticmethod
    def on(peer: SimPeer, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        """Run `coro` as `peer`'s code: its connections leave from its address."""
        return asyncio.get_running_loop().create_task(coro, context=peer.sim.context.copy())

    def live(self) -> list[SimPeer]:
        return [p for p in self.peers if p.live]

    # --- phases -------------------------------------------------------------------------------

    async def join_all(self, count: int, window_s: float, *, warm: int = 0) -> None:
        """The first peer starts the network (or the first `warm` peers start at once,
        `warm_all`); the others join through it, at times spread uniformly over
        `window_s`."""
        if warm > 0:
            await self.warm_all(warm)
        else:
            await self.start_peer([])
        seed = [self.peers[0].addr()]
        loop = asyncio.get_running_loop()
        starts = sorted(self.rng.uniform(0, window_s) for _ in range(count - len(self.peers)))
        t0 = loop.time()
        wall0 = time.perf_counter()
        tasks = []
        step = max(1, len(starts) // 10)
        done = 0

        def progress(_: asyncio.Task[None]) -> None:  # how far a long run got (stderr)
            nonlocal done
            done += 1
            if done % step == 0:
                log.warning("%d of %d joins done: virtual %.1f s, wall %.1f s", done, len(starts),
                            loop.time(), time.perf_counter() - wall0)  # fmt: skip

        for at in starts:
            await asyncio.sleep(max(0.0, t0 + at - loop.time()))
            tasks.append(self.start_peer(seed))
            tasks[-1].add_done_callback(progress)
        await asyncio.gather(*tasks)
        freeze_setup()

    async def warm_all(self, count: int) -> None:
        """`count` peers up at once, each table filled as joins and refreshes would
        have filled it (in every bucket, up to k peers drawn from its range of IDs),
        none connected yet: a settled swarm whose idle connections have closed,
        without paying for `count` joins (at 10,000 peers the joins, their dials and
        Noise handshakes, were nearly all of a run's wall time). Only peers that serve
        the DHT (not behind a NAT) go into tables, as they do when they join."""
        wall0 = time.perf_counter()
        peers = [self._new_sim_host() for _ in range(count)]
        await asyncio.gather(*(self.on(p, self._start(p, [])) for p in peers))
        for p in peers:
            p.join_s = None  # (no join: the join figures are the real joins')
        serving = sorted(
            (node_id(p.host.peer_id), p)
            for p in peers
            if p.live and not p.sim.nat  # type: ignore[union-attr]
        )
        ids = [nid for nid, _ in serving]
        addrs = {p.index: (Multiaddr(f"/ip4/{p.sim.ip}/tcp/{PORT}"),) for _, p in serving}
        now = asyncio.get_running_loop().time()
        for p in peers:
            if not p.live:
                continue
            table = p.node.routing_table  # type: ignore[union-attr]
            for index in range(ID_BITS):
                low, high = bucket_range(table.local_id, index)
                lo, hi = bisect_left(ids, low), bisect_right(ids, high)
                span = range(lo, hi)
                picks = span if len(span) <= table.k else self.rng.sample(span, table.k)
                for j in picks:
                    other = serving[j][1]
                    table.add_or_update(other.host.peer_id, addrs[other.index], now)  # type: ignore[union-attr]
        log.warning("%d peers started with filled tables: wall %.1f s", count,
                    time.perf_counter() - wall0)  # fmt: skip

    def _crash(self, peer: SimPeer) -> None:
        loop = asyncio.get_running_loop()
        peer.left_at = loop.time()
        self.net.crash(peer.sim)
        self.departures += 1
        if self.on_leave is not None:
            self.on_leave(peer)

        async def stop() -> None:  # its tasks end; the network already drops its traffic
            assert peer.node is not None and peer.host is not None
            await peer.node.aclose()
            await peer.host.aclose()

        task = loop.create_task(stop(), context=peer.sim.context.copy())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def churn(self, duration_s: float) -> None:
        """For `duration_s`: peers leave (crash) after exponential sessions of the
        scenario's mean, each replaced by a newcomer joining through a live peer."""
        churn = self.scenario.churn
        if churn is None or duration_s <= 0:
            await asyncio.sleep(max(0.0, duration_s))
            return
        loop = asyncio.get_running_loop()
        end = loop.time() + duration_s
        # Memoryless sessions: departures across n live peers are a Poisson process
        # of rate n / mean (the bootstrap peer stays: it is the newcomers' way in).
        rate_per_peer = 1.0 / (churn.mean_session_min * 60)
        joins = []
        while True:
            live = [p for p in self.live() if p.index != 0]
            wait = self.rng.expovariate(rate_per_peer * max(1, len(live)))
            if loop.time() + wait >= end:
                await asyncio.sleep(max(0.0, end - loop.time()))
                break
            await asyncio.sleep(wait)
            live = [p for p in self.live() if p.index != 0]
            if not live:
                continue
            self._crash(self.rng.choice(live))
            via = self.rng.choice([p for p in self.live()])
            joins.append(self.start_peer([via.addr()]))
            self.arrivals += 1
        await asyncio.gather(*joins)

    async def store_keys(self, count: int, concurrency: int) -> dict[str, Any]:
        """`count` keys, each stored by a random live peer; which were acknowledged."""
        sem = asyncio.Semaphore(concurrency)
        stored: dict[str, Any] = {}

        async def one(i: int) -> None:
            key, value = f"sim/key/{i}", {"i": i, "pad": self.rng.randbytes(16)}
            async with sem:
                writer = self.rng.choice(self.live())
                assert writer.node is not None
                ok = await self.on(writer, writer.node.store(key, value, time.time() + 3600))
            if ok:
                stored[key] = value

        await asyncio.gather(*(one(i) for i in range(count)))
        return stored

    async def get_keys(self, stored: dict[str, Any], concurrency: int) -> tuple[int, list[float]]:
        """Each stored key read by a random live peer: how many came back intact, and
        each read's latency (virtual seconds)."""
        sem = asyncio.Semaphore(concurrency)
        loop = asyncio.get_running_loop()
        latencies: list[float] = []
        found = 0

        async def one(key: str, value: Any) -> None:
            nonlocal found
            async with sem:
                reader = self.rng.choice(self.live())
                assert reader.node is not None
                t0 = loop.time()
                got = await self.on(reader, reader.node.get(key))
                latencies.append(loop.time() - t0)
            if got is not None and got.value == value:
                found += 1
            else:
                log.warning(
                    "%s not found by peer %d: %d live holders", key, reader.index, self.holders(key)
                )

        await asyncio.gather(*(one(k, v) for k, v in stored.items()))
        return found, latencies

    def holders(self, key: str) -> int:
        """How many live peers hold `key` (what the simulator knows, not the peers)."""
        now = time.time()
        return sum(1 for p in self.live() if p.node and p.node.storage.get_many([key], now))

    async def lookups(self, count: int, concurrency: int) -> tuple[list[int], list[float]]:
        """`count` node lookups of random targets from random live peers: hops and
        latency (virtual seconds) of each."""
        sem = asyncio.Semaphore(concurrency)
        loop = asyncio.get_running_loop()
        hops: list[int] = []
        latencies: list[float] = []

        async def one() -> None:
            async with sem:
                who = self.rng.choice(self.live())
                assert who.node is not None
                t0 = loop.time()
                target = key_id(f"sim/target/{self.rng.random()}")
                res = await self.on(who, who.node.find_node(target))
                latencies.append(loop.time() - t0)
                hops.append(res.hops)

        await asyncio.gather(*(one() for _ in range(count)))
        return hops, latencies

    async def close(self) -> None:
        for p in self.peers:
            if p.live:
                assert p.node is not None and p.host is not None
                self.net.crash(p.sim)  # nobody needs goodbyes at the end of the world
                await p.node.aclose()
                await p.host.aclose()
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)

    def requests_sent(self) -> int:
        return sum(p.node.count("requests_sent", 0) for p in self.peers if p.node)

    def connections(self) -> dict[str, float]:
        """Open connections per live peer (mean, max) and how many were trimmed in all
        (`HostConfig.trim`): a peer's memory grows with the first, in the simulator
        twice (both ends of every connection live in this process)."""
        hosts = [p.host for p in self.peers if p.live and p.host is not None]
        counts = [len(h.open_connections()) for h in hosts] or [0]
        return {
            "open_per_peer_mean": round(sum(counts) / len(counts), 1),
            "open_per_peer_max": max(counts),
            "trimmed": sum(h.connections_trimmed for h in hosts),
        }

    def counters(self) -> dict[str, int]:
        """The DHT counters of every peer that ran, summed."""
        total: dict[str, int] = {}
        for p in self.peers:
            if p.node is not None:
                for name, value in p.node._counters.items():
                    total[name] = total.get(name, 0) + value
        return total

    def peer_minutes(self, now: float) -> float:
        total = 0.0
        for p in self.peers:
            if p.joined_at is not None:
                total += ((p.left_at if p.left_at is not None else now) - p.joined_at) / 60
        return total


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


async def run_dht(scenario: Scenario, net: SimNetwork, rng: random.Random) -> dict[str, Any]:
    """The DHT workload; its figures (virtual seconds and milliseconds)."""
    w = scenario.workload
    loop = asyncio.get_running_loop()
    gc.collect()
    rss0 = rss_bytes()
    run = DHTRun(scenario, net, rng)
    n = scenario.peers
    join_window = float(w.get("join_window_s", n * 0.05))
    concurrency = int(w.get("concurrency", 32))
    wall0 = time.perf_counter()

    def phase(name: str) -> None:  # progress on stderr: how far a long run got
        log.warning("%s: virtual %.1f s, wall %.1f s, %d live peers", name, loop.time(),
                    time.perf_counter() - wall0, len(run.live()))  # fmt: skip

    # `warm_start`: that many peers start with filled tables (`DHTRun.warm_all`), the
    # rest join through the first of them for real (their joins are the join figures).
    await run.join_all(n, join_window, warm=int(w.get("warm_start", 0)))
    joined_at = loop.time()
    phase("joined")
    gc.collect()
    rss_joined = rss_bytes()
    requests_before, minutes_before = run.requests_sent(), run.peer_minutes(loop.time())
    await asyncio.sleep(float(w.get("settle_s", 30)))
    idle_requests = run.requests_sent() - requests_before
    idle_minutes = run.peer_minutes(loop.time()) - minutes_before
    phase("settled")
    stored = await run.store_keys(int(w.get("keys", 100)), concurrency)
    phase("stored")
    await run.churn(float(w.get("churn_s", 0)))
    phase("churned")
    found, get_latencies = await run.get_keys(stored, concurrency)
    phase("read")
    hops, lookup_latencies = await run.lookups(int(w.get("lookups", 100)), concurrency)
    phase("looked up")
    now = loop.time()
    requests = run.requests_sent() - requests_before
    minutes = run.peer_minutes(now) - minutes_before
    keys = int(w.get("keys", 100))
    join_times = [p.join_s for p in run.peers if p.join_s is not None]
    result = {
        "peers": n,
        "peers_live_at_end": len(run.live()),
        "join_failures": run.join_failures,
        "links": dict(Counter(p.kind for p in run.peers)),
        "nat_peers": sum(1 for p in run.peers if p.sim.nat),
        "departures": run.departures,
        "arrivals": run.arrivals,
        "bootstrap_s": round(joined_at, 3),
        "join_s_p50": _round(percentile(join_times, 0.5)),
        "join_s_p99": _round(percentile(join_times, 0.99)),
        "keys": keys,
        "keys_stored": len(stored),
        "keys_found": found,
        "keys_found_fraction": round(found / keys, 4) if keys else None,
        "lookups": len(hops),
        "lookup_hops_p50": percentile(hops, 0.5),
        "lookup_hops_p99": percentile(hops, 0.99),
        "lookup_latency_ms_p50": _ms(percentile(lookup_latencies, 0.5)),
        "lookup_latency_ms_p99": _ms(percentile(lookup_latencies, 0.99)),
        "get_latency_ms_p50": _ms(percentile(get_latencies, 0.5)),
        "get_latency_ms_p99": _ms(percentile(get_latencies, 0.99)),
        # All requests the peers sent (upkeep and the workload) after the joins,
        # and those of the quiet settling time alone (upkeep: refreshes, pings).
        "dht_requests_per_peer_per_min": round(requests / minutes, 2) if minutes else None,
        "dht_idle_requests_per_peer_per_min": (
            round(idle_requests / idle_minutes, 2) if idle_minutes else None
        ),
        "memory_per_peer_kB": round((rss_joined - rss0) / n / 1024, 1),
        "net": vars(net.stats).copy(),
        "dht_counters": run.counters(),
    }
    await run.close()
    result["virtual_s"] = round(loop.time(), 3)
    result["wall_clock_epoch"] = EPOCH
    return result


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1000, 1)
