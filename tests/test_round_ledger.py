"""The round ledger: one line per round in the data directory, and the audit that
checks many peers' ledgers together (what bench/soak.py counts)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from shoal.averaging.outer import RoundOutcome, RoundReport
from shoal.peer.status.round_ledger import RoundLedger, audit_rounds, read_ledger


def report(
    outcome: RoundOutcome = RoundOutcome.COMMITTED, *, round_id: str | None = "aa",
    included: tuple[str, ...] = ("A", "B"), fingerprint: str | None = "f1",
    contribution: tuple[int, int] | None = (0, 10), aborted: tuple[str, ...] = (),
) -> RoundReport:  # fmt: skip
    return RoundReport(
        outer_step=1, outcome=outcome, detail="", group_size=len(included), duration_s=0.5,
        fingerprint=fingerprint, bytes_sent=0, round_id=round_id, members=included,
        included=included, contribution=contribution, aborted_rounds=aborted,
        attempts=({"matchmaking_s": 0.1, "averaging_s": 0.4, "group_size": 2,
                   "outcome": "committed"},),
    )  # fmt: skip


def entry(peer: str, rid: str, **kw: Any) -> dict[str, Any]:
    e = {"peer": peer, "session": "s-" + peer, "outcome": "committed", "round": rid,
         "included": ["A", "B"], "fingerprint": "f-" + rid, "contribution": None,
         "aborted": []}  # fmt: skip
    e.update(kw)
    return e


def test_each_round_is_one_json_line_with_its_ledger(tmp_path: Path) -> None:
    ledger = RoundLedger(tmp_path / "rounds.jsonl", "A")
    ledger.record(report(aborted=("bb",)))
    (line,) = (tmp_path / "rounds.jsonl").read_text().splitlines()
    e = json.loads(line)
    assert e["peer"] == "A" and e["session"] == ledger.session
    assert e["round"] == "aa" and e["included"] == ["A", "B"] and e["aborted"] == ["bb"]
    assert e["outcome"] == "committed" and e["contribution"] == [0, 10]
    assert e["seconds"] == 0.5 and e["attempts"][0]["averaging_s"] == 0.4  # where time went


def test_the_ledger_stays_bounded_and_a_torn_line_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "rounds.jsonl"
    ledger = RoundLedger(path, "A", max_bytes=1000)
    for i in range(20):
        ledger.record(report(round_id=f"{i:02x}"))
    with path.open("a") as f:
        f.write('{"peer": "A", "rou')  # killed mid-line
    assert path.stat().st_size <= 1000 + 20
    rounds = [e["round"] for e in read_ledger(path)]
    assert rounds == sorted(rounds) and rounds[-1] == "13"  # oldest first, none torn
    assert len(rounds) < 20  # the file before the older one is gone


def test_a_ledger_that_cannot_be_written_is_said_once_and_does_not_raise(
    tmp_path: Path, caplog: Any
) -> None:
    (tmp_path / "file").write_text("")
    ledger = RoundLedger(tmp_path / "file" / "rounds.jsonl", "A")  # a directory under a file
    for _ in range(3):
        ledger.record(report())
    assert sum("round ledger" in r.message for r in caplog.records) == 1


def test_a_clean_swarm_audits_clean() -> None:
    entries = [entry("A", "r1"), entry("B", "r1"), entry("A", "r2"), entry("B", "r2")]
    assert audit_rounds(entries) == {
        "commits": 2, "fingerprint_mismatches": 0, "double_counted": 0,
    }  # fmt: skip


def test_members_that_disagree_on_a_rounds_fingerprint_are_a_mismatch() -> None:
    entries = [entry("A", "r1"), entry("B", "r1", fingerprint="other")]
    assert audit_rounds(entries)["fingerprint_mismatches"] == 1


def test_input_counted_by_a_round_its_owner_logged_as_aborted_is_double_counted() -> None:
    # B's input is in r1's result at A, but B saw r1 abort: B offers it again in r2.
    entries = [
        entry("A", "r1"),
        entry("B", "r2", aborted=["r1"]),
        entry("A", "r2"),
    ]
    assert audit_rounds(entries)["double_counted"] == 1
    # An aborted round that did not include B's input is no double count.
    entries[0]["included"] = ["A"]
    assert audit_rounds(entries)["double_counted"] == 0


def test_overlapping_inner_steps_of_one_process_in_two_commits_are_double_counted() -> None:
    entries = [
        entry("A", "r1", contribution=[0, 10]),
        entry("A", "r2", contribution=[5, 20]),
        entry("A", "r3", contribution=[20, 30]),
        # a restarted process counts its steps anew: no overlap across sessions
        entry("A", "r4", contribution=[0, 10], session="other"),
    ]
    assert audit_rounds(entries)["double_counted"] == 1
