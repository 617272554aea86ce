"""DiLoCo with `overlap_steps`: a round runs while the next inner steps do, and its outer
step lands that many steps later with the steps taken meanwhile kept.

Real hosts and DHT nodes on loopback, the small models of test_outer_strategies.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
import torch

from shoal.averaging.diloco import DiLoCo
from shoal.averaging.outer import resolve_options

from . import test_outer_strategies as base
from .test_outer_strategies import SPARSE, Peer

# The fixtures: peers on loopback, and the whole-state math inline and in threads.
swarm = base.swarm
whole_state_math = base.whole_state_math

OVERLAP = {"inner_steps": 4, "overlap_steps": 2}


def stepped(peer: Peer, params: list[torch.Tensor], steps: int) -> list[torch.Tensor]:
    """`params` after `steps` of the peer's inner step, the same operations."""
    out = [p.clone() for p in params]
    for _ in range(steps):
        for x, t in zip(out, peer.target, strict=True):
            x.sub_(0.1 * (x - t))
    return out


def test_overlap_must_be_below_inner_steps_and_never_verified() -> None:
    assert resolve_options("diloco", {})["overlap_steps"] == 0
    assert resolve_options("diloco", OVERLAP)["overlap_steps"] == 2
    with pytest.raises(ValueError, match="overlap_steps"):
        resolve_options("diloco", {"inner_steps": 4, "overlap_steps": 4})
    with pytest.raises(ValueError, match="overlap_steps"):
        resolve_options("diloco", {"overlap_steps": -1})
    with pytest.raises(ValueError, match=r"overlap_steps.*verifying"):
        resolve_options("diloco", {**OVERLAP, "verify": True})


@pytest.mark.timeout(30)
async def test_a_lone_peers_outer_step_lands_late_and_keeps_the_steps_taken_meanwhile(
    swarm: Callable[..., Any], whole_state_math: None
) -> None:
    (peer,) = await swarm("diloco", 1, {"inner_steps": 4, "overlap_steps": 3, "min_group_size": 1})
    strategy = peer.strategy
    assert isinstance(strategy, DiLoCo)
    theta0 = [p.clone() for p in peer.params]
    assert await peer.train(4) == []  # the round began at step 4, in the background
    pending = strategy._pending
    assert pending is not None and strategy.samples_since_sync == 0
    at_round = stepped(peer, theta0, 4)
    await asyncio.wait_for(asyncio.shield(pending.task), 10)
    assert strategy._pending is pending  # (merged by an inner step, not before)
    reports = await peer.train(1)  # merged after the first step that ends with it done
    assert [(r.committed, r.contribution) for r in reports] == [(True, (0, 4))]
    # The outer step is the DiLoCo formula on the first 4 steps' pseudo-gradient.
    expected_globals = []
    for t0, loc in zip(theta0, at_round, strict=True):
        g = t0 - loc
        expected_globals.append(t0 - 0.7 * (g + 0.9 * g))
    for got, want in zip(strategy.globals, expected_globals, strict=True):
        assert torch.allclose(got, want, rtol=0, atol=1e-6)
    # Step 5 ran from the local parameters; the merge moved it onto the globals.
    for p, g, a, s in zip(
        peer.params, strategy.globals, at_round, stepped(peer, at_round, 1), strict=True
    ):
        assert torch.equal(p, s + (g - a))
    assert strategy.samples_since_sync == 8 and strategy.synced_at_step == 4
    # The next round's pseudo-gradient covers exactly the steps since the last one began.
    moved = [p.clone() for p in peer.params]
    await peer.train(3)  # step 8: the next round begins
    for d, g, p in zip(strategy.deltas, strategy.globals, stepped(peer, moved, 3), strict=True):
        assert torch.equal(d, g - p)
    await strategy.finish()  # merges the round in flight
    assert strategy._pending is None and strategy.outer_steps == 2


@pytest.mark.timeout(30)
async def test_a_round_still_running_k_steps_after_it_began_is_waited_for(
    swarm: Callable[..., Any],
) -> None:
    """The bound: at step t0 + K the merge waits for the round (here: one that finds no
    group and gives up after `round_timeout`), so training never runs more than K
    steps on an outer step still in the air."""
    opts = {**OVERLAP, "min_group_size": 2, "matchmaking_time": 0.5, "round_timeout": 1.0}
    (peer,) = await swarm("diloco", 1, opts)
    globals_before = [g.clone() for g in peer.strategy.globals]
    await peer.train(4)
    pending = peer.strategy._pending
    reports = await peer.train(2)
    assert pending.task.done() and peer.strategy._pending is None
    assert [r.committed for r in reports] == [False]
    # Nothing moved: the round's samples go back to the next round's weight.
    assert peer.strategy.samples_since_sync == 48  # 4 steps of the round + 2 since
    assert peer.strategy.synced_at_step == 0
    assert all(map(torch.equal, peer.strategy.globals, globals_before))


@pytest.mark.timeout(60)
async def test_overlapped_peers_commit_bit_identical_globals_every_round(
    swarm: Callable[..., Any],
) -> None:
    peers = await swarm("diloco", 3, {**OVERLAP, "round_timeout": 15.0, "stall_timeout": 5.0})
    reports = await asyncio.gather(*(p.train(14, pause=0.02) for p in peers))
    # Rounds began at 4, 8 and 12 and merged at 6, 10 and 14.
    for got in reports:
        assert [(r.committed, r.group_size) for r in got] == [(True, 3)] * 3, [
            r.describe() for r in got
        ]
        assert [r.contribution for r in got] == [(0, 4), (4, 8), (8, 12)]
    assert len({p.strategy.fingerprint() for p in peers}) == 1
    assert len({r[-1].fingerprint for r in reports}) == 1
    # Each peer's parameters are the globals plus its own steps since the last round began.
    assert all(not torch.equal(p.params[0], p.strategy.globals[0]) for p in peers)


@pytest.mark.timeout(40)
async def test_with_a_sparse_codec_overlapped_rounds_commit_alike_and_carry_the_rest(
    swarm: Callable[..., Any],
) -> None:
    opts = {**SPARSE, "codec": "topk", "inner_steps": 4, "overlap_steps": 1}
    peers = await swarm("diloco", 2, opts)
    reports = await asyncio.gather(*(p.train(9) for p in peers))
    assert all([r.committed for r in got] == [True, True] for got in reports)
    assert len({p.strategy.fingerprint() for p in peers}) == 1
    assert all(p.strategy.feedback.residual.any() for p in peers)


@pytest.mark.timeout(40)
async def test_a_checkpoint_between_a_commit_and_its_merge_restarts_from_the_globals(
    swarm: Callable[..., Any],
) -> None:
    """Saved before the round committed: its samples count as not yet synchronized and
    the parameters saved beside it are consistent with the globals. Saved after the
    commit but before the merge: the parameters are behind the globals, and a restart
    sets them to the globals and claims no samples."""
    opts = {**OVERLAP, "min_group_size": 1}
    (peer,) = await swarm("diloco", 1, opts)
    await peer.train(4)
    early = peer.strategy.state_dict()  # the round has not run yet
    assert early["samples_since_sync"] == 32 and "params_behind" not in early
    pending = peer.strategy._pending
    await asyncio.wait_for(asyncio.shield(pending.task), 10)
    assert pending.task.result().result.committed
    late = peer.strategy.state_dict()
    assert late["samples_since_sync"] == 0 and late["params_behind"] is True
    assert late["commits"] == 1

    (restarted,) = await swarm("diloco", 1, opts, seed=5, start=False, connected=False)
    restarted.strategy.load_state_dict(late)
    for p, q in zip(restarted.params, peer.params, strict=True):
        p.copy_(q)  # the model's checkpoint: the parameters not yet merged
    assert not await restarted.strategy.start(join=False)
    assert all(
        torch.equal(p, g) for p, g in zip(restarted.params, restarted.strategy.globals, strict=True)
    )
    assert restarted.strategy.samples_since_sync == 0


@pytest.mark.timeout(30)
async def test_a_step_cancelled_while_it_waits_for_the_merge_leaves_the_round_to_close(
    swarm: Callable[..., Any],
) -> None:
    """The trainer's stop cancels a step whose merge is waiting for the round: the round
    stays pending, and dropping it (what closing does once `finish` gave up waiting)
    gives its samples back, nothing having moved, instead of losing them."""
    opts = {**OVERLAP, "min_group_size": 2, "matchmaking_time": 5.0, "round_timeout": 10.0}
    (peer,) = await swarm("diloco", 1, opts)
    await peer.train(5)
    pending = peer.strategy._pending
    assert pending is not None and not pending.task.done()
    await asyncio.to_thread(peer.inner_step)
    waiting = asyncio.ensure_future(peer.strategy.after_inner_step(8))  # step 6: must wait
    await asyncio.sleep(0)
    assert not waiting.done()
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    assert peer.strategy._pending is pending and not pending.task.done()
    await peer.strategy._drop_pending()
    assert pending.task.cancelled() and peer.strategy._pending is None
    assert peer.strategy.samples_since_sync == 48
