"""From an audit to an outcome (sans-I/O): the auditor's verdict, a dispute
among three referees when it accuses, strikes for accusers the majority
overrules, and who is on probation.

A `Dispute` takes verdicts in and says what it still needs (`waiting_for`) and
how it ended (`outcome`): the auditor (the first referee) passes the prover, or
accuses it, and then the next two referees are asked as well; a majority
decides. No majority either way (a tie, or a round of two) leaves it
unresolved: nobody is convicted on one peer's word, nor struck for a tie. A
conviction yields `Evidence` that any peer checks offline. An acquittal gives
each accuser a strike in the `Ledger`; an auditor with `MAX_STRIKES` strikes
loses its refereeing (its accusations start no dispute) and is audited at the
probation rate from then on. New identities are on probation until they pass
`PROBATION_PASSES` audits.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Mapping, Sequence

from shoal.transport.identity import PeerID

from .commitment import Commitment
from .evidence import REFEREES, Evidence, EvidenceError, Verdict, convicting
from .referees import RoundDraw

__all__ = ["MAX_STRIKES", "PROBATION_PASSES", "Dispute", "Ledger", "Outcome"]

MAX_STRIKES = 3
PROBATION_PASSES = 5


class Outcome(enum.StrEnum):
    OPEN = "open"
    PASSED = "passed"  # the auditor found nothing
    CONVICTED = "convicted"
    ACQUITTED = "acquitted"  # the auditor accused; the majority did not
    IGNORED = "ignored"  # accused by an auditor who lost its refereeing
    UNRESOLVED = "unresolved"  # no majority either way (a tie, or a round too small)


class Dispute:
    """One audited commitment, from the auditor's verdict to an outcome."""

    def __init__(
        self,
        commitment: Commitment,
        draw: RoundDraw,
        *,
        may_referee: frozenset[PeerID] | None = None,
    ) -> None:
        """`may_referee`: if given, an auditor outside it starts no dispute."""
        self.commitment = commitment
        self.digest = commitment.digest()
        self.draw = draw
        self.referees = draw.referees(commitment.prover, REFEREES)
        self.segment = draw.segment(commitment.prover, commitment.segments)
        self.verdicts: dict[PeerID, Verdict] = {}
        self.outcome = Outcome.OPEN
        self._may_referee = may_referee

    @property
    def auditor(self) -> PeerID | None:
        return self.referees[0] if self.referees else None

    def waiting_for(self) -> tuple[PeerID, ...]:
        """The referees whose verdict is needed next (none once decided)."""
        if self.outcome is not Outcome.OPEN:
            return ()
        if self.auditor is not None and self.auditor not in self.verdicts:
            return (self.auditor,)
        return tuple(r for r in self.referees if r not in self.verdicts)

    def add(self, verdict: Verdict) -> Outcome:
        """Take one referee's verdict; EvidenceError when it is not one (wrong
        signer, commitment or segment, or a bad signature)."""
        if verdict.verifier not in self.referees:
            raise EvidenceError(f"{verdict.verifier.short()} is not a referee here")
        if verdict.commitment != self.digest or verdict.segment != self.segment:
            raise EvidenceError("the verdict is about another commitment or segment")
        if not verdict.verifies():
            raise EvidenceError("the verdict's signature does not verify")
        if self.outcome is not Outcome.OPEN or verdict.verifier in self.verdicts:
            return self.outcome
        if verdict.verifier != self.auditor and self.auditor not in self.verdicts:
            raise EvidenceError("the auditor speaks first")
        self.verdicts[verdict.verifier] = verdict
        self.outcome = self._decide()
        return self.outcome

    def _decide(self) -> Outcome:
        first = self.verdicts[self.referees[0]]
        if not first.accuses:
            return Outcome.PASSED
        if self._may_referee is not None and first.verifier not in self._may_referee:
            return Outcome.IGNORED
        verdicts = list(self.verdicts.values())
        n = len(self.referees)
        if convicting(verdicts, n):
            return Outcome.CONVICTED
        clearing = sum(1 for v in verdicts if not v.accuses)
        if 2 * clearing > n:
            return Outcome.ACQUITTED
        if len(verdicts) == n:
            return Outcome.UNRESOLVED  # a tie, or too few referees to convict anyone
        return Outcome.OPEN

    def overruled(self) -> list[PeerID]:
        """Accusers the majority overruled (after an acquittal)."""
        if self.outcome is not Outcome.ACQUITTED:
            return []
        return [v.verifier for v in self.verdicts.values() if v.accuses]

    def evidence(
        self, round_commitments: Sequence[Commitment], secrets: Mapping[PeerID, bytes]
    ) -> Evidence:
        """The bundle that convicts (after `CONVICTED`); checked before it is returned."""
        if self.outcome is not Outcome.CONVICTED:
            raise EvidenceError(f"no conviction ({self.outcome})")
        bundle = Evidence(
            self.commitment,
            tuple(round_commitments),
            tuple(sorted(secrets.items(), key=lambda kv: kv[0].to_bytes())),
            tuple(self.verdicts[r] for r in self.referees if r in self.verdicts),
        )
        bundle.check()
        return bundle


class Ledger:
    """What one peer knows of others' audit records: passes (probation ends after
    `probation_passes`) and strikes (refereeing ends at `max_strikes`)."""

    def __init__(
        self, *, probation_passes: int = PROBATION_PASSES, max_strikes: int = MAX_STRIKES
    ) -> None:
        self.probation_passes = probation_passes
        self.max_strikes = max_strikes
        self.passes: Counter[PeerID] = Counter()
        self.strikes: Counter[PeerID] = Counter()
        self.audits: Counter[str] = Counter()  # outcome -> count, for /status

    def record(self, dispute: Dispute) -> None:
        """Count a decided dispute."""
        outcome = dispute.outcome
        if outcome is Outcome.OPEN:
            return
        self.audits[str(outcome)] += 1
        if outcome in (Outcome.PASSED, Outcome.ACQUITTED):
            self.passes[dispute.commitment.prover] += 1
        for accuser in dispute.overruled():
            self.strikes[accuser] += 1

    def on_probation(self, peer: PeerID) -> bool:
        return self.passes[peer] < self.probation_passes or self.strikes[peer] >= self.max_strikes

    def may_referee(self, peer: PeerID) -> bool:
        return self.strikes[peer] < self.max_strikes

    def audit_rate(self, peer: PeerID, rate: float, probation_rate: float) -> float:
        return max(rate, probation_rate) if self.on_probation(peer) else rate
