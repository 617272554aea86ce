"""Matchmaking cut off from the DHT: the declarations of the peers we still reach.

A read of the declarations that reaches no other peer's (`Declarer.cut_off`) is
what a partition from the DHT's servers looks like: the peers behind a NAT whose
uplink is cut, say, whose only DHT contacts are public peers. Such a peer saw
nobody, committed alone and forked the state at every round (in the soak, the
NATed peers committed alone in about half their rounds), while peers it was still
connected to (over their LAN, or a hole-punched path that does not cross the cut)
did the same beside it.

So a cut-off peer asks the peers it recently averaged with or saw declared, over
the connections still open (no dial: a dial across the cut only waits), for their
latest declaration (``hello``), and takes into its view those that are cut off
too: an island of the swarm averages together until the cut heals, and the work
of each lineage decides which state the swarm keeps then (see `lineage`). Peers
that still reach the DHT are left out: they find their groups there, and a
member they cannot see through the DHT is likely one the rest of their group
cannot reach either (its round would fail at the first connection).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from shoal.transport import rpc
from shoal.transport.errors import TransportError
from shoal.transport.host import Host
from shoal.transport.identity import PeerID

from .matchmaking_rules import Declaration

log = logging.getLogger("shoal.averaging.matchmaking")

__all__ = ["HELLO_TIMEOUT", "MAX_ASKED", "MAX_KEPT", "Neighbors"]

MAX_KEPT = 32  # peers remembered (the most recently seen)
MAX_ASKED = 8  # of them, asked at once (the most recently seen with a connection)
HELLO_TIMEOUT = 1.0


class Neighbors:
    """The peers of this key we saw lately, and asking them directly when cut off."""

    def __init__(
        self,
        host: Host,
        protocol: str,
        key: str,
        abortable: Callable[[Awaitable[Any]], Awaitable[Any]],
    ) -> None:
        self.host = host
        self.protocol = protocol
        self.key = key
        self._abortable = abortable
        self._loop = asyncio.get_running_loop()
        self._seen: dict[PeerID, float] = {}  # peer -> loop time last seen
        self.islands = 0  # reads in which a cut-off neighbour was found (stats)

    def note(self, peers: Iterable[PeerID]) -> None:
        """`peers` were seen now (declared in a read, or members of our group)."""
        now = self._loop.time()
        for peer in peers:
            if peer != self.host.peer_id:
                self._seen.pop(peer, None)
                self._seen[peer] = now
        for peer in list(self._seen)[: max(0, len(self._seen) - MAX_KEPT)]:
            del self._seen[peer]

    def reachable(self) -> list[PeerID]:
        """The remembered peers we hold a connection to, most recently seen first."""
        return [p for p in reversed(self._seen) if self.host.connection(p) is not None][:MAX_ASKED]

    async def ask(self, end: float) -> dict[PeerID, Declaration]:
        """The declarations of the reachable neighbours that are cut off too."""
        until = min(end, self._loop.time() + HELLO_TIMEOUT)
        peers = self.reachable()
        if not peers or until <= self._loop.time():
            return {}
        answers = await self._abortable(asyncio.gather(*(self._hello(p, until) for p in peers)))
        island = {d.peer_id: d for d in answers if d is not None}
        if island:
            self.islands += 1
            log.debug("%s: cut off from the DHT; %d of %d reachable neighbours are too",
                      self.key, len(island), len(peers))  # fmt: skip
        return island

    async def _hello(self, peer: PeerID, until: float) -> Declaration | None:
        try:
            async with asyncio.timeout_at(until):
                raw = await rpc.call(
                    self.host,
                    peer,
                    self.protocol,
                    "hello",
                    {"key": self.key},
                    timeout=until - self._loop.time(),
                )
        except (TransportError, TimeoutError, OSError) as e:
            log.debug("%s: hello to neighbour %s failed: %r", self.key, peer.short(), e)
            return None
        if not isinstance(raw, dict) or raw.get("cut_off") is not True:
            return None  # it reaches the DHT (or is an older peer): not of our island
        try:
            return Declaration.from_hello(peer, raw)
        except ValueError as e:
            log.debug("%s: neighbour %s sent a bad declaration: %s", self.key, peer.short(), e)
            return None
