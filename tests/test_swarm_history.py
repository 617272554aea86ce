"""The swarm's history (peer/status/swarm_history.py): a bounded time series per peer.

Fed /peers rows as the daemon reads them (a report's `updated_at` is the time it
was made) with a clock the tests move: a new report is a point, the same report
read again is not; series are oldest first, thinned (not cut) when full, aged out
after max_age_s (peers that left included), and a new peer beyond max_peers
replaces the one heard from longest ago.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest

from shoal.peer.status.swarm_history import SwarmHistory

pytestmark = pytest.mark.timeout(10)


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def row(peer: str, t: float, step: int, loss: float | None = 2.0, **extra: Any) -> dict[str, Any]:
    return {"peer_id": peer, "updated_at": t, "step": step, "loss": loss, **extra}


def test_a_new_report_is_a_point_and_the_same_report_read_again_is_not() -> None:
    clock = Clock()
    history = SwarmHistory(clock=clock)
    assert history.record([row("a", clock.now - 4, 10, 3.5, val_loss=3.7)]) == 1
    clock.now += 2
    assert history.record([row("a", clock.now - 6, 10, 3.5, val_loss=3.7)]) == 0  # cached read
    clock.now += 15
    assert history.record([row("a", clock.now - 1, 20, 3.1), row("b", clock.now, 5)]) == 2
    snapshot = history.snapshot()
    assert snapshot["a"] == [
        {"t": 1_000_000.0 - 4, "step": 10, "loss": 3.5, "val_loss": 3.7},
        {"t": 1_000_016.0, "step": 20, "loss": 3.1, "val_loss": None},
    ]
    assert snapshot["b"] == [{"t": 1_000_017.0, "step": 5, "loss": 2.0, "val_loss": None}]


def test_points_are_oldest_first_never_in_the_future_and_older_reports_are_ignored() -> None:
    clock = Clock()
    history = SwarmHistory(clock=clock)
    history.record([row("fast-clock", clock.now + 50, 1), row("a", clock.now - 5, 1)])
    clock.now += 15
    history.record([row("fast-clock", clock.now + 50, 2), row("a", clock.now - 40, 0)])
    fast, a = history.snapshot()["fast-clock"], history.snapshot()["a"]
    assert [p["t"] for p in fast] == [1_000_000.0, 1_000_015.0]  # clamped to our clock
    assert [p["step"] for p in a] == [1]  # a report older than the last one is not news


def test_a_row_without_a_report_time_is_taken_as_now_and_junk_rows_are_skipped() -> None:
    clock = Clock()
    history = SwarmHistory(clock=clock)
    rows = [
        {"peer_id": "self", "step": 3, "loss": math.nan, "val_loss": math.inf},
        {"peer_id": None, "step": 1},
        {"step": 1},
        {"peer_id": "odd", "step": "7", "loss": True, "updated_at": "yesterday"},
    ]
    assert history.record(rows) == 2
    snapshot = history.snapshot()
    assert snapshot["self"] == [{"t": clock.now, "step": 3, "loss": None, "val_loss": None}]
    assert snapshot["odd"] == [{"t": clock.now, "step": None, "loss": None, "val_loss": None}]


def test_a_full_series_thins_its_older_half_and_keeps_the_recent_one_whole() -> None:
    clock = Clock()
    history = SwarmHistory(max_points=8, clock=clock)
    for step in range(40):
        clock.now += 15
        history.record([row("a", clock.now, step)])
        assert len(history.snapshot()["a"]) <= 8
    steps = [p["step"] for p in history.snapshot()["a"]]
    assert steps[0] == 0  # the start of the run is still there
    assert steps[-1] == 39 and steps[-3:] == [37, 38, 39]  # the recent past at full resolution
    assert steps == sorted(steps)
    gaps = [b - a for a, b in itertools.pairwise(steps)]
    assert gaps == sorted(gaps, reverse=True)  # ever coarser towards the start


def test_points_age_out_and_a_peer_that_left_stays_until_its_last_point_does() -> None:
    clock = Clock()
    start = clock.now
    history = SwarmHistory(max_age_s=100, clock=clock)
    for step in range(3):  # both report at start, +30 and +60; then "left" leaves
        history.record([row("stays", clock.now, step), row("left", clock.now, step)])
        clock.now += 30
    history.record([row("stays", clock.now, 3)])
    assert [p["step"] for p in history.snapshot()["left"]] == [0, 1, 2]  # still shown
    clock.now = start + 130  # the points before start + 30 are gone
    snapshot = history.snapshot()
    assert [p["step"] for p in snapshot["stays"]] == [1, 2, 3]
    assert [p["step"] for p in snapshot["left"]] == [1, 2]
    clock.now = start + 161  # the last point of "left" (start + 60) is older than 100 s
    snapshot = history.snapshot()
    assert "left" not in snapshot and [p["step"] for p in snapshot["stays"]] == [3]
    assert history.record([row("late", clock.now - 101, 1)]) == 0  # too old to keep


def test_a_new_peer_beyond_max_peers_replaces_the_one_heard_from_longest_ago() -> None:
    clock = Clock()
    history = SwarmHistory(max_peers=3, clock=clock)
    history.record(
        [row("quiet", clock.now - 60, 1), row("a", clock.now, 1), row("b", clock.now, 1)]
    )
    clock.now += 15
    history.record([row("a", clock.now, 2), row("b", clock.now, 2), row("new", clock.now, 1)])
    assert sorted(history.snapshot()) == ["a", "b", "new"]
    assert len(history) == 3


def test_snapshots_are_copies_the_recorder_goes_on_without_changing() -> None:
    clock = Clock()
    history = SwarmHistory(clock=clock)
    history.record([row("a", clock.now, 1)])
    before = history.snapshot()
    clock.now += 15
    history.record([row("a", clock.now, 2)])
    assert [p["step"] for p in before["a"]] == [1]
    assert [p["step"] for p in history.snapshot()["a"]] == [1, 2]


@pytest.mark.parametrize(
    "bad", [{"max_peers": 0}, {"max_points": 3}, {"max_age_s": 0}], ids=["peers", "points", "age"]
)
def test_bounds_must_be_usable(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        SwarmHistory(**bad)  # type: ignore[arg-type]
