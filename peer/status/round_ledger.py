"""The rounds a peer took part in: one JSON line each, in `<data dir>/rounds.jsonl`.

What a soak run (bench/soak.py), or a user auditing a swarm, checks across
peers: for every round, its ID, members, the peers whose input its result holds,
the fingerprint after it, the inner steps (after, through] this peer's input
covered, and the groups that aborted before it. Two rules follow from it: the
members of a round that committed agree on its fingerprint, and a peer's input
is in at most one committed round (a group that counted our input must not be
one we logged as aborted, and a process's committed inner-step ranges never
overlap).

A line is appended and flushed at once, so a `kill -9` loses at most the line
being written (a reader skips a torn last line). The file is bounded: at
`MAX_BYTES` it becomes `rounds.jsonl.1` (one older file is kept). A write that
fails (a full disk) is said once and training goes on.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import secrets
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shoal.averaging.outer import RoundReport

__all__ = ["LEDGER_FILE", "MAX_BYTES", "RoundLedger", "audit_rounds", "read_ledger"]

log = logging.getLogger("shoal.peer")

LEDGER_FILE = "rounds.jsonl"
MAX_BYTES = 4 * 1024 * 1024


class RoundLedger:
    """Appends this process's round reports to `path` (one process: one `session`)."""

    def __init__(self, path: Path, peer: str, *, max_bytes: int = MAX_BYTES) -> None:
        self.path = path
        self.peer = peer
        self.max_bytes = max_bytes
        # Inner-step counters restart with a process: ranges compare within a session.
        self.session = secrets.token_hex(8)
        self._failing: str | None = None

    def entry(self, report: RoundReport) -> dict[str, Any]:
        return {
            "t": round(time.time(), 3),
            "peer": self.peer,
            "session": self.session,
            "outcome": report.outcome.value,
            "outer_step": report.outer_step,
            "round": report.round_id,
            "members": list(report.members),
            "included": list(report.included),
            "fingerprint": report.fingerprint,
            "contribution": None if report.contribution is None else list(report.contribution),
            "aborted": list(report.aborted_rounds),
            "seconds": round(report.duration_s, 3),
            "attempts": list(report.attempts),
        }

    def record(self, report: RoundReport) -> None:
        line = json.dumps(self.entry(report), separators=(",", ":")) + "\n"
        try:
            self._rotate_if_full(len(line))
            with self.path.open("a", encoding="utf-8") as f:
                f.write(line)
        except OSError as e:
            if self._failing != str(e):
                log.warning("the round ledger %s is not written: %s", self.path, e)
                self._failing = str(e)
            return
        self._failing = None

    def _rotate_if_full(self, adding: int) -> None:
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return
        if size + adding > self.max_bytes:
            os.replace(self.path, self.path.with_name(self.path.name + ".1"))


def read_ledger(path: Path) -> list[dict[str, Any]]:
    """Every entry of a ledger and its older file, oldest first (a torn or foreign
    line is skipped: the file may be read while a peer writes or after a kill)."""
    entries = []
    for part in (path.with_name(path.name + ".1"), path):
        try:
            text = part.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            continue
        for line in text.splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if isinstance(entry, dict):
                entries.append(entry)
    return entries


def audit_rounds(entries: list[dict[str, Any]]) -> dict[str, int]:
    """Check the ledgers of many peers together: `commits` (distinct rounds committed),
    `fingerprint_mismatches` (committed rounds whose members disagree on the state
    after them) and `double_counted` (inputs counted in two committed rounds: by a
    round we logged as aborted, or by two rounds whose inner steps overlap)."""
    fingerprints: dict[str, set[Any]] = {}
    included: dict[str, set[str]] = {}
    ranges: dict[tuple[str, str], list[tuple[int, int]]] = {}
    for e in entries:
        rid = e.get("round")
        if e.get("outcome") != "committed" or not isinstance(rid, str):
            continue
        fingerprints.setdefault(rid, set()).add(e.get("fingerprint"))
        included.setdefault(rid, set()).update(str(p) for p in e.get("included") or ())
        span = e.get("contribution")
        if isinstance(span, list) and len(span) == 2 and span[0] < span[1]:
            key = (str(e.get("peer")), str(e.get("session")))
            ranges.setdefault(key, []).append((int(span[0]), int(span[1])))
    double = sum(
        1
        for e in entries
        for rid in e.get("aborted") or ()
        if e.get("peer") in included.get(rid, ())
    )
    for spans in ranges.values():
        spans.sort()
        double += sum(1 for a, b in itertools.pairwise(spans) if b[0] < a[1])
    return {
        "commits": len(fingerprints),
        "fingerprint_mismatches": sum(1 for fps in fingerprints.values() if len(fps) > 1),
        "double_counted": double,
    }
