"""The votes of a round's members as one member knows them (sans-IO).

The vote half of the commit protocol (`commit.py`): who voted READY, who vetoed
and whom each veto blames, and whether (since when, why) a veto is known, which
rules COMMIT out at every ballot. From them and the suspects: the `failed` list
and the reason of an ABORT; and, for the retry that follows an ABORT, whom a
veto's blame may leave out (`blame`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from .ballots import Decision

__all__ = ["NO_VOTE", "READY", "VETO", "Blame", "Votes"]

NO_VOTE, READY, VETO = 0, 1, 2
LOCAL = -1  # ballot of a conclusion reached alone (a give-up): never relayed


@dataclass(frozen=True, slots=True)
class Blame:
    """Whom a retry leaves out, as one member judges the blame of an aborted round.

    A veto's blame is its vetoer's word. A cheater cut off by the honest member that
    had just blocked it vetoed blaming that member, and every member then retried
    without it: a liar could keep one honest member out of each retry of a step.
    So: a member we suspect or stopped hearing from ourselves is left out (`certain`);
    so is one blamed by two vetoers or more (a lone liar cannot make two), and a
    vetoer that blames us (we know what we did). A member blamed by one vetoer alone,
    or named only in the decision (its decider's word), is `contested`: the driver
    asks it itself (a ping). One that does not answer is left out; one that answers
    is left out with its blamer, since one of the two is lying or their link is
    broken and we cannot tell which: a liar's blame then costs the liar its place too.
    """

    certain: frozenset[int] = frozenset()
    # blamed member -> the one vetoer we heard blame it (empty: the decision's word)
    contested: Mapping[int, frozenset[int]] = field(default_factory=dict)


class Votes:
    """READY votes and vetoes heard (ours included once we veto)."""

    def __init__(self) -> None:
        self.ready_from: set[int] = set()  # other members known to have voted READY
        self.vetoes: dict[int, tuple[str, tuple[int, ...]]] = {}
        self.abort_known = False  # a veto exists: every decision can only be ABORT
        self.abort_known_at = math.inf
        self.abort_reason = ""
        self.results: dict[int, bytes] = {}  # member -> its READY's digests of the parts

    def know_abort(self, reason: str, now: float) -> None:
        if not self.abort_known:
            self.abort_known = True
            self.abort_reason = reason
            self.abort_known_at = now

    def heard(
        self, src: int, vote: int, reason: str, suspects: tuple[int, ...], abort_known: bool,
        now: float, results: bytes = b"",
    ) -> None:  # fmt: skip
        """What member `src`'s status says of its vote and of the vetoes it knows."""
        if vote == READY:
            self.ready_from.add(src)
            if results:
                self.results.setdefault(src, results)  # (a vote is final)
        elif vote == VETO and src not in self.vetoes:
            self.vetoes[src] = (reason, suspects)
            self.know_abort(reason, now)
        if abort_known:
            self.know_abort(reason, now)

    def ballot_0(
        self, vote: int, n: int, suspected: Mapping[int, str], names: Sequence[str],
        ours: bytes = b"",
    ) -> tuple[Decision, bool] | None:  # fmt: skip
        """Member 0's choice at ballot 0, the only one that may originate COMMIT: the
        decision and whether it must be accepted first (a COMMIT), or None: not yet.
        `ours`: our READY's result digests."""
        failed = self.failed(suspected)
        if self.abort_known:
            return Decision(0, False, self.reason(suspected, names), failed), False
        if vote == READY and len(self.ready_from) == n - 1:
            split = self.split_parts(n, ours)
            if split:
                # They would commit different bits: the part's owner sent members
                # different results, or a member lies about what it received. Which,
                # nobody can tell: the round aborts naming nobody (a liar could veto
                # anyway), and no member commits bits the others do not hold.
                owners = ", ".join(names[j] for j in split)
                why = f"members received different results of the parts of {owners}"
                return Decision(0, False, why, failed), False
            return Decision(0, True, "", failed), True
        if any(j not in self.ready_from for j in suspected):
            return Decision(0, False, self.reason(suspected, names), failed), False
        return None

    def given_up(
        self, failed: frozenset[int], suspected: Mapping[int, str], names: Sequence[str],
        after: float,
    ) -> Decision:  # fmt: skip
        """Our conclusion alone when no decision came in time (`after` seconds without
        progress): ABORT once a veto is known, else in doubt."""
        if self.abort_known:
            return Decision(LOCAL, False, self.reason(suspected, names), failed)
        why = f"in doubt: voted READY but learned no decision within {after:.0f}s"
        return Decision(LOCAL, False, why, failed, in_doubt=True)

    def split_parts(self, n: int, ours: bytes) -> list[int]:
        """The parts whose result came to two READY members differently (their digests
        differ; members that said none, 2.4 peers, are not compared)."""
        said = [d for d in (*self.results.values(), ours) if d]
        if len(said) < 2:
            return []
        size = len(said[0]) // n
        return [j for j in range(n) if len({d[j * size : (j + 1) * size] for d in said}) > 1]

    def failed(self, suspected: Mapping[int, str]) -> frozenset[int]:
        """The members suspected or blamed by a veto."""
        failed = set(suspected)
        for _, blamed in self.vetoes.values():
            failed.update(blamed)
        return frozenset(failed)

    def blame(self, me: int, ours: Iterable[int], decided_failed: Iterable[int] = ()) -> Blame:
        """Whom the retry after an ABORT leaves out (`Blame`), given the members we
        suspect or stopped hearing from (`ours`) and the decision's failed set (which
        may carry blame from vetoes that never reached us)."""
        certain = set(ours) - {me}
        blamers: dict[int, set[int]] = {}
        for vetoer, (_, blamed) in self.vetoes.items():
            if vetoer == me:
                continue  # (what we blame, we suspect: in `ours`)
            for j in blamed:
                if j == me:
                    certain.add(vetoer)
                else:
                    blamers.setdefault(j, set()).add(vetoer)
        certain.update(j for j, by in blamers.items() if len(by) >= 2)
        for j in decided_failed:
            blamers.setdefault(j, set())
        contested = {j: frozenset(by) for j, by in blamers.items() if j not in certain and j != me}
        return Blame(frozenset(certain), contested)

    def reason(self, suspected: Mapping[int, str], names: Sequence[str]) -> str:
        """Why the round aborts."""
        if self.vetoes:
            # A veto that blames someone names the cause; the others are its echoes
            # ("member X stopped the transfer").
            blaming = [j for j, (_, blamed) in self.vetoes.items() if blamed]
            return self.vetoes[min(blaming or self.vetoes)][0]
        if suspected:
            j = min(suspected)
            return f"member {names[j]} {suspected[j]}"
        return self.abort_reason or "aborted"
