"""Stage checkpoints: a stage saved bit for bit, refused when not ours, its loss reported.

A stage peer saves its stage (parameters, AdamW state, version, fingerprint,
step sizes) in its data directory; a peer that finds the stage orphaned
restores it. A file of another experiment or another stage layout is refused
in one line; what the swarm saw a stage lose is on /status (`lost`,
`restored`). The end-to-end test with daemons is in
test_pipeline_stage_recovery.py.
"""

from __future__ import annotations

import asyncio
import copy
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from shoal.peer.pipelined.checkpoints import StageCheckpoints
from shoal.peer.training.checkpoint import CheckpointError
from shoal.peer.training.tasks.bytegpt import make_task
from shoal.pipeline.directory import StageRecord
from shoal.pipeline.ledger import Applied, Doubt, MicrobatchLedger
from shoal.pipeline.progress import Report
from shoal.pipeline.server import StageServer, _keys_of
from shoal.pipeline.stage import StageWorker
from shoal.pipeline.stage_checkpoint import step_log
from shoal.pipeline.stage_losses import StageLosses
from shoal.pipeline.stage_optimizer import StepRecord
from shoal.pipeline.stage_peer import StagePeer
from shoal.pipeline.trainer import PipelineTrainer
from shoal.transport.identity import Identity

from .pipeline_swarm import EXPERIMENT, TINY, Swarm, loop_for


def _optimizer_state(peer: StagePeer) -> list[torch.Tensor]:
    state = peer.optimizer.optimizer.state
    return [t for p in peer.optimizer.params for t in state[p].values()]


async def _trained_stage(swarm: Swarm, steps: int) -> tuple[StagePeer, Any]:
    task = make_task(TINY)
    (module,) = task.make_stages(3, 1)
    peer = await swarm.stage_peer(0, module, global_batch=4)
    trainer = await swarm.trainer(1, codec="none")
    await loop_for(trainer, task, shard=0, global_batch=4, lag=0).run(steps=steps)
    await asyncio.wait_for(_frozen_at(peer, steps), 10)
    return peer, module


async def _frozen_at(peer: StagePeer, version: int) -> None:
    while peer.optimizer.averager.last_fingerprint_commits != version:  # noqa: ASYNC110
        await asyncio.sleep(0.01)


async def _fresh_peer(swarm: Swarm, module: torch.nn.Module) -> StagePeer:
    return StagePeer(await swarm.node(), EXPERIMENT, 0, copy.deepcopy(module),
                     hyper={"lr": 3e-3}, global_batch=4)  # fmt: skip


@pytest.mark.timeout(60)
async def test_a_stage_checkpoint_restores_parameters_optimizer_state_and_version_bit_for_bit(
    make_host: Callable[..., Any], tmp_path: Path
) -> None:
    swarm = Swarm(make_host)
    try:
        peer, module = await _trained_stage(swarm, 3)
        saved = StageCheckpoints(tmp_path, EXPERIMENT, 1, interval=60.0)
        assert await saved.save(peer)
        assert not await saved.save(peer)  # (nothing newer to write)
        assert peer.server.checkpointed == 3

        fresh = await _fresh_peer(swarm, module)
        state = await StageCheckpoints(tmp_path, EXPERIMENT, 1, interval=60.0).load()
        assert state is not None and state["stage"] == 0
        await saved.restore(fresh, state)
        assert fresh.version == 3 and fresh.server.restored == 3
        for a, b in zip(peer.optimizer.params, fresh.optimizer.params, strict=True):
            assert torch.equal(a.detach().cpu(), b.detach().cpu())
        for a, b in zip(_optimizer_state(peer), _optimizer_state(fresh), strict=True):
            assert torch.equal(a.cpu(), b.cpu())
        assert float(fresh.optimizer.optimizer.state[fresh.optimizer.params[0]]["step"]) == 3
        assert fresh.optimizer.fingerprint() == peer.optimizer.fingerprint()
        assert fresh.optimizer.averager.last_fingerprint == peer.optimizer.averager.last_fingerprint
        assert fresh.optimizer.averager.state_version == peer.optimizer.averager.state_version
        assert fresh.optimizer.step_samples == peer.optimizer.step_samples
        assert [s.version for s in fresh.optimizer.steps] == [0, 1, 2]
        # With the backwards each step held: what the trainers' ledgers settle by (the
        # keys of the peer's previous life, told again after a restore).
        assert [s.keys for s in fresh.optimizer.steps] == [s.keys for s in peer.optimizer.steps]
        assert all(s.keys for s in fresh.optimizer.steps)
        await fresh.aclose()
    finally:
        await swarm.aclose()


@pytest.mark.timeout(60)
async def test_a_restored_stage_that_cannot_download_a_dead_peers_newer_version_keeps_its_claim(
    make_host: Callable[..., Any], tmp_path: Path
) -> None:
    """The stage's last peer died one step after our checkpoint; its report (at the
    newer version) outlives it. Failing to download that version, the restored
    peer serves on what it holds: its restart stays claimed once, under the same
    `since` (trainers replay a restart once per claim), and the dead report is
    believed no more."""
    swarm = Swarm(make_host)
    try:
        peer, module = await _trained_stage(swarm, 3)
        store = StageCheckpoints(tmp_path, EXPERIMENT, 1, interval=60.0)
        assert await store.save(peer)
        dead = peer.server.dht.peer_id
        await peer.aclose()  # (its records stay in the DHT for a while, as a dead peer's)

        fresh = StagePeer(await swarm.node(), EXPERIMENT, 0, copy.deepcopy(module),
                          hyper={"lr": 3e-3}, global_batch=4, sync_timeout=2.0)  # fmt: skip
        state = await store.load()
        assert state is not None
        await store.restore(fresh, state)
        since = fresh.server.since
        ahead = Report(dead, 0, 4, time.time())
        await fresh.catch_up([ahead])

        assert fresh.version == 3 and fresh.server.serving
        assert fresh.server.restored == 3 and fresh.server.since == since
        assert fresh.server.record()["restored"] == 3
        assert fresh.syncs == 0
        assert fresh._gone[dead] >= ahead.at  # (its next report counts again)
        await fresh.aclose()
    finally:
        await swarm.aclose()


@pytest.mark.timeout(60)
async def test_a_checkpoint_of_another_experiment_or_stage_layout_is_refused_in_one_line(
    make_host: Callable[..., Any], tmp_path: Path
) -> None:
    swarm = Swarm(make_host)
    try:
        peer, _ = await _trained_stage(swarm, 1)
        assert await StageCheckpoints(tmp_path, EXPERIMENT, 1, interval=60.0).save(peer)

        with pytest.raises(CheckpointError) as other:
            await StageCheckpoints(tmp_path, "another-experiment", 1, interval=60.0).load()
        assert "of another experiment" in str(other.value) and "\n" not in str(other.value)
        with pytest.raises(CheckpointError) as layout:
            await StageCheckpoints(tmp_path, EXPERIMENT, 2, interval=60.0).load()
        assert "not of this experiment's 2 stages" in str(layout.value)

        wider = make_task({**TINY, "d_model": 48}).make_stages(3, 1)[0]
        store = StageCheckpoints(tmp_path, EXPERIMENT, 1, interval=60.0)
        state = await store.load()
        assert state is not None
        unlike = await _fresh_peer(swarm, wider)
        before = [p.detach().clone() for p in unlike.optimizer.params]
        with pytest.raises(CheckpointError) as shapes:
            await store.restore(unlike, state)
        assert "cannot be loaded into stage 0: tensor 0 is" in str(shapes.value)
        assert "\n" not in str(shapes.value)
        assert unlike.version == 0  # nothing was written into it
        assert all(torch.equal(a, b) for a, b in zip(before, unlike.optimizer.params, strict=True))

        state["tensors"][0] = state["tensors"][0] + 1  # an edited file
        with pytest.raises(CheckpointError, match="do not match its fingerprint"):
            await store.restore(await _fresh_peer(swarm, _trained_module()), state)
        await unlike.aclose()
    finally:
        await swarm.aclose()


def _trained_module() -> torch.nn.Module:
    return make_task(TINY).make_stages(3, 1)[0]  # type: ignore[no-any-return]


def _record(
    version: int, restored: int | None = None, peer: Any = None, since: float = 0.0
) -> StageRecord:
    peer = peer or Identity.generate().peer_id
    return StageRecord(peer, 1.0, 1.0, 0, version, 0.0, restored=restored, since=since)


def test_a_stage_whose_peers_all_left_is_reported_lost_with_its_version() -> None:
    losses = StageLosses(2)
    first = _record(0, restored=0)  # the experiment's first peer of stage 1: no loss
    losses.observe([[_record(7)], [first]], now=100.0)
    losses.observe([[_record(9)], [_record(5, restored=0, peer=first.peer)]], now=110.0)
    assert losses.status(1) == {"lost": None, "restored": None}

    losses.observe([[_record(9)], []], now=120.0)  # stage 1's peers are all gone
    assert losses.status(1) == {"lost": {"version": 5, "since": 120.0}, "restored": None}
    assert losses.status(0) == {"lost": None, "restored": None}

    # Its first peer, restarted with no checkpoint, starts it from the initial weights:
    # still lost, and said so.
    again = _record(0, restored=0, peer=first.peer, since=125.0)
    losses.observe([[_record(9)], [again]], now=130.0)
    losses.observe([[_record(9)], [_record(6, restored=0, peer=first.peer, since=125.0)]], 140.0)
    assert losses.status(1)["lost"] == {"version": 5, "since": 120.0}


def test_a_stage_restored_from_a_checkpoint_reports_what_it_lost() -> None:
    losses = StageLosses(1)
    losses.observe([[_record(8)]], now=10.0)
    losses.observe([[]], now=20.0)
    losses.observe([[_record(6, restored=6)]], now=30.0)
    assert losses.status(0) == {
        "lost": None,
        "restored": {"version": 6, "lost_version": 8, "at": 30.0},
    }


def test_an_observer_that_last_saw_the_stage_below_the_restored_version_reports_no_loss() -> None:
    """It read the records at version 10; the stage reached 21 and came back at 20 (a
    CI run): it knows of no loss below 20, never of a negative one."""
    losses = StageLosses(1)
    losses.observe([[_record(10)]], now=10.0)
    losses.observe([[_record(20, restored=20)]], now=30.0)
    assert losses.status(0)["restored"] == {"version": 20, "lost_version": 20, "at": 30.0}


def _applied(key: str, epoch: int, peer: Any = "a") -> Applied:
    return Applied(0, key, peer, epoch, torch.zeros(2, 3), torch.zeros(2, 3), 2)


def test_the_ledger_replays_the_counted_microbatches_of_steps_a_restore_lost() -> None:
    ledger = MicrobatchLedger(1)
    for key, epoch in (("m0", 3), ("m1", 4), ("m2", 5), ("m3", 6)):
        ledger.applied(_applied(key, epoch))
    # Steps 3, 4 and 5 committed with "a"; the stage's peers saved version 4.
    ledger.resolve(0, [(v, frozenset({"a"})) for v in (3, 4, 5)], version=6, durable=4)
    assert ledger.counted == [6] and ledger.kept_samples(0) == 4  # (m0: in the checkpoint)
    ledger.release(0, durable=5, version=6)
    assert ledger.kept_samples(0) == 2  # m1's step is saved now

    # Every peer died; one restored the stage at 5: m2's step and m3 (held) are gone.
    replay = ledger.lost(0, restored=5)
    assert sorted(e.key for e in replay) == ["m2", "m3"]
    assert ledger.counted == [4] and ledger.restored == [4] and ledger.kept_samples(0) == 0
    assert ledger.open_samples(0) == 0


def test_a_restore_replays_nothing_the_restoring_incarnation_applied_since() -> None:
    """Peer "a" died at version 9 and came back from its checkpoint at 5 (since=20.0).
    The trainer learns of the restore seconds later, and meanwhile sent "a" backwards
    it applied at 5 and 6: they live on in its steps, counted once. What "a" applied
    at 7 before it died (since=10.0), and "b" at 6, are gone with the stage."""
    ledger = MicrobatchLedger(1)
    old_a = Applied(0, "old_a", "a", 7, torch.zeros(2, 3), torch.zeros(2, 3), 2, since=10.0)
    new_a = Applied(0, "new_a", "a", 6, torch.zeros(2, 3), torch.zeros(2, 3), 2, since=20.0)
    counted_a = Applied(0, "counted_a", "a", 5, torch.zeros(2, 3), torch.zeros(2, 3), 2, 20.0)
    for entry in (old_a, new_a, counted_a, _applied("b", 6, peer="b")):
        ledger.applied(entry)
    # Its new step from 5 (the one before "a" died is forgotten by the restore) held
    # counted_a: counted, and kept (nothing saved it yet).
    ledger.resolve(0, [(5, frozenset({"a"}), frozenset({"counted_a"}))], 5, 0, source="a")
    assert ledger.counted == [2]
    replay = ledger.lost(0, restored=5, survivor=("a", 20.0))
    assert sorted(e.key for e in replay) == ["b", "old_a"]
    assert ledger.counted == [2] and ledger.restored == [4]
    assert [e.key for e in ledger.open(0)] == ["new_a"]  # (its step from 6 will say)


def test_a_restore_leaves_a_doubt_at_the_restoring_peer_to_its_fence() -> None:
    """A backward to "a" whose answer was lost, sent while the trainer still believed
    the stage at 9: the old "a" or the restored one may hold it. The live one's fence
    answer settles it; replayed now, it could count twice. One at "b" is gone."""
    ledger = MicrobatchLedger(1)
    for peer in ("a", "b"):
        ledger.doubted(Doubt(0, f"at_{peer}", peer, 9, b"x", torch.zeros(2, 3),
                             torch.zeros(2, 3), 2))  # fmt: skip
    replay = ledger.lost(0, restored=5, survivor=("a", 20.0))
    assert [e.key for e in replay] == ["at_b"]
    assert [d.key for d in ledger.doubts(0)] == ["at_a"]


def test_a_step_read_from_a_checkpoint_that_kept_no_keys_tells_trainers_nothing_of_keys() -> None:
    """A checkpoint written before steps kept their keys: its steps say nothing of what
    they held (None), which a trainer takes as "not told" (membership decides), never
    as "held none of yours" (which would replay, and count twice, what they held)."""
    trainer = Identity.generate().peer_id
    old = {"steps": [[3, [trainer.to_bytes().hex()], 4]]}
    (record,) = step_log(old, version=4)
    assert record.keys is None and _keys_of(record, trainer) is None
    kept = {"steps": [[3, [trainer.to_bytes().hex()], 4, [[trainer.to_bytes().hex(), "k"]]]]}
    (record,) = step_log(kept, version=4)
    assert _keys_of(record, trainer) == ["k"]
    for bad in ("k", [["zz", "k"]], [[trainer.to_bytes().hex(), 1]], [["a"]]):
        assert step_log({"steps": [[3, [], 4, bad]]}, version=4) in (
            [],
            [StepRecord(3, (), 4, None)],
        )


def test_without_checkpoints_the_ledger_keeps_nothing_it_counted() -> None:
    ledger = MicrobatchLedger(1)
    ledger.applied(_applied("m0", 0))
    ledger.resolve(0, [(0, frozenset({"a"}))], version=1)
    assert ledger.kept_samples(0) == 0 and ledger.counted == [2]


async def _record_of(
    swarm: Swarm, version: int, *, since: float, ckpt: int, restored: int | None = None
) -> StageServer:
    """A stage-0 peer's record in the DHT (nothing is served)."""
    server = StageServer(await swarm.node(), EXPERIMENT, 0, StageWorker(torch.nn.Linear(2, 2)))
    server.set_version(version)
    server.since, server.checkpointed, server.restored = since, ckpt, restored
    await server.announce()
    return server


@pytest.mark.timeout(30)
async def test_a_trainer_replays_what_a_restart_lost_once_and_believes_no_restart_early(
    make_host: Callable[..., Any],
) -> None:
    swarm = Swarm(make_host)
    try:
        trainer = PipelineTrainer(await swarm.node(), EXPERIMENT, 1, codec="none")
        dead = await _record_of(swarm, 5, since=100.0, ckpt=3)  # killed: its record stays
        gone = dead.dht.peer_id
        await trainer.refresh()
        assert trainer.durable == [3]
        for key, epoch in (("m3", 3), ("m4", 4)):  # counted in steps 3 and 4, kept
            trainer.ledger.applied(_applied(key, epoch, gone))
        trainer.ledger.resolve(0, [(3, frozenset({gone})), (4, frozenset({gone}))], 5, 3)
        assert trainer.ledger.kept_samples(0) == 4

        # A liar: a restart above its own version is no claim at all.
        await _record_of(swarm, 2, since=200.0, ckpt=0, restored=9)
        back = await _record_of(swarm, 4, since=300.0, ckpt=4, restored=4)
        await trainer.refresh()
        assert trainer.ledger.restored == [0]  # the dead peer is ahead and still callable
        assert trainer.versions[0] == 5

        trainer.balancers[0].failed(gone, time.monotonic())  # its requests fail
        await trainer.refresh()
        assert trainer.ledger.restored == [2]  # step 4 was lost: m4 goes again
        # m3 is in the restored checkpoint, and in the dead peer's (at 3) only should
        # the dead one come back: kept until its record is gone or says more.
        assert trainer.versions[0] == 4 and trainer.durable == [3]
        assert trainer.ledger.kept_samples(0) == 2
        await trainer.refresh()
        assert trainer.ledger.restored == [2]  # once
        back.since = 400.0  # it re-synced later: no restart any more
        back.restored = None
        await back.announce()
        await trainer.refresh()
        assert trainer.ledger.restored == [2]

        # That lineage dies too, and the peer first killed comes back from its own
        # checkpoint at 3: step 3 is lost now, m3 goes again.
        trainer.balancers[0].failed(back.dht.peer_id, time.monotonic())
        dead.since, dead.checkpointed, dead.restored = 500.0, 3, 3
        dead.set_version(3)
        await dead.announce()
        trainer.balancers[0].reannounced(gone)
        await trainer.refresh()
        assert trainer.ledger.restored == [4] and trainer.versions[0] == 3
        await trainer._replays.aclose()
    finally:
        await swarm.aclose()
