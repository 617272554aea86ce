"""What an averaging step returns (`StepResult`) and the log of its tries (`AttemptLog`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from shoal.transport.identity import PeerID


@dataclass(frozen=True, slots=True)
class JoinTry:
    """One join a try's matchmaking sent: to whom (short ID), its answer (a reply's
    kind, or "late", "unreached", "failed: <error>"), and how long it took."""

    leader: str
    answer: str
    seconds: float


@dataclass(frozen=True, slots=True)
class Attempt:
    """One try of a step: how long its matchmaking took, then its averaging (the
    all-reduce, or the re-sync or lone commit matchmaking led to), the group's size
    (0: none formed), how it ended, and the peers it left out (those named failed
    or found quiet in the step's earlier tries, and those we shun). A step's tries
    say where its time went; their joins, group and left-outs say why it went
    there (`sim/run.py --trace-matchmaking` writes them for every peer)."""

    matchmaking_s: float
    averaging_s: float
    group_size: int
    outcome: str
    excluded: tuple[str, ...] = ()
    joins: tuple[JoinTry, ...] = ()  # the last `MAX_JOINS_KEPT` of its matchmaking
    round_id: str = ""  # the group's (hex), "" when none formed
    leader: str = ""  # (short ID) who assembled the group
    left_out: tuple[str, ...] = ()  # after an abort: whom the next try leaves out


@dataclass(frozen=True)
class StepResult:
    committed: bool
    reason: str = ""
    group_size: int = 0
    round_id: bytes | None = None
    members: tuple[PeerID, ...] = ()
    attempts: int = 0
    # After a commit: the state fingerprint every member of the group shares.
    fingerprint: str | None = None
    resynced: bool = False
    seconds: float = 0.0
    bytes_sent: int = 0
    # The peer that assembled the group (any member may; it is not special).
    leader: PeerID | None = None
    # The weight each member contributed with (empty when unknown: we own no part).
    weights: dict[PeerID, float] = field(default_factory=dict)
    # Groups this step formed whose round aborted (our input counted in none of them).
    aborted_rounds: tuple[bytes, ...] = ()
    # Our input may be counted in a round we could not learn the outcome of (we were in
    # doubt): the caller must drop it, as after a re-sync, though the tensors are ours.
    discarded: bool = False
    attempt_log: tuple[Attempt, ...] = ()


class AttemptLog:
    """The current step's tries (`Attempt`) and the groups it formed whose round aborted."""

    def __init__(self) -> None:
        self.attempts: list[Attempt] = []
        self.aborted: list[bytes] = []
        self._attempt_at = 0.0  # when the current try's matchmaking ended

    def clear(self) -> None:
        self.attempts = []
        self.aborted = []

    def matched(
        self,
        looking: float,
        group_size: int,
        outcome: str,
        excluded: tuple[str, ...],
        *,
        joins: tuple[JoinTry, ...] = (),
        round_id: str = "",
        leader: str = "",
    ) -> None:
        """A try's matchmaking ended (at once after `looking`); `ended` says how what
        followed ended."""
        now = time.monotonic()
        self.attempts.append(
            Attempt(now - looking, 0.0, group_size, outcome, excluded, joins, round_id, leader)
        )
        self._attempt_at = now

    def ended(self, outcome: str, left_out: tuple[str, ...] = ()) -> None:
        if self.attempts:
            last = self.attempts[-1]
            spent = time.monotonic() - self._attempt_at
            self.attempts[-1] = replace(
                last, averaging_s=spent, outcome=outcome[:120], left_out=left_out
            )

    def result(
        self, committed: bool, reason: str, started: float, attempts: int, *, resynced: bool = False
    ) -> StepResult:
        """A step's result that committed nothing of a group (see `StepRunner`)."""
        return StepResult(
            committed, reason, attempts=attempts, resynced=resynced,
            seconds=time.monotonic() - started, aborted_rounds=tuple(self.aborted),
            attempt_log=tuple(self.attempts),
        )  # fmt: skip
