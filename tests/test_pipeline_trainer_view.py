"""What a pipeline trainer reads of a stage from the DHT: its callable peers and the
stage's version (the version it asks for in requests; a peer behind it refuses).

A stage's version is the newest among the peers the trainer may still call. A peer that
died after its step keeps its record (and the newer version) in the DHT until the TTL;
if that version counted, its survivors, one step behind and waiting for a step that
cannot happen without the dead peer's samples, would refuse every request as "behind".
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from shoal.pipeline.server import StageServer
from shoal.pipeline.stage import StageWorker
from shoal.pipeline.trainer import PipelineTrainer
from shoal.verification.stage_audit import StageAuditPolicy

from .pipeline_swarm import EXPERIMENT, Swarm


async def _announced(swarm: Swarm, version: int, *, ready: bool = True) -> StageServer:
    """A stage-0 peer's record in the DHT, at `version` (nothing is served)."""
    server = StageServer(await swarm.node(), EXPERIMENT, 0, StageWorker(torch.nn.Linear(2, 2)))
    server.set_version(version)
    server.serving = ready
    await server.announce()
    return server


@pytest.mark.timeout(30)
async def test_the_stage_version_is_the_newest_among_peers_not_banned(
    make_host: Callable[..., Any],
) -> None:
    swarm = Swarm(make_host)
    try:
        trainer = PipelineTrainer(await swarm.node(), EXPERIMENT, 1, codec="none")
        behind = await _announced(swarm, 5)
        ahead = await _announced(swarm, 7)
        assert await trainer.refresh() == [2]
        assert trainer.versions[0] == 7

        # The peer at 7 fails a request (it died, say): banned, its version stops counting.
        balancer = trainer.balancers[0]
        balancer.failed(ahead.dht.peer_id, time.monotonic())
        await trainer.refresh()
        assert trainer.versions[0] == 5, "a banned peer's record held the stage ahead"
        assert ahead.dht.peer_id in trainer.stage_peers[0]  # still listed, for when it is back

        # It re-synced (a new `since`): the ban lifts, and its version counts again
        # (from the next refresh: the one that lifts the ban reads the versions first).
        ahead.since = time.time() + 1.0
        await ahead.announce()
        await trainer.refresh()
        assert ahead.dht.peer_id in balancer.peers()
        assert balancer.snapshot()[ahead.dht.peer_id].banned_until == 0.0
        await trainer.refresh()
        assert trainer.versions[0] == 7
        assert behind.dht.peer_id in trainer.stage_peers[0]
    finally:
        await swarm.aclose()


@pytest.mark.timeout(30)
async def test_a_peer_not_ready_is_neither_called_nor_counted(
    make_host: Callable[..., Any],
) -> None:
    swarm = Swarm(make_host)
    try:
        trainer = PipelineTrainer(await swarm.node(), EXPERIMENT, 1, codec="none")
        await _announced(swarm, 3)
        syncing = await _announced(swarm, 9, ready=False)  # arriving or re-syncing
        assert await trainer.refresh() == [1]
        assert syncing.dht.peer_id not in trainer.stage_peers[0]
        assert trainer.versions[0] == 3
    finally:
        await swarm.aclose()


@pytest.mark.timeout(30)
async def test_a_failed_peer_does_not_count_again_when_its_ban_runs_out(
    make_host: Callable[..., Any],
) -> None:
    """A ban of 15 s is shorter than a record's TTL of 60 s: a dead peer's version must
    not come back with the end of its ban, only with an answer or a newer record."""
    swarm = Swarm(make_host)
    try:
        trainer = PipelineTrainer(await swarm.node(), EXPERIMENT, 1, codec="none")
        await _announced(swarm, 2)
        dead = await _announced(swarm, 6)
        await trainer.refresh()
        balancer = trainer.balancers[0]
        balancer.failed(dead.dht.peer_id, time.monotonic() - 3600.0)  # a ban long over
        assert balancer.snapshot()[dead.dht.peer_id].banned_until < time.monotonic()
        await trainer.refresh()
        assert trainer.versions[0] == 2

        balancer.succeeded(dead.dht.peer_id, 1, 0.01)  # it answered after all
        await trainer.refresh()
        assert trainer.versions[0] == 6
    finally:
        await swarm.aclose()


@pytest.mark.timeout(30)
async def test_when_every_peer_is_banned_the_stage_keeps_its_last_known_version(
    make_host: Callable[..., Any],
) -> None:
    swarm = Swarm(make_host)
    try:
        trainer = PipelineTrainer(await swarm.node(), EXPERIMENT, 1, codec="none")
        only = await _announced(swarm, 4)
        await trainer.refresh()
        trainer.balancers[0].failed(only.dht.peer_id, time.monotonic())
        await trainer.refresh()
        assert trainer.versions[0] == 4
    finally:
        await swarm.aclose()


@pytest.mark.timeout(30)
async def test_a_convicted_peer_s_version_counts_for_nothing(
    make_host: Callable[..., Any],
) -> None:
    """A cheater cut off by its bans steps alone and announces a version no honest
    peer of the stage holds. Counted, it would send every request to them with that
    version, and they would refuse each as behind: the stage would stall."""
    swarm = Swarm(make_host)
    try:
        trainer = PipelineTrainer(
            await swarm.node(), EXPERIMENT, 1, codec="none", audit=StageAuditPolicy()
        )
        assert trainer.auditor is not None
        honest = await _announced(swarm, 3)
        cheater = await _announced(swarm, 9)
        await trainer.refresh()
        assert trainer.versions[0] == 9  # (not known yet to cheat)

        trainer.auditor.distrusted.add(cheater.dht.peer_id)
        await trainer.refresh()
        assert trainer.stage_peers[0] == [honest.dht.peer_id]
        assert trainer.versions[0] == 3, "the convicted peer's version held the stage ahead"
    finally:
        await swarm.aclose()
