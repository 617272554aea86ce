"""Ballots of one round's decision: promises, proposals and takeovers (sans-IO).

The Paxos half of the commit protocol (`commit.py` says why it is safe): which
ballot this member promised, which proposal it accepted, the proposal it waits
to see accepted, and the takeover it leads. It sends nothing and knows nothing
of votes or liveness: `CommitProtocol` feeds it what members report and asks it
what may be decided.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["MAX_BALLOT", "Ballots", "Decision", "quorums"]

MAX_BALLOT = (1 << 31) - 1


def quorums(n: int) -> tuple[int, int]:
    """(prepare, accept): how many of `n` members (the leader or proposer included) a
    takeover must hear promise its ballot, and how many must accept a proposal before
    it is decided. Any two such sets share a member (prepare + accept > n), so a
    takeover always hears of a value decided before it, whatever the failure detector
    believed: two sides of a partition that each suspect the other can no longer both
    decide (Flexible Paxos, Howard et al. 2016). A strict majority to take over, the
    rest to decide: member 0 with half the group decides COMMIT, a takeover needs
    more than half."""
    prepare = n // 2 + 1
    return prepare, n + 1 - prepare


@dataclass(frozen=True, slots=True)
class Decision:
    ballot: int
    commit: bool
    reason: str  # "" for a commit
    failed: frozenset[int]  # members the decider believed dead or faulty
    in_doubt: bool = False  # a give-up after voting READY: others may have committed


@dataclass(slots=True)
class _Takeover:
    ballot: int
    waiting: set[int]
    # Per member that promised: the decision it reported, and the proposal it accepted.
    answers: dict[int, tuple[Decision | None, Decision | None]] = field(default_factory=dict)


@dataclass(slots=True)
class _Proposal:
    decision: Decision
    waiting: set[int]  # members yet to accept it
    accepted_by: set[int]  # members known to have accepted it (its proposer first)


class Ballots:
    """One member's promises and proposals among `n` members; ballot b is member b % n's."""

    def __init__(self, n: int, me: int, now: float, promised: int = 0) -> None:
        self.n = n
        self.me = me
        self.promised = promised
        self.promised_at = now
        self.max_ballot = promised  # the highest ballot seen anywhere
        self.accepted: Decision | None = None  # phase 2: accepted, not decided (yet)
        self.proposal: _Proposal | None = None  # ours, waiting to be accepted
        self.takeover: _Takeover | None = None  # ours, waiting for promises

    def deferring(self, suspected: set[int] | dict[int, str]) -> bool:
        """Another member's ballot runs and its owner is not suspected: let it work."""
        owner = self.promised % self.n
        return self.promised > 0 and owner != self.me and owner not in suspected

    def promise(self, ballot: int, now: float) -> bool:
        """A PREPARE(ballot) came: promise it if it is the highest. True if we did."""
        self.max_ballot = max(self.max_ballot, ballot)
        if ballot <= self.promised:
            return False
        self.promised = ballot
        self.promised_at = now
        self._stand_back(ballot)
        return True

    def _stand_back(self, ballot: int) -> None:
        """A higher ballot runs: ours, led or proposed, is over (what we accepted goes
        to that ballot's leader with our answers)."""
        if self.takeover is not None and self.takeover.ballot < ballot:
            self.takeover = None
        if self.proposal is not None and self.proposal.decision.ballot < ballot:
            self.proposal = None

    def accept(self, src: int, d: Decision, now: float) -> bool:
        """Phase 2: the owner of ballot d.ballot proposes d. Accepting it promises that
        ballot (a proposal is final for its ballot: no other value is asked for it).
        True if we accepted it now."""
        if src != d.ballot % self.n or d.ballot < self.promised:
            return False
        if self.accepted is not None and d.ballot <= self.accepted.ballot:
            return False
        self.accepted = d
        self.max_ballot = max(self.max_ballot, d.ballot)
        if d.ballot > self.promised:
            self.promised = d.ballot
            self.promised_at = now
            self._stand_back(d.ballot)
        return True

    def heard(
        self, src: int, promised: int, decision: Decision | None, accepted: Decision | None
    ) -> None:
        """What member `src` reported: its promise, decision and accepted proposal."""
        self.max_ballot = max(self.max_ballot, promised)
        t = self.takeover
        if t is not None and src in t.waiting:
            if promised == t.ballot:
                t.waiting.discard(src)
                t.answers[src] = (decision, accepted)
            elif promised > t.ballot:
                self.takeover = None
        p = self.proposal
        if p is not None and src in p.waiting:
            mine = p.decision
            if (accepted is not None and accepted.ballot == mine.ballot) or (
                decision is not None and decision.commit == mine.commit
            ):
                p.waiting.discard(src)
                p.accepted_by.add(src)
            # (One that promised a higher ballot will not accept: its leader asks us.)

    def not_started(self, src: int, kind: str) -> bool:
        """`src` answered our PREPARE or proposal without knowing the round: it recorded
        our promise for when it starts, and has voted and decided nothing. True if that
        was an answer we waited for."""
        t, p = self.takeover, self.proposal
        if kind == "prepare" and t is not None and src in t.waiting:
            t.waiting.discard(src)
            t.answers[src] = (None, None)
            return True
        # It never voted, so the proposal can only be an ABORT to count it for.
        if kind == "accept" and p is not None and src in p.waiting and not p.decision.commit:
            p.waiting.discard(src)
            p.accepted_by.add(src)  # (its promise holds: it can never vote READY here)
            return True
        return False

    def give_up_on(self, peer: int) -> None:
        """`peer` is suspected: wait for it no longer."""
        if self.takeover is not None:
            self.takeover.waiting.discard(peer)
        if self.proposal is not None:
            self.proposal.waiting.discard(peer)

    def propose(self, d: Decision, waiting: set[int]) -> None:
        """Our proposal `d` (we accept it first), to be accepted by `waiting`."""
        self.accepted = d
        self.proposal = _Proposal(d, waiting, {self.me})

    def chosen(self) -> tuple[Decision, int] | None:
        """Our proposal, once every member we waited for accepted it or is suspected,
        and how many members (us included) accepted it."""
        p = self.proposal
        return (p.decision, len(p.accepted_by)) if p is not None and not p.waiting else None

    def known_acceptors(self) -> int:
        """How many members we know accepted the proposal we accepted: us, and its
        proposer (which accepts its own first)."""
        a = self.accepted
        return 0 if a is None else len({self.me, a.ballot % self.n})

    def promises(self) -> int:
        """How many members (us included) promised our takeover's ballot so far."""
        return 0 if self.takeover is None else 1 + len(self.takeover.answers)

    def lead(self, waiting: set[int], now: float) -> int | None:
        """Start a takeover: a ballot of ours above all seen, promised to ourselves.
        None when ballots ran out."""
        ballot = self.max_ballot + 1
        ballot += (self.me - ballot) % self.n
        if ballot > MAX_BALLOT:
            return None
        self.promised = self.max_ballot = ballot
        self.promised_at = now
        self.takeover = _Takeover(ballot, waiting)
        return ballot

    def takeover_value(self) -> tuple[Decision | None, bool] | None:
        """Once every member answered our takeover: the value of the highest ballot among
        their answers and what we accepted (None: there is none), and whether it was
        decided already (else it was only accepted). None while answers are missing."""
        t = self.takeover
        if t is None or t.waiting:
            return None
        decided = [d for d, _ in t.answers.values() if d is not None]
        accepted = [a for _, a in t.answers.values() if a is not None]
        if self.accepted is not None:
            accepted.append(self.accepted)
        best = max(decided + accepted, key=lambda d: d.ballot, default=None)
        return best, best is not None and best in decided

    def takeover_decision(
        self, reason: str, failed: frozenset[int]
    ) -> tuple[Decision, bool] | None:
        """Once every member answered our takeover: the decision at its ballot (the
        value `takeover_value` found, else ABORT for `reason`; `failed` added to its
        list) and whether it was decided already. None while answers are missing."""
        found, t = self.takeover_value(), self.takeover
        if found is None or t is None:
            return None
        best, decided = found
        if best is None:
            return Decision(t.ballot, False, reason, failed), False
        return Decision(t.ballot, best.commit, best.reason, best.failed | failed), decided

    def clear(self) -> None:
        self.takeover = self.proposal = None
