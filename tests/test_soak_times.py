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
