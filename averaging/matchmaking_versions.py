"""Which state versions count in a matchmaker's rounds, and when ours is behind (re-sync).

`Versions` keeps the versions left out for a while (set aside: no reachable peer served
them; superseded: we left them by a commit), has the lineages of the versions peers
look with checked (a shared state's certificates), and raises `NeedsResync` when the
declarations that outvote our version are confirmed by their owners.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol

from .declarer import Declarer
from .group import Member
from .matchmaking_join import Prober
from .matchmaking_round import MatchmakingError, Mode, Round
from .matchmaking_rules import CHAINED_VERSION_BYTES, JoinReply, PeerState, ReplyKind

__all__ = ["MAX_PROBES", "Lineages", "NeedsResync", "Versions"]

MAX_PROBES = 32


class Lineages(Protocol):
    """The certified order of versions (`provenance_sync.LineageChecker`)."""

    def order(self, version: bytes) -> tuple[int, int]: ...

    def want(self, version: bytes, holders: Sequence[Member]) -> None: ...


class NeedsResync(MatchmakingError):
    """Our state version is behind the swarm's: load the state from peers first.

    `target`: the version most looking peers hold; `holders`: those peers;
    `versions`: how many looking peers hold each version (us included).
    """

    def __init__(
        self,
        message: str,
        *,
        version: bytes,
        target: bytes,
        versions: dict[bytes, int],
        holders: tuple[Member, ...],
    ) -> None:
        super().__init__(message)
        self.version = version
        self.target = target
        self.versions = versions
        self.holders = holders


class Versions:
    """A matchmaker's view of the versions around: left out for a while, or ahead of ours."""

    def __init__(self, prober: Prober, declarer: Declarer) -> None:
        self._prober = prober
        self._declarer = declarer
        # The certified ranks of shared states' versions (set by a shared state's
        # averager): what decides which side of two lineages re-syncs.
        self.lineages: Lineages | None = None
        self._set_aside: dict[bytes, float] = {}  # version -> until (monotonic)
        self._superseded: dict[bytes, float] = {}  # version -> until (monotonic)

    def set_aside(self, version: bytes, seconds: float) -> None:
        """See `Matchmaker.set_aside_version`."""
        now = time.monotonic()
        self._set_aside = {v: t for v, t in self._set_aside.items() if t > now}
        self._set_aside[version] = max(self._set_aside.get(version, now), now + seconds)

    def supersede(self, version: bytes, seconds: float) -> None:
        """See `Matchmaker.supersede`."""
        now = time.monotonic()
        self._superseded = {v: t for v, t in self._superseded.items() if t > now}
        self._superseded[version] = max(self._superseded.get(version, now), now + seconds)

    def left_out(self, now: float) -> tuple[frozenset[bytes], frozenset[bytes]]:
        """The versions set aside and those superseded at `now` (monotonic)."""
        set_aside = frozenset(v for v, until in self._set_aside.items() if until > now)
        superseded = frozenset(v for v, until in self._superseded.items() if until > now)
        return set_aside, superseded

    def set_aside_count(self) -> int:
        return sum(t > time.monotonic() for t in self._set_aside.values())

    def _check_lineages(self, rnd: Round) -> None:
        """Have the chains of the other versions peers look with checked (in the
        background): until one is, it ranks below every certified lineage."""
        if self.lineages is None or len(rnd.outlook.version) != CHAINED_VERSION_BYTES:
            return
        holders: dict[bytes, list[Member]] = {}
        for d in rnd.view.values():
            if d.state is PeerState.LOOKING and rnd.outlook.usable(d):
                holders.setdefault(d.state_version, []).append(
                    Member(d.peer_id, d.addrs, d.bandwidth)
                )
        for version, peers in holders.items():
            if version != rnd.outlook.version:
                self.lineages.want(version, peers)

    async def check(self, rnd: Round, end: float) -> None:
        """Raise NeedsResync when the swarm has moved past our version.

        The declarations that outvote us are first confirmed with their
        owners: a peer killed while looking leaves its declaration behind for
        a whole TTL, and a few of those must not send live peers to re-sync.
        Owners that do not answer are set aside.
        """
        outlook = rnd.outlook
        self._check_lineages(rnd)
        target = outlook.resync_target(rnd.view)
        if target is None:
            return
        counts = dict(outlook.version_counts(rnd.view))
        mine = counts[outlook.version]
        holders = outlook.holders(rnd.view, target)
        confirmed = await self._prober.confirm(rnd, holders[:MAX_PROBES], end)
        if rnd.group is not None or rnd.mode == Mode.CLOSED:
            return  # joins filled our group while we asked
        if not confirmed or not outlook.outvoted(len(confirmed), target, mine):
            return
        rnd.answer_all(JoinReply(ReplyKind.DISBANDED))
        rnd.mode = Mode.CLOSED
        # Leaders of that version wait a little for a syncing peer.
        await self._declarer.declare(PeerState.SYNCING, target, end=end, at_least=0.2)
        raise NeedsResync(
            f"{len(confirmed)} looking peers hold version {_short(target)}, "
            f"{mine} (us included) hold ours {_short(outlook.version)}: "
            "load the state first",
            version=outlook.version,
            target=target,
            versions=counts,
            holders=tuple(Member(d.peer_id, d.addrs, d.bandwidth) for d in confirmed),
        )


def _short(version: bytes) -> str:
    """A version in a log line: its last 12 hex digits (versions that count commits
    differ at the end; the leading digits are zeros)."""
    return version.hex()[-12:] or "empty"
