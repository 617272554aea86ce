"""A stage's peers step together or not at all: a peer steps by itself only when no
other peer of its stage reported at its version (`StagePeer`), never merely because
its matchmaking found nobody else (a failed try left the others out, or their
declarations were lost): each of two such peers would step alone, and the stage
would hold two states at one version until one re-synced."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from waiting import eventually

from shoal.averaging.averager import StepResult
from shoal.peer.training.tasks.bytegpt import make_task

from .pipeline_swarm import TINY, Swarm

GLOBAL_BATCH = 8  # two microbatches of TINY's 4 samples
SHUNNED_S = 10.0  # (the batch is complete within a second or two)


@pytest.mark.timeout(90)
async def test_two_peers_that_cannot_group_for_a_while_wait_then_step_together(
    make_host: Callable[..., Any],
) -> None:
    """Two peers of a stage leave each other out of their groups for a few seconds (as
    after a try that failed on the other); both hold the global batch meanwhile.
    Neither steps alone; once they group again, they step together, to one state."""
    task = make_task(TINY)
    (module,) = task.make_stages(5, 1)
    swarm = Swarm(make_host)
    try:
        peers = [await swarm.stage_peer(0, module, global_batch=GLOBAL_BATCH) for _ in range(2)]
        steps: dict[int, list[StepResult]] = {0: [], 1: []}
        # Each knows the other is there (a peer that saw no report of the other yet
        # would rightly step by itself: it is alone as far as it can tell).
        await eventually(
            lambda: all(len({r.peer for r in p._merged()}) == 2 for p in peers),
            "each peer's report read by the other",
            timeout=20,
        )
        for i, (peer, other) in enumerate(zip(peers, reversed(peers), strict=True)):
            peer.on_step = steps[i].append
            peer.optimizer.averager.shun(other.server.dht.peer_id, SHUNNED_S)
        trainer = await swarm.trainer(1, deadline=10.0, codec="none")
        await trainer.refresh()
        batches = task.batches(0, 1, 0)
        for mb in range(GLOBAL_BATCH // TINY["batch_size"]):
            batch = next(batches)
            await trainer.run(
                mb, task.stage_inputs(batch), lambda y, b=batch: task.stage_loss(y, b)
            )

        # (A peer's version counts a step as its commit begins: wait for the steps' ends.)
        await eventually(lambda: all(steps.values()), "a step on each peer", timeout=60)
        # Every step either took was the two of them together...
        assert [[r.group_size for r in s] for s in steps.values()] == [[2], [2]], steps
        # ...after tries that found no group (the batch was complete long before).
        assert all(p.steps_failed >= 1 for p in peers), [p.steps_failed for p in peers]
        assert [p.optimizer.averager.last_fingerprint_commits for p in peers] == [1, 1]
        first, second = (p.optimizer.averager.last_fingerprint for p in peers)
        assert first == second
        # Each pushed its new version to the other (no microbatch came since): not only
        # the DHT carries it, which can lag long enough for a partner to look behind.
        ids = [p.server.dht.peer_id for p in peers]
        pairs = list(zip(peers, reversed(ids), strict=True))
        await eventually(
            lambda: all(o in p._heard and p._heard[o].version == 1 for p, o in pairs),
            "the new versions pushed",
            timeout=10,
        )
    finally:
        await swarm.aclose()
