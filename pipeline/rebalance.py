"""When a stage peer should move to another stage: sans-I/O rules that cannot flap.

A pipeline runs at the pace of its slowest stage, so a peer of a stage with
capacity to spare helps most by serving the stage with the least. Moving costs
a state download and the work in flight, and peers that decide on the same
records at the same moment would all move at once and then all move back
(Petals users saw servers flap between blocks). A peer of stage `a` therefore
moves to the stage `b` with the least capacity only when every one of these
holds (`plan_move`):

- stage `a` keeps at least `min_peers` peers without it;
- no other peer of `a` is leaving or arriving (a record not `ready`): one
  change at a time per stage, decided on settled records;
- after the move, `a` still has at least `b`'s capacity, within
  `order_tolerance` (the order of the two is kept: the reverse move can never
  look good next);
- the lesser of the two capacities grows by `margin` (a clear gain, not
  measurement noise: with +-10 % jitter, a balanced pipeline never qualifies).

And over time (`Rebalancer`, a state machine on a clock the caller gives):

- peers look every `period_s`, jittered, so they do not look together;
- an eligible peer becomes a candidate only with probability `move_fraction`,
  so only a random fraction of a stage's eligible peers moves at once;
- a candidate looks again after a random delay and moves only if the same
  move still qualifies (the first mover's records, `ready` False where it
  goes and gone where it left, stop the others);
- two candidates can still decide on the same records, each before the
  other's announcement is readable. So a mover announces where it goes, reads
  the records again, and gives way if another peer is arriving there or
  leaving its stage too (`move_contested`). Of two such movers, the one whose
  announcement lands second reads the first one's (it reads after its own
  store), so at most one goes ahead; both may give way, and then look again a
  jittered period later;
- a peer that moved stays at least `hold_periods` periods.

Capacities are samples/s (a forward and its backward), as the stage records
announce them (`directory.StageRecord`). Our speed on the target stage is
estimated from our speed here scaled by the ratio of the two stages' typical
peers (stages differ in cost; peers differ in hardware).
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace

from shoal.transport.identity import PeerID

from .directory import StageRecord, least_capacity_stage, stage_capacity

__all__ = ["RebalancePolicy", "Rebalancer", "move_contested", "plan_move"]


@dataclass(frozen=True)
class RebalancePolicy:
    period_s: float = 30.0  # how often a peer looks at the stage records
    jitter: float = 0.25  # each period is period_s x U(1 - jitter, 1 + jitter)
    min_peers: int = 1  # a stage never drops below this many peers by a move
    margin: float = 0.2  # the lesser capacity of the two stages grows by this much
    # After the move `a` keeps at least `b`'s capacity, within this much measurement
    # noise: [3, 1] -> [2, 2] is a tie, and measured speeds differ by 10-20 % (the
    # margin, not this, is what keeps a move from reversing: see `plan_move`).
    order_tolerance: float = 0.25
    recheck: tuple[float, float] = (0.1, 0.5)  # the re-check's delay, in periods
    hold_periods: float = 4.0  # a peer that moved stays at least this long
    move_fraction: float = 0.5  # an eligible peer becomes a candidate with this probability

    def __post_init__(self) -> None:
        if self.period_s <= 0 or not 0 <= self.jitter < 1 or self.min_peers < 1:
            raise ValueError("period_s > 0, 0 <= jitter < 1 and min_peers >= 1")
        if not 0 <= self.order_tolerance < 1:
            raise ValueError("0 <= order_tolerance < 1")
        if self.margin < 0 or not 0 < self.move_fraction <= 1 or self.hold_periods < 0:
            raise ValueError("margin >= 0, 0 < move_fraction <= 1 and hold_periods >= 0")
        low, high = self.recheck
        if not 0 < low <= high:
            raise ValueError("recheck must be a range of positive delays")


def _typical(records: Sequence[StageRecord]) -> float | None:
    speeds = [s for r in records if (s := r.samples_per_s)]
    return statistics.median(speeds) if speeds else None


def plan_move(
    stages: Sequence[Sequence[StageRecord]],
    mine: StageRecord,
    my_stage: int,
    policy: RebalancePolicy,
    allowed: Collection[int] | None = None,
) -> int | None:
    """The stage our peer (`mine`, serving `my_stage`) should move to now, if any:
    one of `allowed` (the stages that fit our memory; None: any).

    `stages` are every stage's records as read from the DHT; ours is replaced by
    `mine` (the DHT may not have our newest yet)."""
    speed = mine.samples_per_s
    if speed is None:
        return None  # not measured yet: no basis for a move
    stages = [
        [r for r in records if r.peer != mine.peer] + ([mine] if s == my_stage else [])
        for s, records in enumerate(stages)
    ]
    here = stages[my_stage]
    if len(here) - 1 < policy.min_peers:
        return None
    if any(not r.ready for r in here) or _leaving(stages, my_stage, mine.peer):
        return None  # a peer of ours is leaving or arriving: wait until it settled
    # (Capacity only: the joiners' replicas-first rule would name a stage this move's
    # capacity rules then refuse, and the stage that limits the pipeline would wait.)
    # (Among the stages that fit only: the records are claims, our memory is not.)
    candidates = None if allowed is None else {*allowed, my_stage}
    target = least_capacity_stage(stages, replicas=1, allowed=candidates)
    if target == my_stage:
        return None
    measured = [s for records in stages for r in records if (s := r.samples_per_s)]
    swarm_typical = statistics.median(measured) if measured else None
    capacity = [stage_capacity(records, swarm_typical) for records in stages]
    typical_here = _typical(here) or speed
    typical_there = _typical(stages[target]) or typical_here
    speed_there = speed * typical_there / typical_here
    here_after = capacity[my_stage] - speed
    there_after = capacity[target] + speed_there
    if here_after < (1 - policy.order_tolerance) * there_after:
        return None  # the order would flip: the move back would look as good next
    # The gain: with `b` the lesser before, `a - s >= (1 + m) b`. The move back would
    # need `min(b, a) >= (1 + m)(a - s)`, but `b <= (a - s) / (1 + m)`: it never
    # qualifies while the speeds hold (and noise would have to swing them by (1 + m)^2).
    lesser_before = min(capacity[my_stage], capacity[target])
    if min(here_after, there_after) < (1 + policy.margin) * lesser_before:
        return None
    return target


def _leaving(stages: Sequence[Sequence[StageRecord]], stage: int, me: PeerID) -> bool:
    """Whether a peer other than us announced a move out of `stage`."""
    return any(r.leaving == stage and r.peer != me for records in stages for r in records)


def move_contested(
    stages: Sequence[Sequence[StageRecord]], me: PeerID, my_stage: int, target: int
) -> bool:
    """Whether our move from `my_stage` to `target`, announced, meets another one:
    another peer arriving at `target` (its capacity is no longer what we planned
    on), or leaving `my_stage` (which may not keep enough without both). Read
    after our announcement landed; we give way if so."""
    arriving = any(not r.ready and r.peer != me for r in stages[target])
    return arriving or _leaving(stages, my_stage, me)


@dataclass(frozen=True)
class Decision:
    """What `Rebalancer.wake` answers: move now to `target` (None: stay), and when to
    wake next (`at`, on the caller's clock)."""

    target: int | None
    at: float


class Rebalancer:
    """One stage peer's moves over time, by `plan_move`, with the timing rules above.

    The driver calls `wake(now, ...)` at `wake_at` with fresh records; when it
    answers a target, the driver moves and then calls `moved(now, stage)`."""

    def __init__(
        self, policy: RebalancePolicy, now: float, rng: random.Random | None = None
    ) -> None:
        self.policy = policy
        self.rng = rng or random.Random()
        # The first look comes after a random part of a period: peers started
        # together do not look together.
        self.wake_at = now + policy.period_s * self.rng.uniform(0.5, 1.0 + policy.jitter)
        self.moved_at = -math.inf
        self.pending: int | None = None  # a candidate move, to re-check at wake_at
        self.moves = 0

    def _period(self) -> float:
        j = self.policy.jitter
        return self.policy.period_s * self.rng.uniform(1 - j, 1 + j)

    def _holding(self, now: float) -> bool:
        return now - self.moved_at < self.policy.hold_periods * self.policy.period_s

    def wake(
        self,
        now: float,
        stages: Sequence[Sequence[StageRecord]],
        mine: StageRecord,
        my_stage: int,
        allowed: Collection[int] | None = None,
    ) -> Decision:
        """`allowed`: the stages we may move to (those that fit our memory)."""
        target = (
            None if self._holding(now) else plan_move(stages, mine, my_stage, self.policy, allowed)
        )
        pending, self.pending = self.pending, None
        if pending is not None:  # the re-check: the same move must still qualify
            self.wake_at = now + self._period()
            return Decision(target if target == pending else None, self.wake_at)
        if target is not None and self.rng.random() < self.policy.move_fraction:
            self.pending = target
            low, high = self.policy.recheck
            self.wake_at = now + self.policy.period_s * self.rng.uniform(low, high)
        else:
            self.wake_at = now + self._period()
        return Decision(None, self.wake_at)

    def moved(self, now: float) -> None:
        """We moved (or tried to): hold, and look again a period later."""
        self.moved_at = now
        self.moves += 1
        self.pending = None
        self.wake_at = now + self._period()

    def gave_way(self, now: float) -> None:
        """Our move met another (`move_contested`) and we stayed: look again a
        jittered period later (no hold: we did not move)."""
        self.pending = None
        self.wake_at = now + self._period()


def with_speed(record: StageRecord, samples_per_s: float | None) -> StageRecord:
    """`record` with its forward and backward set so it takes `samples_per_s`."""
    if samples_per_s is None:
        return replace(record, forward=None, backward=None)
    return replace(record, forward=2 * samples_per_s, backward=2 * samples_per_s)
