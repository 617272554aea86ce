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


def test_the_longest_gaps_are_taken_apart_with_their_weather_and_rounds() -> None:
    """Commits of two peers at 0, 10 and 50 s; a lone round and an abort in between.
    The longest gap (10 to 50 s) comes first, with the storm that was in it and every
    round a peer ended in it, with its tries."""
    entries = [committed("A", f"r{t}", float(t)) for t in (0, 10, 50)]
    entries.append({"peer": "B", "round": "x", "t": 30.0, "outcome": "committed",
                    "members": ["b"], "seconds": 12.5,
                    "attempts": [{"matchmaking_s": 7.0, "averaging_s": 5.5, "group_size": 3,
                                  "outcome": "member #2 stalled",
                                  "excluded": ["12D3KooWQmKFq9nzSsf7q2"]}]})  # fmt: skip
    for e in entries:
        e["real_t"] = e["t"]
    weather = [(0.0, 0, 0), (20.0, 2, 2), (40.0, 0, 1)]
    first, second, last = soak.longest_gaps(entries, weather, end=55.0)
    assert (first["s"], first["max_down"], first["max_partitions"]) == (40.0, 2, 2)
    lone, ending = first["rounds"]
    assert lone["t"] == 20.0 and lone["size"] == 1
    assert lone["tries"] == [[7.0, 5.5, 3, "member #2 stalled", ["nzSsf7q2"]]]
    assert ending["t"] == 40.0 and ending["size"] == 2  # the commit that ended it
    assert (second["s"], second["max_partitions"]) == (10.0, 0)
    assert last["s"] == 5.0  # from the last commit to the end
