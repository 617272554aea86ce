"""A matchmaking round's upkeep: the declarations it reads, and our own one kept fresh.

`Upkeep.read` reads the declarations under the key (and, when the DHT read reached no
other peer's, those of the neighbours cut off with us: `matchmaking_island`);
`Upkeep.refresh` reads them again during a round, checks our version against them
(`matchmaking_versions`) and stores our "looking" declaration again when it is due or
went missing, polling sooner while they change.
"""

from __future__ import annotations

import asyncio
import time

from shoal.transport.identity import PeerID

from .declarer import Declarer
from .matchmaking_island import Neighbors
from .matchmaking_round import MatchmakingConfig, Round
from .matchmaking_rules import Declaration, PeerState, View, merge_views
from .matchmaking_versions import Versions

__all__ = ["FIRST_POLL", "REDECLARE_UNSEEN_S", "Upkeep"]

FIRST_POLL = 0.05
# Our declaration missing from what we read this long after we stored it: the
# store reached too few replicas (it timed out on a loaded machine, or landed
# behind a partition), and nobody may know we are looking. Store it again then,
# not only when it is due for renewal (declaration_ttl / 3).
REDECLARE_UNSEEN_S = 2.0


class Upkeep:
    """Reads the declarations for a matchmaker's rounds and renews ours."""

    def __init__(
        self,
        declarer: Declarer,
        neighbors: Neighbors,
        versions: Versions,
        config: MatchmakingConfig,
    ) -> None:
        self._declarer = declarer
        self._host = declarer.host
        self._neighbors = neighbors
        self._versions = versions
        self._config = config
        self._loop = asyncio.get_running_loop()
        ttl = config.declaration_ttl
        self.poll_max = min(1.0, max(0.05, config.min_matchmaking_time / 2), ttl / 4)

    async def read(self, view: dict[PeerID, Declaration], end: float) -> dict[PeerID, Declaration]:
        """The declarations read from the DHT merged into `view`; when the read
        reached no other peer's, also those of the reachable neighbours cut off
        with us (see matchmaking_island)."""
        view = await self._declarer.poll(view, end)
        self._neighbors.note(p for p in view if self._host.connection(p) is not None)
        if self._declarer.cut_off:
            island = await self._neighbors.ask(end)
            if island:
                view = merge_views(view, island, time.time())
        return view

    async def refresh(self, rnd: Round, end: float) -> float:
        """Read the declarations again (and renew ours); when to read next (loop
        time): sooner while they change, up to `poll_max` apart while they do not."""
        view = await self.read(rnd.view, end)
        if rnd.group is not None:
            return self._loop.time()  # a join filled the group meanwhile
        changed = _fingerprint(view) != _fingerprint(rnd.view)
        rnd.poll_backoff = 0 if changed else rnd.poll_backoff + 1
        rnd.view = view
        rnd.note_excluded()
        await self._versions.check(rnd, end)
        since = self._loop.time() - self._declarer.declared_at
        if since > self._config.declaration_ttl / 3 or (
            since > REDECLARE_UNSEEN_S and not self._declarer.seen_in(view)
        ):
            outlook = rnd.outlook
            await self._declarer.declare(
                PeerState.LOOKING, outlook.version, end=end, work=outlook.work, slot=outlook.slot
            )
        return self._loop.time() + min(self.poll_max, FIRST_POLL * 2.0**rnd.poll_backoff)


def _fingerprint(view: View) -> set[tuple[PeerID, str, bytes, float]]:
    return {(d.peer_id, d.state, d.state_version, d.expiration) for d in view.values()}
