"""The Moshpit workload: how fast a swarm larger than one group agrees on one state.

Every peer starts from its own random vector and steps an `Averager` `rounds` times in
a row without changing it (a burst of rounds): the spread of the peers' vectors after
each round says how far the swarm is from holding one state. Two arms over the same
peers and links, one after the other: the Moshpit grid (`grid_dims`, `grid_side`),
then one matchmaking key for everyone with the same target group size (today's
default; twice the side unless the scenario says otherwise).

Figures per arm: `state_spread` (after each round k, the largest difference of any
peer's vector to the peers' mean, over the inputs' largest magnitude),
`rounds_to_agreement` (the first round whose spread is at most `AGREEMENT`, about 8
float32 epsilons: what rounding in a different order leaves), `mean_error` (the
final vectors against the exact mean of all inputs: work lost), `lost_work_fraction`
(inputs overwritten by a re-sync, or never committed, before any round averaged
them), `bytes_per_peer_per_round` and `dht_requests_per_peer_per_min`.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections import Counter
from typing import Any

import torch
from dht_scenario import DHTRun, SimPeer
from scenario import Scenario
from simnet import SimNetwork

from shoal.averaging.averager import Averager, AveragerConfig, StepResult
from shoal.averaging.matchmaking import MatchmakingConfig

log = logging.getLogger("sim.moshpit")

# A spread this small (relative to the inputs) is rounding: about 8 float32 epsilons.
AGREEMENT = 1e-6


async def run_moshpit(scenario: Scenario, net: SimNetwork, rng: random.Random) -> dict[str, Any]:
    """`peers` peers join one DHT; then each arm's burst of rounds over them."""
    w = scenario.workload
    run = DHTRun(scenario, net, rng)
    await run.join_all(scenario.peers, float(w.get("join_window_s", 10.0)))
    await asyncio.sleep(float(w.get("settle_s", 0.0)))
    size = int(w.get("size", 1000))
    peers = run.live()
    inputs = [
        torch.randn(size, generator=torch.Generator().manual_seed(rng.getrandbits(32)))
        for _ in peers
    ]
    arms = {}
    for name, dims in (("moshpit", int(w["grid_dims"])), ("one_key", 0)):
        log.warning("arm %s: %d peers, %d rounds", name, len(peers), int(w["rounds"]))
        arms[name] = await _arm(run, net, peers, inputs, _config(w, dims), f"sim/{name}", w)
    result = {"peers": len(peers), "grid_dims": int(w["grid_dims"]), **arms["moshpit"]}
    result["one_key"] = arms["one_key"]
    await run.close()
    result["virtual_s"] = round(asyncio.get_running_loop().time(), 3)
    return result


def _config(w: dict[str, Any], dims: int) -> AveragerConfig:
    side = int(w["grid_side"])
    return AveragerConfig(
        matchmaking=MatchmakingConfig(
            min_group_size=2,
            target_group_size=int(w.get("target_group_size", 2 * side)),
            matchmaking_time=float(w.get("matchmaking_time", 3.0)),
            min_matchmaking_time=float(w.get("min_matchmaking_time", 0.5)),
            give_up_alone_after=w.get("give_up_alone_after_s"),
            grid_dims=dims,
            grid_side=side,
        )
    )


async def _arm(
    run: DHTRun,
    net: SimNetwork,
    peers: list[SimPeer],
    inputs: list[torch.Tensor],
    config: AveragerConfig,
    key: str,
    w: dict[str, Any],
) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    rounds, timeout = int(w["rounds"]), float(w.get("step_timeout_s", 30.0))
    averagers = [
        await run.on(p, _make(p, key, x.clone(), config))
        for p, x in zip(peers, inputs, strict=True)
    ]
    t0, bytes0, requests0 = loop.time(), net.stats.bytes, run.requests_sent()
    per_peer = await asyncio.gather(
        *(run.on(p, _burst(a, rounds, timeout)) for p, a in zip(peers, averagers, strict=True))
    )
    minutes = (loop.time() - t0) / 60
    sent, requests = net.stats.bytes - bytes0, run.requests_sent() - requests0
    for p, a in zip(peers, averagers, strict=True):
        await run.on(p, a.aclose())
    scale = float(torch.stack(inputs).abs().max())
    spreads = [_spread([snaps[k] for snaps, _ in per_peer], scale) for k in range(rounds)]
    exact = torch.stack([x.double() for x in inputs]).mean(0)
    finals = torch.stack([snaps[-1].double() for snaps, _ in per_peer])
    steps = [r for _, results in per_peer for r in results]
    agreed = next((k + 1 for k, s in enumerate(spreads) if s <= AGREEMENT), None)
    return {
        "rounds_to_agreement": agreed,
        "state_spread": [float(f"{s:.3g}") for s in spreads],
        "mean_error": float(f"{float((finals - exact).abs().max()) / scale:.3g}"),
        "lost_work_fraction": round(sum(map(_lost, (r for _, r in per_peer))) / len(peers), 4),
        "commits_fraction": round(sum(r.committed for r in steps) / len(steps), 4),
        "group_sizes": dict(sorted(Counter(r.group_size for r in steps if r.committed).items())),
        "aborts": dict(Counter(r.reason.split(":")[0] for r in steps if not r.committed)),
        "step_s_mean": round(sum(r.seconds for r in steps) / len(steps), 2),
        "matchmaking_s_mean": round(
            sum(a.matchmaking_s for r in steps for a in r.attempt_log) / len(steps), 2
        ),
        "bytes_per_peer_per_round": round(sent / len(peers) / rounds),
        "dht_requests_per_peer_per_min": round(requests / len(peers) / minutes, 1),
        "virtual_s": round(loop.time() - t0, 2),
    }


async def _make(peer: SimPeer, key: str, vector: torch.Tensor, config: AveragerConfig) -> Averager:
    assert peer.node is not None
    return Averager(peer.node, key, [vector], config=config)


async def _burst(
    averager: Averager, rounds: int, timeout: float
) -> tuple[list[torch.Tensor], list[StepResult]]:
    """`rounds` steps in a row on an unchanged vector; the vector after each."""
    (vector,) = averager.tensors
    snapshots, results = [], []
    for _ in range(rounds):
        results.append(await averager.step(timeout=timeout))
        snapshots.append(vector.clone())
    return snapshots, results


def _spread(vectors: list[torch.Tensor], scale: float) -> float:
    stacked = torch.stack([v.double() for v in vectors])
    return float((stacked - stacked.mean(0)).abs().max()) / scale


def _lost(results: list[StepResult]) -> bool:
    """Whether a peer's input was replaced (a re-sync) or never averaged."""
    for r in results:
        if r.committed:
            return False
        if r.resynced:
            return True
    return True
