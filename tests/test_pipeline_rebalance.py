"""Rebalancing: a stage peer moves to the stage that limits the pipeline only when it
clearly helps and can never flap (`pipeline/rebalance.py`)."""

from __future__ import annotations

import random

import pytest

from shoal.pipeline.directory import StageRecord
from shoal.pipeline.rebalance import RebalancePolicy, Rebalancer, move_contested, plan_move
from shoal.transport.identity import Identity

pytestmark = pytest.mark.timeout(60)

PEERS = [Identity.generate().peer_id for _ in range(16)]
POLICY = RebalancePolicy(period_s=10.0)


def rec(
    peer: int, speed: float | None = 1.0, *, ready: bool = True, leaving: int | None = None
) -> StageRecord:
    """A record of a peer taking `speed` samples/s (forward and backward together)."""
    fb = None if speed is None else 2 * speed
    return StageRecord(PEERS[peer], fb, fb, 0, 0, 0.0, ready, leaving)


def layout(counts: list[int], speed: float = 1.0) -> list[list[StageRecord]]:
    ids = iter(range(len(PEERS)))
    return [[rec(next(ids), speed) for _ in range(n)] for n in counts]


def plan(
    stages: list[list[StageRecord]], stage: int, index: int = 0, **policy: float
) -> int | None:
    mine = stages[stage][index]
    return plan_move(stages, mine, stage, RebalancePolicy(**policy) if policy else POLICY)


def test_a_peer_of_a_full_stage_moves_to_the_starved_one() -> None:
    stages = layout([3, 3, 3, 1])
    assert [plan(stages, s) for s in range(3)] == [3, 3, 3]
    assert plan(stages, 3) is None  # the bottleneck itself stays


def test_a_stage_at_its_minimum_gives_no_peer() -> None:
    assert plan(layout([1, 1, 1, 0]), 0) is None  # (0 peers: the stage is empty)
    assert plan(layout([2, 2, 1]), 0, min_peers=2) is None
    assert plan(layout([3, 2, 1]), 0, min_peers=2) == 2


def test_a_move_that_would_reverse_the_order_is_refused() -> None:
    # Two peers against one: after a move it would be one against two, and the
    # move back would look just as good.
    assert plan(layout([2, 1]), 0) is None
    assert plan(layout([3, 1]), 0) == 1


def test_a_gain_below_the_margin_is_no_reason_to_move() -> None:
    stages = [[rec(0, 1.0), rec(1, 1.0), rec(5, 1.0), rec(2, 0.15)], [rec(3, 1.0), rec(4, 1.0)]]
    # Peer 2 is slow: moving it would add 7.5 % to stage 1, below the 20 % margin.
    assert plan(stages, 0, 3) is None
    assert plan(stages, 0, 3, margin=0.05) == 1


def test_two_equally_starved_stages_still_draw_a_peer() -> None:
    assert plan(layout([3, 3, 1, 1]), 0) == 2


def test_a_stage_with_a_peer_arriving_or_leaving_waits() -> None:
    stages = layout([3, 3, 3, 1])
    stages[0][1] = rec(1, ready=False)  # re-syncing, or arriving by a move
    assert plan(stages, 0) is None
    assert plan(stages, 1) == 3


def test_a_peer_arriving_counts_toward_its_new_stage() -> None:
    stages = layout([3, 3, 3, 1])
    stages[3].append(rec(15, None, ready=False))  # unmeasured: counted as typical
    assert [plan(stages, s) for s in range(3)] == [None, None, None]


def test_a_stage_a_peer_announced_it_leaves_waits_though_its_record_is_still_there() -> None:
    stages = layout([3, 3, 3, 1])
    stages[3].append(rec(1, None, ready=False, leaving=0))  # peer 1 of stage 0, arriving
    stages[0][1] = rec(1)  # still serving stage 0 until it drains
    assert plan(stages, 0, 0) is None
    del stages[3][-1]
    assert plan(stages, 0, 0) == 3


def test_a_move_meets_another_arriving_at_its_target_or_leaving_its_stage() -> None:
    stages = layout([3, 3, 1])
    me = stages[0][0].peer
    arriving_me = rec(0, None, ready=False, leaving=0)
    assert not move_contested([*stages[:2], [*stages[2], arriving_me]], me, 0, 2)
    # Another peer arriving at our target, from any stage (its capacity changed).
    other = rec(14, None, ready=False, leaving=1)
    assert move_contested([*stages[:2], [*stages[2], arriving_me, other]], me, 0, 2)
    # Another peer of our stage leaving it, for another stage.
    assert move_contested([*stages[:1], [*stages[1], rec(1, ready=False, leaving=0)],
                           [*stages[2], arriving_me]], me, 0, 2)  # fmt: skip


def test_a_peer_that_gave_way_looks_again_within_a_period_without_holding() -> None:
    policy = RebalancePolicy(period_s=10.0, move_fraction=1.0, hold_periods=4)
    stages = layout([3, 3, 3, 1])
    r = Rebalancer(policy, now=0.0, rng=random.Random(4))
    r.wake(r.wake_at, stages, stages[0][0], 0)
    assert r.pending == 3
    r.gave_way(20.0)
    assert r.pending is None and 20.0 + 7.5 <= r.wake_at <= 20.0 + 12.5
    r.wake(r.wake_at, stages, stages[0][0], 0)
    assert r.pending == 3  # a candidate again at once: it did not move


def test_an_unmeasured_peer_does_not_move() -> None:
    stages = layout([3, 3, 3, 1])
    stages[0][0] = rec(0, None)
    assert plan(stages, 0) is None


def test_our_speed_on_another_stage_is_scaled_by_the_stages_costs() -> None:
    # Stage 1's layers cost 4x: its peers take a quarter of the samples. One of
    # stage 0's two peers (4 samples/s) would add about 1 sample/s there, not 4:
    # 8 -> 4 against 3 -> 4 keeps the order (unscaled, 3 -> 7 would flip it).
    stages = [[rec(0, 4.0), rec(1, 4.0)], [rec(2, 1.0), rec(3, 1.0), rec(4, 1.0)]]
    assert plan(stages, 0) == 1


def test_balanced_stages_with_ten_percent_jitter_never_qualify() -> None:
    rng = random.Random(7)
    for _ in range(2000):
        stages = layout([3, 3, 3, 3])
        stages = [[rec(PEERS.index(r.peer), rng.uniform(0.9, 1.1)) for r in s] for s in stages]
        assert all(plan(stages, s, i) is None for s in range(4) for i in range(3))


def test_a_candidate_moves_only_if_the_recheck_agrees() -> None:
    policy = RebalancePolicy(period_s=10.0, move_fraction=1.0)
    stages = layout([3, 3, 3, 1])
    r = Rebalancer(policy, now=0.0, rng=random.Random(1))
    assert 5.0 <= r.wake_at <= 12.5  # a random part of the first period
    looked = r.wake_at
    first = r.wake(looked, stages, stages[0][0], 0)
    assert first.target is None and r.pending == 3  # a candidate: look again soon
    assert 1.0 <= first.at - looked <= 5.0
    recheck = r.wake(r.wake_at, stages, stages[0][0], 0)
    assert recheck.target == 3

    r = Rebalancer(policy, now=0.0, rng=random.Random(1))
    r.wake(r.wake_at, stages, stages[0][0], 0)
    moved_by_another = [*stages[:3], [*stages[3], rec(15, ready=False)]]
    assert r.wake(r.wake_at, moved_by_another, stages[0][0], 0).target is None


def test_a_peer_that_moved_holds_its_stage() -> None:
    policy = RebalancePolicy(period_s=10.0, move_fraction=1.0, hold_periods=4)
    stages = layout([3, 3, 3, 1])
    r = Rebalancer(policy, now=0.0, rng=random.Random(2))
    r.moved(100.0)
    for _ in range(3):  # within 40 s of the move: not even a candidate
        assert r.wake(r.wake_at, stages, stages[0][0], 0).target is None
        assert r.pending is None
    assert r.wake_at - 100.0 >= 30.0 * (1 - policy.jitter)


def test_only_a_fraction_of_eligible_peers_become_candidates() -> None:
    policy = RebalancePolicy(period_s=10.0, move_fraction=0.25)
    stages = layout([3, 3, 3, 1])
    rng = random.Random(3)
    candidates = 0
    for _ in range(1000):
        r = Rebalancer(policy, now=0.0, rng=rng)
        r.wake(r.wake_at, stages, stages[0][0], 0)
        candidates += r.pending is not None
    assert 200 <= candidates <= 300


# ---------------------------------------------------------------- a simulated swarm


def simulate(
    counts: list[int], periods: float, *, jitter: float, seed: int, policy: RebalancePolicy
) -> tuple[list[tuple[float, int, int, int]], list[list[int]]]:
    """Peers of equal speed (each look sees speeds jittered by +-`jitter`) run their
    rebalancers on a shared clock; a move happens at once. Returns the moves
    (time, peer, from, to) and the peers per stage after each move."""
    rng = random.Random(seed)
    stage_of = [s for s, n in enumerate(counts) for _ in range(n)]
    bots = [Rebalancer(policy, 0.0, random.Random(rng.random())) for _ in stage_of]
    moves: list[tuple[float, int, int, int]] = []
    history = [list(counts)]
    while True:
        peer = min(range(len(bots)), key=lambda i: bots[i].wake_at)
        now = bots[peer].wake_at
        if now > periods * policy.period_s:
            return moves, history
        speeds = [rng.uniform(1 - jitter, 1 + jitter) for _ in stage_of]
        stages: list[list[StageRecord]] = [[] for _ in counts]
        for i, s in enumerate(stage_of):
            stages[s].append(rec(i, speeds[i]))
        decision = bots[peer].wake(now, stages, rec(peer, speeds[peer]), stage_of[peer])
        if decision.target is not None:
            moves.append((now, peer, stage_of[peer], decision.target))
            stage_of[peer] = decision.target
            bots[peer].moved(now)
            history.append([stage_of.count(s) for s in range(len(counts))])


@pytest.mark.parametrize("seed", range(20))
def test_a_starved_stage_draws_a_peer_within_two_and_a_half_periods(seed: int) -> None:
    moves, history = simulate([3, 3, 3, 1], 20, jitter=0.1, seed=seed, policy=POLICY)
    assert moves and moves[0][0] <= 2.5 * POLICY.period_s and moves[0][3] == 3
    assert all(min(h) >= POLICY.min_peers for h in history)
    assert min(history[-1]) >= 2  # the bottleneck doubled
    assert len(moves) <= 2  # and then it settles


@pytest.mark.parametrize("seed", range(20))
def test_a_balanced_pipeline_stays_put_and_nobody_returns(seed: int) -> None:
    moves, _ = simulate([3, 3, 3, 3], 10, jitter=0.1, seed=seed, policy=POLICY)
    assert len(moves) <= 1
    moves, _ = simulate([4, 3, 3, 2], 30, jitter=0.1, seed=seed, policy=POLICY)
    returns = [
        (p, a, b)
        for _, p, a, b in moves
        if any(q == p and c == b and d == a for _, q, c, d in moves)
    ]
    assert not returns
