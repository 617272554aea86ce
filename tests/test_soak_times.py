"""The soak's clock correction (bench/soak.py): a peer restarted with its clock set
back writes times that also fit an earlier lifetime of it; the round's other members
say which one is right, so a wrong clock does not make a gap between commits."""

from __future__ import annotations

import importlib.util
import types
from pathlib import Path

SOAK = Path(__file__).resolve().parents[1] / "bench" / "soak.py"
_spec = importlib.util.spec_from_file_location("soak_under_test", SOAK)
assert _spec is not None and _spec.loader is not None
soak = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(soak)


def committed(peer: str, rid: str, t: float) -> dict:
    return {"peer": peer, "round": rid, "t": t, "outcome": "committed", "members": ["a", "b"]}


def test_a_time_that_fits_two_lifetimes_takes_the_one_its_round_agrees_with() -> None:
    # Lived from 0 with the right clock, from 1000 with its clock 600 s back.
    late = types.SimpleNamespace(started_at=[(0.0, 0.0), (1000.0, -600.0)])
    right = types.SimpleNamespace(started_at=[(0.0, 0.0)])
    rounds = [(f"r{i}", 1000.0 + 20 * i) for i in range(6)]  # every 20 s
    mine = [committed("late", rid, t - 600) for rid, t in rounds]  # its clock's times
    theirs = [committed("right", rid, t) for rid, t in rounds]
    soak.real_times(late, mine)
    soak.real_times(right, theirs)
    assert all(len(e["real_t_candidates"]) == 2 for e in mine)  # 400 s fits both lives
    soak.settle_times(mine + theirs)
    assert [e["real_t"] for e in mine] == [t for _, t in rounds]
    _, gap = soak.commit_gaps(mine + theirs, end=1100.0)
    assert gap == 20.0  # the first lifetime's reading would have put a round at 400 s


def test_the_calm_gap_counts_only_time_with_at_most_one_partition_up() -> None:
    """Commits at 0, 100 and 130 s; from 20 to 70 s two partitions were up (a storm).
    The whole-run gap is 100 s; calm, the swarm went 20 s, then 30 s, then 30 s
    without a commit: the storm's 50 s are not held against it."""
    weather = [(0.0, 1, 1), (20.0, 2, 2), (70.0, 2, 1), (150.0, 0, 0)]
    times = [0.0, 100.0, 130.0]
    longest, share = soak.calm_gap(times, weather, end=160.0)
    assert longest == 30.0
    assert share == round(110 / 160, 2)
    entries = [committed("a", f"r{i}", t) | {"real_t": t} for i, t in enumerate(times)]
    assert soak.commit_gaps(entries, end=160.0) == (0.0, 100.0)


def test_a_calm_stretch_runs_on_across_weather_changes_until_a_commit() -> None:
    """Calm from 0 to 90 s with changes that stay calm (a peer down, a partition):
    one 90-s stretch, however the weather changed within it."""
    weather = [(0.0, 0, 0), (10.0, 1, 0), (40.0, 2, 1), (60.0, 0, 0)]
    assert soak.calm_gap([0.0, 90.0], weather, end=95.0) == (90.0, 1.0)
    assert soak.calm_gap([], weather, end=95.0) == (None, 0.0)
