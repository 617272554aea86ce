"""When a trainer believes a stage peer's claim that it restarted the stage (from its
checkpoint, or from the initial weights) and replays what the stage's steps lost.

The stage's records are built here as its peers publish them; the trainer reads them
as it does at each refresh (`PipelineTrainer._read_stage`)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import torch

from shoal.dht.node import DHTNode, DHTValue
from shoal.dht.records import owner_marker
from shoal.pipeline.ledger import Applied
from shoal.pipeline.trainer import PipelineTrainer
from shoal.transport.identity import Identity, PeerID

pytestmark = pytest.mark.timeout(30)

HOST, NEWCOMER = (Identity.generate().peer_id for _ in range(2))


@pytest.fixture
async def trainer(make_host: Callable[..., Any]) -> AsyncIterator[PipelineTrainer]:
    """A trainer of a one-stage pipeline (its DHT node alone: it calls nobody here)."""
    dht = await DHTNode.create(await make_host(), bootstrap=[])
    yield PipelineTrainer(dht, "exp", 1)
    await dht.aclose()


def stage_records(*records: tuple[PeerID, dict[str, Any]]) -> DHTValue:
    expiration = time.time() + 60
    subkeys = {owner_marker(peer): (record, expiration) for peer, record in records}
    return DHTValue({k: v for k, (v, _) in subkeys.items()}, expiration, subkeys)


def applied_at_the_host(trainer: PipelineTrainer, *keys: str) -> None:
    for key in keys:
        zeros = torch.zeros(1)
        trainer.ledger.applied(Applied(0, key, HOST, 0, zeros, zeros, 4, since=100.0))


async def test_a_peer_joining_a_stage_still_at_version_0_beside_a_live_peer_replays_nothing(
    trainer: PipelineTrainer,
) -> None:
    """The stage's first step is not taken yet: its host holds the gradients of two
    microbatches for it. A newcomer starts the stage from the initial weights (at
    version 0 nobody serves a state to download) and its record says so. Nothing is
    lost: the host is alive and keeps them. (Replayed, they counted twice in the
    step, as a pipeline test whose peers joined at once showed.)"""
    applied_at_the_host(trainer, "a", "b")
    host = {"version": 0, "since": 100.0}
    newcomer = {"version": 0, "since": 110.0, "restored": 0}
    trainer._read_stage(0, stage_records((HOST, host), (NEWCOMER, newcomer)), set())
    assert trainer.ledger.restored == [0]
    assert sorted(e.key for e in trainer.ledger.open(0)) == ["a", "b"]


async def test_that_claim_stays_set_aside_when_the_live_peer_leaves_the_stage_later(
    trainer: PipelineTrainer,
) -> None:
    """The host moves to another stage (or dies) a minute later: the newcomer's claim
    is not believed then either. The stage lived on with it and the other peers;
    believed then, every microbatch applied since the experiment began was replayed
    (a pipeline test saw 94). What a peer that dies held for a step, the step's log
    says (`MicrobatchLedger.resolve`)."""
    applied_at_the_host(trainer, "a", "b")
    host = {"version": 0, "since": 100.0}
    newcomer = {"version": 0, "since": 110.0, "restored": 0}
    trainer._read_stage(0, stage_records((HOST, host), (NEWCOMER, newcomer)), set())
    newcomer["version"] = 9
    trainer._read_stage(0, stage_records((NEWCOMER, newcomer)), set())
    trainer.balancers[0].failed(HOST, time.monotonic())
    trainer._read_stage(0, stage_records((HOST, host), (NEWCOMER, newcomer)), set())
    assert trainer.ledger.restored == [0]


async def test_a_start_from_the_initial_weights_with_no_live_peer_replays_what_was_held(
    trainer: PipelineTrainer,
) -> None:
    """The host's last request failed (it is dead; its record outlives it) when the
    newcomer's record first shows: the newcomer's start from the initial weights is
    all the stage has, and the two microbatches the host held for its first step are
    replayed."""
    applied_at_the_host(trainer, "a", "b")
    host = {"version": 0, "since": 100.0}
    newcomer = {"version": 0, "since": 110.0, "restored": 0}
    trainer._read_stage(0, stage_records((HOST, host)), set())
    trainer.balancers[0].failed(HOST, time.monotonic())
    trainer._read_stage(0, stage_records((HOST, host), (NEWCOMER, newcomer)), set())
    assert trainer.ledger.restored == [8]
    assert trainer.ledger.open(0) == []


async def test_a_restart_below_a_live_peers_version_is_a_failed_download(
    trainer: PipelineTrainer,
) -> None:
    """A peer that restarted from its checkpoint at version 3 while a live peer that
    started before it serves version 5: its download failed though the stage lived.
    It catches up; nothing is replayed."""
    applied_at_the_host(trainer, "a")
    host = {"version": 5, "since": 100.0}
    newcomer = {"version": 3, "since": 110.0, "restored": 3}
    trainer._read_stage(0, stage_records((HOST, host), (NEWCOMER, newcomer)), set())
    assert trainer.ledger.restored == [0]
