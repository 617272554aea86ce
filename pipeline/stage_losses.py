"""Which stages lost their state, as one peer saw it: for /status, never silent.

Sans-I/O. A stage's state lives only on its peers and in their checkpoints. A
peer that finds a stage with no live peer to download it from restarts it:
from its checkpoint at the version saved, or from the initial weights (version
0) when it holds none, and says so in its record (`StageRecord.restored`).
Whoever watches the stage records (every peer refreshes them) remembers the
newest version each stage reached, and so knows what a restart cost:

- `lost`: the stage had no live peer since `since` (UNIX time) when last seen at
  `version`; it stays set once a peer started the stage again from the initial
  weights (the swarm trains on from there: the steps are gone, loudly);
- `restored`: a peer brought it back from its checkpoint at `version` (at `at`);
  the steps from there to `lost_version` were lost (none when the two are equal;
  trainers replayed what they still kept of them: `pipeline.ledger`).

A peer knows only what it saw while it ran: one that joined after the loss
does not know what was lost.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .directory import StageRecord

__all__ = ["StageLosses"]


class StageLosses:
    def __init__(self, stages: int) -> None:
        self.known: list[int] = [0] * stages  # the newest version seen of each stage
        self.lost: list[dict[str, Any] | None] = [None] * stages
        self.restored: list[dict[str, Any] | None] = [None] * stages
        self._restarts: set[tuple[int, Any, float]] = set()  # (stage, peer, since) seen

    def observe(self, directory: Sequence[Sequence[StageRecord]], now: float) -> None:
        """The stage records as just read (`read_stages`: live ones only)."""
        for s, records in enumerate(directory):
            if not records:
                if self.known[s] > 0 and self.lost[s] is None:
                    self.lost[s] = {"version": self.known[s], "since": now}
                continue
            for r in records:
                if r.restored is None or (s, r.peer, r.since) in self._restarts:
                    continue
                self._restarts.add((s, r.peer, r.since))
                if self.known[s] > 0:  # (else the stage's first peer: nothing to lose)
                    self._restart(s, r.restored, now)
            newest = max(r.version for r in records)
            lost = self.lost[s]
            seeded = any(r.restored == 0 for r in records)
            if lost is not None and lost["version"] <= newest and not seeded:
                self.lost[s] = None  # (its records were only missing for a while)
            self.known[s] = max(self.known[s], newest)

    def _restart(self, s: int, version: int, now: float) -> None:
        before = self.lost[s]["version"] if self.lost[s] is not None else self.known[s]
        # (We may have read the stage's records last below the version restored: what
        # it lost is then unknown to us beyond that version, not negative.)
        before = max(before, version)
        since = self.lost[s]["since"] if self.lost[s] is not None else now
        if version == 0:  # from the initial weights: lost, and it stays said
            self.lost[s] = {"version": before, "since": since}
            self.known[s] = 0
            return
        self.lost[s] = None
        self.restored[s] = {"version": version, "lost_version": before, "at": now}
        self.known[s] = version

    def status(self, s: int) -> dict[str, Any]:
        """The keys `pipeline.stages[s]` gains on /status."""
        return {"lost": self.lost[s], "restored": self.restored[s]}
