"""Audits in a pipelined swarm on loopback: a stage peer that adds 1e-2 noise to its
outputs is convicted, every trainer and its stage's peers stop dealing with it (its
stage steps without it), and training goes on; a trainer that lies about what it
received convicts nobody."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
import torch

from shoal.peer.training.tasks.bytegpt import make_task
from shoal.verification.stage_audit import StageAuditPolicy

from .pipeline_swarm import TINY, Swarm, loop_for
from .waiting import eventually


def make_cheater(worker: Any) -> None:
    """Outputs with relative noise 1e-2 (the subtlest cheat the audits must catch)."""
    honest = worker.forward_many

    def noisy(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        out = []
        for y in honest(inputs):
            noise = torch.randn_like(y)
            out.append(y + noise * (0.01 * y.norm() / noise.norm()))
        return out

    worker.forward_many = noisy


@pytest.mark.timeout(90)
async def test_a_cheating_stage_peer_is_convicted_and_routed_around(
    make_host: Callable[..., Any],
) -> None:
    task = make_task(TINY)
    stages = task.make_stages(7, 2)
    global_batch = 32  # (8 microbatches per step: referees are mostly at the prover's version)
    swarm = Swarm(make_host)
    try:
        await swarm.stage_peer(0, stages[0], global_batch=global_batch)
        honest = [await swarm.stage_peer(1, stages[1], global_batch=global_batch)
                  for _ in range(3)]  # fmt: skip
        cheater = await swarm.stage_peer(1, stages[1], global_batch=global_batch)
        make_cheater(cheater.worker)
        bad = cheater.server.dht.peer_id
        policy = StageAuditPolicy()  # (new peers are on probation: audited at 0.5)
        trainers = [await swarm.trainer(2, audit=policy) for _ in range(2)]
        loops = [loop_for(t, task, shard=0, seed=i, global_batch=global_batch, lag=1)
                 for i, t in enumerate(trainers)]  # fmt: skip
        runs = [asyncio.create_task(loop.run(steps=10_000)) for loop in loops]
        try:
            await eventually(
                lambda: any(bad in t.auditor.bans for t in trainers), "a conviction", 40
            )
            convicted_by = next(t for t in trainers if bad in t.auditor.bans)
            assert convicted_by.auditor.outcomes["convicted"] >= 1
            await eventually(lambda: convicted_by.auditor.bans.published >= 1, "published", 10)
            # The other trainer and the stage's peers learn it from the DHT.
            for peer in honest:
                await peer.server.audits.bans.refresh()
                assert bad in peer.server.dht.host.blocked()
            await eventually(lambda: all(bad in t.auditor.bans for t in trainers), "both know", 15)
            blocked_at = min(p.version for p in honest)
            served = {t: t.served_by.get(bad, 0) for t in trainers}
            samples = [t.counters.samples for t in trainers]
            more = sum(samples) + 2 * global_batch
            await eventually(lambda: sum(t.counters.samples for t in trainers) >= more,
                             "training goes on", 30)  # fmt: skip

            def stepped() -> bool:  # every honest peer took a step since the block
                return all(any(r.version > blocked_at for r in p.optimizer.steps) for p in honest)

            await eventually(stepped, "the stage steps on", 30)

            def settled_at_cheater() -> bool:  # counted in a step, or replayed on honest peers
                return not any(e.peer == bad and e.epoch <= blocked_at
                               for t in trainers for e in t.ledger.open(1))  # fmt: skip

            # Every backward a trainer had at the cheater is settled as the stage steps on.
            await eventually(settled_at_cheater, "its backwards counted or replayed", 30)
        finally:
            for run in runs:
                run.cancel()
            await asyncio.gather(*runs, return_exceptions=True)
        for t in trainers:
            assert bad not in t.balancers[1].peers()
            assert t.served_by.get(bad, 0) == served[t]  # no request since
            # No honest referee accused anyone: an honest peer is acquitted only when the
            # cheater, drawn as its first referee, accused it (and that costs it a strike).
            assert set(t.auditor.strikes) <= {bad}, t.auditor.strikes
            assert t.auditor.outcomes["acquitted"] == t.auditor.strikes[bad]
        for peer in honest:
            assert peer.server.audits.counts["audited"] >= 1
            # Its open round's gradients are left out: the stage steps without it.
            later = [r for r in peer.optimizer.steps if r.version > blocked_at]
            assert later and all(bad not in r.members for r in later)
        # No conviction of an honest peer anywhere.
        assert all(t.auditor.bans.bans.banned == {bad} for t in trainers)
    finally:
        for t in [t for t in locals().get("trainers", [])]:
            await t.auditor.aclose()
        await swarm.aclose()


@pytest.mark.timeout(60)
async def test_a_trainer_lying_about_what_it_received_convicts_nobody(
    make_host: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every answer audited with a signature of something else than the answer: each
    referee then judges the prover's own revealed result, and every audit passes."""
    import shoal.pipeline.auditor as auditor_module

    honest_signature = auditor_module.token_signature

    def lying(t: torch.Tensor, seed: bytes, policy: StageAuditPolicy) -> Any:
        return honest_signature(t * 1.1 + 0.01, seed, policy)

    monkeypatch.setattr(auditor_module, "token_signature", lying)
    task = make_task(TINY)
    stages = task.make_stages(7, 2)
    swarm = Swarm(make_host)
    trainer = None
    try:
        await swarm.stage_peer(0, stages[0], global_batch=10_000)
        peers = [await swarm.stage_peer(1, stages[1], global_batch=10_000) for _ in range(4)]
        trainer = await swarm.trainer(2, audit=StageAuditPolicy(rate=1.0, probation_rate=1.0))
        await trainer.refresh()
        batches = task.batches(0, 1, 0)
        for i in range(4):
            batch = next(batches)
            await trainer.run(i, task.stage_inputs(batch), lambda y, b=batch: task.stage_loss(y, b))
        assert trainer.auditor is not None
        await trainer.auditor.settled()
        outcomes = trainer.auditor.outcomes
        assert outcomes["passed"] >= 8 and outcomes["convicted"] == 0, outcomes
        assert len(trainer.auditor.bans) == 0 and not trainer.auditor.distrusted
        assert sum(p.server.audits.counts["failed"] for p in peers) == 0
    finally:
        if trainer is not None and trainer.auditor is not None:
            await trainer.auditor.aclose()
        await swarm.aclose()
