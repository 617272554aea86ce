"""Where a step's time went: each try of `Averager.step` (its matchmaking, then its
all-reduce, re-sync or lone commit) is in the result, and the round ledger writes
it (`attempts`), so a long gap between commits can be taken apart afterwards."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
import torch

from shoal.averaging.allreduce import AllReduceConfig
from shoal.averaging.averager import Averager, AveragerConfig
from shoal.averaging.matchmaking import MatchmakingConfig
from shoal.dht.node import DHTNode
from shoal.transport.identity import Identity

# (A control message unanswered for `decision_timeout` leaves its member out: at 0.3 s,
# three averagers sharing one loaded loop left a healthy one out in a local CI run.)
FAST = {"heartbeat_interval": 0.05, "stall_timeout": 1.0, "decision_timeout": 1.0}


@pytest.mark.timeout(60)
async def test_a_step_that_aborted_once_logs_both_tries_and_their_times(
    make_host: Callable[..., Any],
) -> None:
    """Three peers; one freezes as the round starts. Each other's step: a group of three that
    aborted, saying why, then a group of two without it that committed; the tries'
    times add up to no more than the step's, and each names the peers it left out."""
    release = asyncio.Event()

    async def freeze(point: str) -> None:
        if point == "start":
            await release.wait()

    hosts = sorted([await make_host(max_connections_per_ip=10_000) for _ in range(3)],
                   key=lambda h: h.peer_id)  # fmt: skip
    dhts: list[DHTNode] = []
    for h in hosts:
        boot = [str(dhts[0].host.addresses()[0])] if dhts else []
        dhts.append(await DHTNode.create(h, bootstrap=boot, hop_timeout=1.0))
    mm = MatchmakingConfig(min_group_size=2, target_group_size=3, matchmaking_time=2.0)
    configs = [AllReduceConfig(**FAST), AllReduceConfig(**FAST),
               AllReduceConfig(fault_hook=freeze, **FAST)]  # fmt: skip
    avgs = [
        Averager(d, "step-log", [torch.full((1000,), float(i + 1))],
                 config=AveragerConfig(matchmaking=mm, allreduce=c, max_retries=3))
        for i, (d, c) in enumerate(zip(dhts, configs, strict=True))
    ]  # fmt: skip
    *healthy, frozen = avgs
    shunned = Identity.generate().peer_id  # (a peer one of them keeps out of its groups)
    healthy[0].shun(shunned, 60.0)
    frozen_step = asyncio.ensure_future(frozen.step(timeout=30.0))
    try:
        results = await asyncio.gather(*(a.step(timeout=30.0) for a in healthy))
        for r in results:
            assert r.committed and r.group_size == 2, r.reason
            first, second = r.attempt_log
            # (Its heartbeats go on: the data watchdog, 1.5 stalls, gives it up.)
            assert first.group_size == 3 and "no data progress" in first.outcome
            assert first.averaging_s >= 1.5 * FAST["stall_timeout"]
            assert second.group_size == 2 and second.outcome == "committed"
            spent = sum(a.matchmaking_s + a.averaging_s for a in r.attempt_log)
            assert 0 < spent <= r.seconds
        # Each try names the peers it left out: the first the shunned one (of the first
        # healthy peer's); the retry those too, and the frozen one when the abort found
        # it quiet (its heartbeats run late on a loaded machine: then it is left out).
        frozen_id = str(frozen.dht.host.peer_id)
        for r, kept_out in zip(results, ({str(shunned)}, set()), strict=True):
            first, second = r.attempt_log
            assert set(first.excluded) == kept_out
            assert kept_out <= set(second.excluded) <= kept_out | {frozen_id}
    finally:
        release.set()
        frozen_step.cancel()  # (thawed, it would look for a group till its timeout)
        await asyncio.gather(frozen_step, return_exceptions=True)
        for a in avgs:
            await a.aclose()
        for d in dhts:
            await d.aclose()
