"""The two narrow cases of exactly-once accounting, reproduced deterministically in-process:
an answer lost after the peer applied the backward, while that peer steps on and the
trainer cannot ask it (`ledger.Doubt`); and a step whose round the peer was in doubt
about (it may have committed with its gradients), with backwards held for the next
epoch and more arriving after it gave its gradients back (`StageWorker.give_back`).
Either way, at the end: the stage's step sizes + the samples its peers hold == the
samples the trainer completed."""

from __future__ import annotations

import asyncio
import copy
import time
from collections.abc import Callable
from typing import Any

import pytest

from shoal.averaging.averager import StepResult
from shoal.dht.node import DHTNode
from shoal.peer.training.tasks.bytegpt import make_task
from shoal.pipeline.ledger import Applied, MicrobatchLedger
from shoal.pipeline.stage import StageWorker
from shoal.pipeline.stage_calls import StageFailed
from shoal.pipeline.stage_optimizer import StageOptimizer
from shoal.pipeline.stage_peer import StagePeer
from shoal.transport.identity import Identity

from .pipeline_swarm import TINY, Swarm
from .test_pipeline_accounting import stage_and_requests
from .waiting import eventually


def _held(peer: StagePeer) -> int:
    return sum(peer.worker.samples_for(e) for e in range(peer.version + 2))


@pytest.mark.timeout(60)
async def test_an_answer_lost_at_a_peer_that_cannot_be_asked_and_steps_on_counts_once(
    make_host: Callable[..., Any],
) -> None:
    """Two peers serve a stage (global batch: two microbatches). The first backward is
    applied, then its answer never comes, and the peer refuses every fence: the trainer
    cannot learn whether it counted. It goes on with a dry backward at the other peer
    (the input gradient, nothing counted); the next microbatch completes the batch,
    both peers step, and the first peer's step log (its keys) tells the trainer that
    its microbatch counted there. Nothing replayed, nothing counted twice."""
    task = make_task(TINY)
    (module,) = task.make_stages(3, 1)
    swarm = Swarm(make_host)
    lost: list[StagePeer] = []
    release = asyncio.Event()
    try:
        peers = [await swarm.stage_peer(0, module, global_batch=8) for _ in range(2)]
        for peer in peers:
            apply, fence = peer.server.compute_backward, peer.server.fence

            async def applied_then_lost(*args: Any, p: Any = peer, f: Any = apply, **kw: Any):
                answer = await f(*args, **kw)
                if not lost and not kw.get("dry"):
                    lost.append(p)
                    await release.wait()  # (the trainer's deadline passes: the answer is lost)
                return answer

            async def unreachable(*args: Any, p: Any = peer, f: Any = fence, **kw: Any):
                if p in lost:
                    raise ConnectionResetError("cannot be asked")
                return await f(*args, **kw)

            peer.server.compute_backward = applied_then_lost  # type: ignore[method-assign]
            peer.server.fence = unreachable  # type: ignore[method-assign]
        trainer = await swarm.trainer(1, codec="none", deadline=1.0)
        assert await trainer.refresh() == [2]
        batches = task.batches(0, 1, 0)
        for mb in range(2):
            batch = next(batches)
            await trainer.run(
                mb, task.stage_inputs(batch), lambda y, b=batch: task.stage_loss(y, b)
            )
        assert trainer.counters.unfenced == 1 and trainer.counters.samples == 8
        assert len(lost) == 1  # (one peer applied the first microbatch; its answer is lost)
        await eventually(
            lambda: all(0 in p.optimizer.step_samples for p in peers), "the step, logged", 30
        )
        await eventually(trainer.doubts_settled, "the doubt settled by the step log", 15)
        await trainer.settled()
        steps = {v: n for p in peers for v, n in p.optimizer.step_samples.items()}
        held = sum(_held(p) for p in peers)
        assert sum(steps.values()) + held == trainer.counters.samples
        assert steps == {0: 8} and held == 0
        ledger = trainer.ledger
        assert ledger.counted[0] == 8 and ledger.replayed[0] == 0 and ledger.assumed[0] == 0
    finally:
        release.set()
        await swarm.aclose()


@pytest.mark.timeout(30)
async def test_backwards_after_a_round_in_doubt_stay_for_the_next_epoch_and_count_once(
    make_host: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Peers P and Q of a stage hold the batch of the step from version 0. During the
    round a backward reaches P (for the next epoch, held); P's round ends in doubt (its
    all-reduce committed, with P's gradients, at Q, out of P's sight: the averager's
    `discarded`), so P's step gives its gradients back; then another backward reaches
    P. P learns the stage is at version 1 and re-syncs, dropping what it gave back. The
    trainer counts the two backwards of the batch in the step (P is among its members)
    and both later ones in the next: with them held by P, step sizes + held == the
    trainer's samples. (Given back to the step that was gone, the last one answered
    epoch 0, was dropped with it and counted by nobody.)"""
    host = await make_host()
    dht = await DHTNode.create(host, bootstrap=[], hop_timeout=1.0)
    try:
        p, requests = stage_and_requests(4)
        q = StageWorker(copy.deepcopy(p.module))
        optimizer = StageOptimizer(dht, "exp", 0, p, hyper={"lr": 1e-3})
        me, other = dht.peer_id, Identity.generate().peer_id
        ledger, completed = MicrobatchLedger(1), [0]

        def backward(worker: StageWorker, peer: Any, request: Any) -> int:
            """As the trainer sees it: the peer's answer, in its ledger."""
            ((_, epoch),) = worker.backward_many([request])
            ledger.applied(Applied(0, request[0], peer, epoch, request[1], request[2], request[3]))
            completed[0] += request[3]
            return epoch

        assert backward(p, me, requests[0]) == 0 and backward(q, other, requests[1]) == 0
        committed: list[int] = []

        async def round_in_doubt(weight: float, **_: Any) -> StepResult:
            theirs = q.take_gradients(0)  # Q commits the round, with our weight
            committed.append(round(weight) + theirs.samples)
            assert backward(p, me, requests[2]) == 1  # during the step: the next epoch
            return StepResult(False, "in doubt: voted READY, learned no decision",
                              discarded=True)  # fmt: skip

        monkeypatch.setattr(optimizer.averager, "step", round_in_doubt)
        result = await optimizer.step(5.0)
        assert result.discarded and p.samples_for(0) == requests[0][3]  # given back
        assert backward(p, me, requests[3]) == 1  # after it: still the next epoch
        p.drop_before(1)  # (the re-sync to the stage's version 1 that follows)
        assert ledger.resolve(0, [(0, frozenset({me, other}))], version=1) == []
        held = p.samples_for(1) + q.samples_for(1)
        assert committed == [requests[0][3] + requests[1][3]]
        assert sum(committed) + held == completed[0]
        assert ledger.counted[0] == committed[0] and ledger.open_samples(0) == held
    finally:
        await optimizer.aclose()
        await dht.aclose()


@pytest.mark.timeout(30)
async def test_a_step_that_re_syncs_forgets_the_backwards_it_took_so_their_replay_counts_here(
    make_host: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """P holds a backward for the step from version 0 and goes into that step; the round
    finds the stage ahead (it stepped from 0 without P) and P downloads its state at
    version 1 instead. The trainer replays that backward, and it may come back to P: P
    computes it again and counts it in the step from 1. (Were P to keep its old answer,
    at epoch 0, the trainer would see a step that went without P, replay it again, get
    the same answer, and so on: a daemon's trainer did that ~25 times in 2 s, each
    answer unsealed, until its auditor distrusted P, the stage's only live peer.)"""
    host = await make_host()
    dht = await DHTNode.create(host, bootstrap=[], hop_timeout=1.0)
    try:
        p, requests = stage_and_requests(1)
        optimizer = StageOptimizer(dht, "exp", 0, p, hyper={"lr": 1e-3})
        ((_, epoch),) = p.backward_many([requests[0]])
        assert epoch == 0 and p.samples_for(0) == requests[0][3]

        async def stage_was_ahead(weight: float, **_: Any) -> StepResult:
            optimizer.averager.commits = 1  # (the download: the stage's state at version 1)
            return StepResult(False, "re-synced with the swarm", resynced=True)

        monkeypatch.setattr(optimizer.averager, "step", stage_was_ahead)
        result = await optimizer.step(5.0)
        assert result.resynced and optimizer.version == 1 and p.epoch == 1
        assert optimizer.dropped_samples == requests[0][3]
        ((_, epoch),) = p.backward_many([requests[0]])  # the trainer's replay, here
        assert epoch == 1 and p.samples_for(1) == requests[0][3]
    finally:
        await optimizer.aclose()
        await dht.aclose()


@pytest.mark.timeout(60)
async def test_a_live_peer_behind_a_version_it_cannot_reach_is_not_left_out_for_good(
    make_host: Callable[..., Any],
) -> None:
    """A trainer heard of a version of the stage that only a peer now dead reached (it
    stepped alone, then died). The live peer, behind it, refuses the trainer's request
    and is banned for a while; but it answered: it is alive, and the trainer's next read
    of the stage takes the stage's version from it, so once the ban is over the peer
    serves. (Counted as failing, it would be left out of the stage's version for good:
    sent the dead peer's version, refusing, banned again. A daemon's stage stalled so.)"""
    task = make_task(TINY)
    (module,) = task.make_stages(3, 1)
    swarm = Swarm(make_host)
    try:
        peer = await swarm.stage_peer(0, module, global_batch=64)
        me = peer.server.dht.peer_id
        trainer = await swarm.trainer(1, codec="none", attempts=1)
        trainer.balancers[0].ban_base = 1.0  # (the test waits the ban out)
        assert await trainer.refresh() == [1] and trainer.versions[0] == 0
        batches = task.batches(0, 1, 0)

        async def one(mb: int) -> None:
            batch = next(batches)
            await trainer.run(mb, task.stage_inputs(batch), lambda y: task.stage_loss(y, batch))

        trainer.versions[0] = 1  # (the dead peer's lone step)
        with pytest.raises(StageFailed):
            await one(0)
        view = trainer.balancers[0].snapshot()[me]
        assert view.banned_until > 0 and not view.failing  # banned, but alive
        await trainer.refresh()
        assert trainer.versions[0] == 0
        await eventually(
            lambda: trainer.balancers[0].snapshot()[me].banned_until < time.monotonic(),
            "the ban over", 10,
        )  # fmt: skip
        await one(1)
        assert trainer.counters.samples == TINY["batch_size"]
    finally:
        await swarm.aclose()
