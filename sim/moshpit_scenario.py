"""The Moshpit workload: how fast a swarm larger than one group agrees on one state.

Every peer starts from its own random vector and steps an `Averager` `rounds` times in
a row without changing it (a burst of rounds): the spread of the peers' vectors after
each round says how far the swarm is from holding one state. Two arms over the same
peers and links, one after the other: the Moshpit grid (`grid_dims`, `grid_side`),
then one matchmaking key for everyone with the same target group size (today's
default; twice the side unless the scenario says otherwise). `arms` in the workload
picks which run (one key for hundreds of peers is slow to simulate: every leader's
wake reads the whole key's declarations). With the scenario's `churn`, peers crash
during each burst after exponential sessions of its mean (not replaced: a newcomer
loads the state, it brings no input); `crashed` says how many. Before the grid's
burst the peers announce their states, as a running swarm's peers have (`announced`,
default true): a swarm of more than a group then starts in its cells.

Figures per arm: `state_spread` (after each round k, the largest difference of any
live peer's vector to the live peers' mean, over the inputs' largest magnitude),
`rounds_to_agreement` (the first round whose spread is at most `AGREEMENT`, about 8
float32 epsilons: what rounding in a different order leaves), `mean_error` (the
final vectors against the exact mean of all inputs: work lost), `lost_work_fraction`
(inputs overwritten by a re-sync, or never committed, before any round averaged
them), `bytes_per_peer_per_round` and `dht_requests_per_peer_per_min`.

`grid_period_s` sets the grid's `MatchmakingConfig.grid_period` (rounds that start
together); `start_spread_s` delays each peer's first step by up to that much, as
peers of a training swarm reach their rounds at different times.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import logging
import random
import re
import resource
from collections import Counter
from typing import Any

import torch
from dht_scenario import DHTRun, SimPeer
from scenario import Scenario
from simnet import SimNetwork

from shoal.averaging import declarer, moshpit
from shoal.averaging.allreduce import AllReduceConfig
from shoal.averaging.averager import Averager, AveragerConfig, StepResult
from shoal.averaging.matchmaking import MatchmakingConfig
from shoal.averaging.outer import allreduce_config, resolve_options

log = logging.getLogger("sim.moshpit")

# A spread this small (relative to the inputs) is rounding: about 8 float32 epsilons.
AGREEMENT = 1e-6
ARMS = ("moshpit", "one_key")
# Churn never crashes the last peers of a burst: a spread needs two.
MIN_SURVIVORS = 2


async def run_moshpit(scenario: Scenario, net: SimNetwork, rng: random.Random) -> dict[str, Any]:
    """`peers` peers join one DHT; then each arm's burst of rounds over them."""
    w = scenario.workload
    if "poll_replicas" in w:  # (null: every poll reads every replica, as before sampling)
        declarer.POLL_REPLICAS = w["poll_replicas"]
    if "stale_weight" in w:  # (null: a peer whose last round failed weighs its mass too)
        moshpit.STALE_WEIGHT = w["stale_weight"]
    run = DHTRun(scenario, net, rng)
    await run.join_all(scenario.peers, float(w.get("join_window_s", 10.0)))
    await asyncio.sleep(float(w.get("settle_s", 0.0)))
    size = int(w.get("size", 1000))
    peers = run.live()
    inputs = {
        p.index: torch.randn(size, generator=torch.Generator().manual_seed(rng.getrandbits(32)))
        for p in peers
    }
    arms = {}
    # `arms` (default both): which to run; one key for 256 peers and more is slow to
    # simulate (every leader's wake scans the whole key's declarations).
    for name in w.get("arms", ARMS):
        dims = {"moshpit": int(w["grid_dims"]), "one_key": 0}[name]
        live = [p for p in peers if p.live]  # (an arm with churn crashes some)
        log.warning("arm %s: %d peers, %d rounds", name, len(live), int(w["rounds"]))
        config, key = _config(w, dims), f"sim/{name}"
        arms[name] = await _arm(run, net, live, [inputs[p.index] for p in live], config, key, w)
    result = {"peers": len(peers), "grid_dims": int(w["grid_dims"]), **arms.get("moshpit", {})}
    if "one_key" in arms:
        result["one_key"] = arms["one_key"]
    await run.close()
    result["virtual_s"] = round(asyncio.get_running_loop().time(), 3)
    return result


def _config(w: dict[str, Any], dims: int) -> AveragerConfig:
    side = int(w["grid_side"])
    # `stall_timeout_s`: the round's waits as the daemon's strategies set them from
    # their `stall_timeout` option (`outer.allreduce_config`: 5 s by default); without
    # it, `AllReduceConfig`'s own (a 10 s stall), as every figure before it measured.
    stall = w.get("stall_timeout_s")
    allreduce = AllReduceConfig()
    if stall is not None:
        options = resolve_options("moshpit", {"stall_timeout": float(stall)})
        allreduce = allreduce_config(options)
    return AveragerConfig(
        allreduce=allreduce,
        matchmaking=MatchmakingConfig(
            min_group_size=2,
            target_group_size=int(w.get("target_group_size", 2 * side)),
            matchmaking_time=float(w.get("matchmaking_time", 3.0)),
            min_matchmaking_time=float(w.get("min_matchmaking_time", 0.5)),
            give_up_alone_after=w.get("give_up_alone_after_s"),
            grid_dims=dims,
            grid_side=side,
            grid_period=float(w.get("grid_period_s", 0.0)) if dims else 0.0,
        ),
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
    names = {p.index: p.host.peer_id.short() for p in peers if p.host is not None}
    rounds, timeout = int(w["rounds"]), float(w.get("step_timeout_s", 30.0))
    averagers = [
        await run.on(p, _make(p, key, x.clone(), config))
        for p, x in zip(peers, inputs, strict=True)
    ]
    if config.matchmaking.grid is not None and w.get("announced", True):
        # A swarm that runs already: its peers announced their states (each commit
        # does), so each peer's first step finds the crowd and starts in its cell.
        pairs = zip(peers, averagers, strict=True)
        await asyncio.gather(*(run.on(p, a.publish_state()) for p, a in pairs))
    t0, bytes0, requests0 = loop.time(), net.stats.bytes, run.requests_sent()
    counters0 = run.counters()
    queued0, net.stats.max_uplink_queue_s = net.stats.writes_queued_over_1s, 0.0
    outs: list[Out] = [([], [], []) for _ in peers]
    # Each peer's first step after a delay drawn up to `start_spread_s`: peers of a
    # training swarm reach their rounds at different times (their speeds differ).
    spread = float(w.get("start_spread_s", 0.0))
    bursts = {
        p.index: run.on(p, _burst(a, rounds, timeout, out, run.rng.uniform(0, spread)))
        for p, a, out in zip(peers, averagers, outs, strict=True)
    }
    watch = asyncio.ensure_future(_report_progress(run, outs, rounds))
    try:
        crashed = await _churn(run, peers, bursts) if run.scenario.churn is not None else set()
    finally:
        watch.cancel()
    ends = await asyncio.gather(*bursts.values(), return_exceptions=True)
    for index, ended in zip(bursts, ends, strict=True):
        if isinstance(ended, BaseException) and index not in crashed:
            raise ended
    burst_s = loop.time() - t0
    minutes = burst_s / 60
    if w.get("trace_matchmaking"):
        _write_trace(w["trace_matchmaking"], key, names, peers, outs, crashed)
    connections = run.connections()  # (before the averagers close theirs)
    sent, requests = net.stats.bytes - bytes0, run.requests_sent() - requests0
    # All at once, as the peers of a swarm stop: one after the other, each close's
    # grace added a virtual second (1,000 peers: most of a run's virtual time).
    pairs = list(zip(peers, averagers, strict=True))
    # (A crashed peer's host is gone: whatever its close says is moot.)
    await asyncio.gather(
        *(run.on(p, a.aclose()) for p, a in pairs if p.index in crashed), return_exceptions=True
    )
    await asyncio.gather(*(run.on(p, a.aclose()) for p, a in pairs if p.index not in crashed))
    # The spread over the peers live at the end; the error against every input's mean
    # (a peer that crashed took nothing with it once a round had averaged its input).
    survivors = [out[:2] for p, out in zip(peers, outs, strict=True) if p.index not in crashed]
    scale = float(torch.stack(inputs).abs().max())
    spreads = [_spread([snaps[k] for snaps, _ in survivors], scale) for k in range(rounds)]
    # The spread is the farthest peer's: one whose rounds all failed holds it up alone.
    # Where the others stand, and how many rounds each survivor committed, say why.
    spreads_p99 = [_spread_quantile([snaps[k] for snaps, _ in survivors], scale, 0.99)
                   for k in range(rounds)]  # fmt: skip
    # The same over the survivors whose first k steps all committed: what the grid left
    # apart from the peers whose own step failed (they hold a vector a round stale).
    steady = [[snaps[k] for snaps, results in survivors
               if len(results) > k and all(r.committed for r in results[: k + 1])]
              for k in range(rounds)]  # fmt: skip
    spreads_steady = [_spread(v, scale) if len(v) > 1 else 0.0 for v in steady]
    per_survivor = Counter(sum(r.committed for r in results) for _, results in survivors)
    exact = torch.stack([x.double() for x in inputs]).mean(0)
    finals = torch.stack([snaps[-1].double() for snaps, _ in survivors])
    steps = [r for _, results, _ in outs for r in results]
    agreed = next((k + 1 for k, s in enumerate(spreads) if s <= AGREEMENT), None)
    return {
        "crashed": len(crashed),
        "rounds_to_agreement": agreed,
        "state_spread": [float(f"{s:.3g}") for s in spreads],
        "state_spread_p99": [float(f"{s:.3g}") for s in spreads_p99],
        "state_spread_all_committed": [float(f"{s:.3g}") for s in spreads_steady],
        "survivors_all_committed": [len(v) for v in steady],
        "survivors_by_commits": dict(sorted(per_survivor.items())),
        "burst_s": round(burst_s, 2),
        "mean_error": float(f"{float((finals - exact).abs().max()) / scale:.3g}"),
        "lost_work_fraction": round(sum(_lost(r) for _, r, _ in outs) / len(peers), 4),
        "commits_fraction": round(sum(r.committed for r in steps) / len(steps), 4),
        # Committed steps of a peer whose last step had failed after an earlier commit:
        # with `stale_weight` it weighed next to nothing in them (in training, its work
        # since its last commit is lost; here the vector it dropped was a round stale).
        "stale_steps_fraction": round(sum(_stale_steps(r) for _, r, _ in outs) / len(steps), 4),
        "group_sizes": dict(sorted(Counter(r.group_size for r in steps if r.committed).items())),
        "aborts": dict(Counter(_abort_kind(r.reason) for r in steps if not r.committed)),
        # The members the aborts named: peers the churn crashed, or live ones (which
        # an abort should not have needed: a cause in the protocol or the network).
        "aborts_blamed": _blamed(steps, {names[p.index] for p in peers if p.index in crashed}),
        "step_s_mean": round(sum(r.seconds for r in steps) / len(steps), 2),
        "matchmaking_s_mean": round(
            sum(a.matchmaking_s for r in steps for a in r.attempt_log) / len(steps), 2
        ),
        "bytes_per_peer_per_round": round(sent / len(peers) / rounds),
        "dht_requests_per_peer_per_min": round(requests / len(peers) / minutes, 1),
        "virtual_s": round(loop.time() - t0, 2),
        # The DHT's counters over the burst, summed over the peers (busy and failed
        # answers say whether the DHT kept up).
        "dht_counters": {k: v - counters0.get(k, 0) for k, v in run.counters().items()},
        # Congested uplinks: writes that waited over 1 s behind earlier ones, the longest.
        "writes_queued_over_1s": net.stats.writes_queued_over_1s - queued0,
        "max_uplink_queue_s": round(net.stats.max_uplink_queue_s, 2),
        "connections": connections,
        **_cells(outs),
    }


def _write_trace(
    path: str,
    arm: str,
    names: dict[int, str],
    peers: list[SimPeer],
    outs: list[Out],
    crashed: set[int],
) -> None:
    """One JSON line for the arm (`sim/run.py --trace-matchmaking`): every peer's steps,
    where each ran (slot, cell), its group, and each try's matchmaking (the joins sent
    and their answers), group and left-outs (`Attempt`). `sim/trace_report.py` reads it."""
    traced = []
    for p, (_, results, places) in zip(peers, outs, strict=True):
        steps = [
            {
                "slot": slot,
                "cell": cell,
                "committed": r.committed,
                "reason": r.reason[:200],
                "round_id": r.round_id.hex() if r.round_id else None,
                "members": [m.short() for m in r.members],
                "attempts": [dataclasses.asdict(a) for a in r.attempt_log],
            }
            for r, (slot, cell) in zip(results, places, strict=True)
        ]
        traced.append({"peer": names.get(p.index), "crashed": p.index in crashed, "steps": steps})
    with open(path, "a") as f:
        f.write(json.dumps({"arm": arm, "peers": traced}) + "\n")


def _cells(outs: list[Out]) -> dict[str, Any]:
    """Where the k-th steps ran, for each k: `cells_split`, the cells in which a slot
    saw more than one group commit (a cell should form one); `steps_late`, committed
    steps that ran in a later slot than most peers' k-th step (a round that ran long,
    or a retry, pushed the peer a slot behind: it meets the next round's peers)."""
    rounds = max((len(places) for _, _, places in outs), default=0)
    split, late = [], []
    for k in range(rounds):
        groups: dict[tuple[int | None, str | None], set[bytes]] = {}
        slots: Counter[int] = Counter()
        for _, results, places in outs:
            if len(results) > k and results[k].committed and results[k].round_id:
                slot, cell = places[k]
                groups.setdefault((slot, cell), set()).add(results[k].round_id)
                if slot is not None:
                    slots[slot] += 1
        split.append(sum(len(ids) > 1 for (_, cell), ids in groups.items() if cell is not None))
        usual = slots.most_common(1)[0][0] if slots else None
        late.append(sum(n for slot, n in slots.items() if usual is not None and slot > usual))
    return {"cells_split": split, "steps_late": late}


async def _make(peer: SimPeer, key: str, vector: torch.Tensor, config: AveragerConfig) -> Averager:
    assert peer.node is not None
    return Averager(peer.node, key, [vector], config=config)


# Per peer: its vector after each step, each step's result, and where each step ran
# (its grid slot, or None without a grid_period, and its cell, or None: the whole key).
Out = tuple[list[torch.Tensor], list[StepResult], list[tuple[int | None, str | None]]]


async def _report_progress(
    run: DHTRun, outs: list[Out], rounds: int, every_s: float = 20.0
) -> None:
    """Every `every_s` of virtual time: the steps done, of all, the open connections
    per peer and this process's peak memory (long runs: where a stopped run got to)."""
    loop, started = asyncio.get_running_loop(), asyncio.get_running_loop().time()
    while True:
        await asyncio.sleep(every_s)
        done = sum(len(results) for _, results, _ in outs)
        committed = sum(r.committed for _, results, _ in outs for r in results)
        peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        conns = run.connections()
        log.warning(
            "burst: virtual %.0f s, %d of %d steps done (%d committed), %.0f connections"
            " per peer (%d trimmed), peak %.1f GB",
            loop.time() - started, done, len(outs) * rounds, committed,
            conns["open_per_peer_mean"], conns["trimmed"], peak_gb,
        )  # fmt: skip


async def _burst(
    averager: Averager, rounds: int, timeout: float, out: Out, delay: float = 0.0
) -> None:
    """`rounds` steps in a row on an unchanged vector, the first after `delay`; the
    vector after each, and each step's result, into `out` (what a peer that crashes
    midway did stays there)."""
    await asyncio.sleep(delay)
    (vector,) = averager.tensors
    snapshots, results, places = out
    grid = averager.grid
    for _ in range(rounds):
        cell = grid.next_cell() if grid is not None else None
        results.append(await averager.step(timeout=timeout))
        snapshots.append(vector.clone())
        places.append((averager._runner._last_slot, cell))


async def _churn(
    run: DHTRun, peers: list[SimPeer], bursts: dict[int, asyncio.Task[None]]
) -> set[int]:
    """While the bursts run: peers crash after exponential sessions of the scenario's
    mean (a Poisson process of rate live / mean), as a pulled cable does (their burst
    stops; the others learn it from their timeouts). Not replaced: a newcomer would
    load the state, not bring an input. The last `MIN_SURVIVORS` peers never crash.
    The crashed peers' indices."""
    assert run.scenario.churn is not None
    rate_per_peer = 1.0 / (run.scenario.churn.mean_session_min * 60)
    crashed: set[int] = set()
    while not all(t.done() for t in bursts.values()):
        live = [p for p in peers if p.index not in crashed and not bursts[p.index].done()]
        wait = run.rng.expovariate(rate_per_peer * max(1, len(live)))
        done, _ = await asyncio.wait(bursts.values(), timeout=wait,
                                     return_when=asyncio.ALL_COMPLETED)  # fmt: skip
        live = [p for p in peers if p.index not in crashed and not bursts[p.index].done()]
        if len(done) == len(bursts) or len(live) <= MIN_SURVIVORS:
            break
        victim = run.rng.choice(live)
        crashed.add(victim.index)
        bursts[victim.index].cancel()
        run._crash(victim)
    return crashed


def _spread(vectors: list[torch.Tensor], scale: float) -> float:
    stacked = torch.stack([v.double() for v in vectors])
    return float((stacked - stacked.mean(0)).abs().max()) / scale


def _spread_quantile(vectors: list[torch.Tensor], scale: float, q: float) -> float:
    """The `q` quantile, over the peers, of each one's distance to the mean (as `_spread`)."""
    stacked = torch.stack([v.double() for v in vectors])
    per_peer = (stacked - stacked.mean(0)).abs().amax(1)
    return float(torch.quantile(per_peer, q)) / scale


_MEMBER = re.compile(r"…[1-9A-HJ-NP-Za-km-z]{8}")
_ADDRESS = re.compile(r"@[0-9a-f.:\[\]]+")
_PEER_ID = re.compile(r"(/p2p/)?12D3KooW[1-9A-HJ-NP-Za-km-z]+")
_MULTIADDR = re.compile(r"/ip[46]/[^ ;]*")


def _abort_kind(reason: str) -> str:
    """An abort's reason without the names and addresses in it (so they add up), cut
    short: "member … failed: stream reset by …" and its cause stay apart."""
    plain = _MEMBER.sub("…", _PEER_ID.sub("ID", reason))
    return _MULTIADDR.sub("ADDR", _ADDRESS.sub("", plain))[:160]


def _blamed(steps: list[StepResult], crashed: set[str]) -> dict[str, int]:
    """Aborts that named a member, and the distinct members named: crashed or live."""
    named = [m.group(0) for r in steps if not r.committed
             for m in [_MEMBER.search(r.reason)] if m]  # fmt: skip
    distinct = set(named)
    return {
        "aborts_naming_crashed": sum(n in crashed for n in named),
        "aborts_naming_live": sum(n not in crashed for n in named),
        "crashed_named": len(distinct & crashed),
        "live_named": len(distinct - crashed),
    }


def _stale_steps(results: list[StepResult]) -> int:
    """How many of a peer's committed steps it took stale (`moshpit.Grid.stale`)."""
    return sum(
        now.committed and not last.committed and any(r.committed for r in results[:k])
        for k, (last, now) in enumerate(itertools.pairwise(results))
    )


def _lost(results: list[StepResult]) -> bool:
    """Whether a peer's input was replaced (a re-sync) or never averaged."""
    for r in results:
        if r.committed:
            return False
        if r.resynced:
            return True
    return True
