"""The work of a state's lineage: how two versions of one shared state that went their
own ways order, when nothing else tells them apart.

A version of a shared state (`averager._chained_version`) is a commit count and a
hash chain of the rounds that made it. Two versions with as many holders used to
order by commit count. But a peer cut off from the swarm steps alone: a commit at
each outer step, with one member, while the swarm commits once a round, with a whole
group. So when the lone peer came back, its version won, and the swarm re-synced
onto it, dropping the rounds it had averaged meanwhile (in a 60-minute soak, 66 of
585 state loads were such re-syncs, onto the state of a peer that had stepped alone).

The work of a lineage is the members summed over the commits that made it: a commit
alone adds 1, a round of six 6. Peers carry it with their state (in checkpoints, in
the state they serve and announce, in their matchmaking declarations), outside the
state's fingerprint: members of a round compare fingerprints, and a peer that
restored a checkpoint of an older release cannot know its lineage's work. The least
a lineage of n commits holds is n, which is what such a peer says.
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
