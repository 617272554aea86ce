"""The averaging workload: real Hosts, DHTNodes and Averagers (matchmaking, butterfly
all-reduce, commits) over the simulated network; commits per minute and group sizes."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import Counter
from typing import Any

import torch
from dht_scenario import DHTRun, SimPeer, percentile
from scenario import Scenario
from simnet import SimNetwork

from shoal.averaging.averager import Averager, AveragerConfig
from shoal.averaging.matchmaking import MatchmakingConfig

log = logging.getLogger("sim.avg")


async def _steps(
    peer: SimPeer, averager: Averager, size: int, until: float, rng: random.Random
) -> list[dict[str, Any]]:
    """Step until virtual time `until`, each round on a fresh random input."""
    loop = asyncio.get_running_loop()
    results: list[dict[str, Any]] = []
    (vector,) = averager.tensors
    while loop.time() < until:
        vector.copy_(
            torch.randn(size, generator=torch.Generator().manual_seed(rng.getrandbits(32)))
        )
        r = await averager.step(timeout=60.0)
        results.append(
            {
                "t": loop.time(),
                "committed": r.committed,
                "group_size": r.group_size,
                "resynced": r.resynced,
                "reason": r.reason,
                "fingerprint": r.fingerprint,
                "seconds": r.seconds,
                "matchmaking_s": sum(a.matchmaking_s for a in r.attempt_log),
                "averaging_s": sum(a.averaging_s for a in r.attempt_log),
            }
        )
        if not r.committed:
            await asyncio.sleep(0.1)  # as tests/averaging_peer.py: a pause after an abort
    return results


async def run_averaging(scenario: Scenario, net: SimNetwork, rng: random.Random) -> dict[str, Any]:
    """`peers` peers join one DHT, then each steps an Averager over a `size`-float
    vector for `duration_s` virtual seconds."""
    w = scenario.workload
    loop = asyncio.get_running_loop()
    run = DHTRun(scenario, net, rng)
    n = scenario.peers
    await run.join_all(n, float(w.get("join_window_s", 1.0)))
    size = int(w.get("size", 1000))
    config = AveragerConfig(
        matchmaking=MatchmakingConfig(
            min_group_size=int(w.get("min_group_size", 2)),
            target_group_size=int(w.get("target_group_size", 16)),
            matchmaking_time=float(w.get("matchmaking_time", 1.0)),
        )
    )
    averagers: list[Averager] = []
    for p in run.live():
        assert p.node is not None
        averagers.append(await run.on(p, _make(p, size, config)))
    start = loop.time()
    until = start + float(w.get("duration_s", 300))
    wall0 = time.perf_counter()
    cpu0, peer_cpu0 = time.thread_time(), getattr(loop, "peer_cpu_s", 0.0)
    per_peer = await asyncio.gather(
        *(
            run.on(p, _steps(p, a, size, until, random.Random(rng.getrandbits(32))))
            for p, a in zip(run.live(), averagers, strict=True)
        )
    )
    elapsed_min = (loop.time() - start) / 60
    cpu_s = time.thread_time() - cpu0
    peer_cpu_s = getattr(loop, "peer_cpu_s", 0.0) - peer_cpu0
    for p, a in zip(run.live(), averagers, strict=True):
        await run.on(p, a.aclose())
    steps = [s for results in per_peer for s in results]
    committed = [s for s in steps if s["committed"]]
    sizes = [s["group_size"] for s in committed]
    result = {
        "peers": n,
        "steps": len(steps),
        "commits": len(committed),
        "commits_per_peer_per_min": round(len(committed) / n / elapsed_min, 2),
        "group_size_mean": round(sum(sizes) / len(sizes), 2) if sizes else None,
        "group_size_p50": percentile(sizes, 0.5),
        "group_sizes": dict(sorted(Counter(sizes).items())),
        "resyncs": sum(1 for s in steps if s["resynced"]),
        "aborts": dict(Counter(s["reason"] for s in steps if not s["committed"])),
        **phases(committed),
        # every peer's CPU (one thread runs them all) per step that committed; with
        # "cores", the part of it charged to the peers (less the simulator's own)
        "cpu_s_per_commit": round(cpu_s / len(committed), 4) if committed else None,
        "peer_cpu_s_per_commit": round(peer_cpu_s / len(committed), 4) if committed else None,
        "averaging_wall_s": round(time.perf_counter() - wall0, 3),
        "net": vars(net.stats).copy(),
    }
    await run.close()
    result["virtual_s"] = round(loop.time(), 3)
    return result


def phases(committed: list[dict[str, Any]]) -> dict[str, float | None]:
    """The mean seconds of a committed step, and of its matchmaking and averaging."""
    return {
        f"{k}_mean": round(sum(s[k] for s in committed) / len(committed), 4) if committed else None
        for k in ("seconds", "matchmaking_s", "averaging_s")
    }


async def _make(peer: SimPeer, size: int, config: AveragerConfig) -> Averager:
    assert peer.node is not None
    return Averager(peer.node, "sim/avg", [torch.zeros(size)], config=config)
