"""The work a peer *declares* for its state's lineage: a hint in declarations, state
announcements and checkpoints, which no decision takes on its word any more.

A version of a shared state (`certificate.chained_version`) is a commit count and a
hash chain of the rounds that made it. Which of two versions that went their own
ways wins (a joiner's choice of holder, the direction of a re-sync) is decided by
the work their commit certificates show (`provenance`): a peer that declared a
huge work for a state of its own choosing once took the whole swarm over. What is
declared is kept on the wire for older peers and parsed here with bounds; its
least value, for a lineage of n commits, is n.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["MAX_WORK", "commits_of", "declared_work", "lineage_work"]

MAX_WORK = 2**62


def commits_of(version: bytes) -> int:
    """The commit count a version starts with (0 for the empty version)."""
    return int.from_bytes(version[:8], "big") if len(version) >= 8 else 0


def declared_work(obj: object) -> int | None:
    """A work value from untrusted input; None when absent or malformed."""
    if isinstance(obj, bool) or not isinstance(obj, int) or not 0 <= obj <= MAX_WORK:
        return None
    return obj


def lineage_work(version: bytes, declared: Iterable[int | None]) -> int:
    """The work of the lineage that made `version`, from what its holders declare:
    the least of them (one holder cannot raise a version above what the others
    say), and never below the version's commit count (each commit has a member at
    least; that is also the work of a holder that says none)."""
    known = [w for w in declared if w is not None]
    return max(min(known, default=0), commits_of(version))
