"""How far this peer's clock is off the swarm's, measured while the daemon runs.

Records in the DHT expire by the wall clock: matchmaking declarations live 30 s,
peer reports and stage records a minute. A peer whose clock is minutes behind
writes declarations that arrive expired (it never finds a group); one ahead
leaves declarations that outlive it. `shoal doctor` checks the clock once;
the daemon measures it all along: every `CHECK_EVERY_S` it pings a few of the
peers it is connected to (the DHT's ping answers with the peer's time) and
takes the median of each peer's latest offset, so one peer with a wrong clock,
or lying about it, moves nothing. Beyond `LIMIT_S` it says so once, with what
to do, in the log, in `/status` (`clock_skew_s`) and in `/metrics`.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Iterable
from dataclasses import dataclass

from shoal.dht.node import DEFAULT_PROTOCOL
from shoal.transport import rpc
from shoal.transport.host import Host
from shoal.transport.identity import PeerID

__all__ = ["ClockWatch", "SkewEstimate"]

log = logging.getLogger("shoal.peer")

LIMIT_S = 30.0  # what the DHT's records tolerate (dht.records.DEFAULT_CLOCK_SKEW)
CHECK_EVERY_S = 60.0
FIRST_CHECK_S = 10.0
SAMPLE_PEERS = 5
MAX_RTT_S = 2.0  # a slower answer says little about when it was written
PING_TIMEOUT_S = 5.0
FRESH_S = 600.0
MAX_PEERS = 64


@dataclass(frozen=True)
class _Sample:
    skew: float  # ours minus theirs, seconds
    at: float  # monotonic


class SkewEstimate:
    """Sans-I/O: the peers' offsets from our clock, and their median."""

    def __init__(self) -> None:
        self._latest: dict[PeerID, _Sample] = {}

    def observe(
        self, peer: PeerID, sent: float, theirs: float, received: float, now: float
    ) -> bool:
        """A ping sent at `sent` and answered at `received` (our wall clock) carried
        their time `theirs`; False when the round trip was too slow to tell."""
        if received - sent > MAX_RTT_S or received < sent:
            return False
        self._latest.pop(peer, None)
        self._latest[peer] = _Sample((sent + received) / 2 - theirs, now)
        while len(self._latest) > MAX_PEERS:
            self._latest.pop(next(iter(self._latest)))
        return True

    def median(self, now: float) -> float | None:
        """The median offset over the peers heard from lately (None: none). Of an even
        count's two middle offsets, the one nearer zero: we are off only when more than
        half the peers say so (two of four peers wrong by 164 s made an average of +82 s)."""
        skews = sorted(s.skew for s in self._latest.values() if now - s.at <= FRESH_S)
        if not skews:
            return None
        mid = len(skews) // 2
        return skews[mid] if len(skews) % 2 else min(skews[mid - 1], skews[mid], key=abs)

    def peers(self, now: float) -> int:
        return sum(1 for s in self._latest.values() if now - s.at <= FRESH_S)


class ClockWatch:
    """Measures our clock against connected peers' and says when it is off."""

    def __init__(self, host: Host) -> None:
        self.host = host
        self.estimate = SkewEstimate()
        self.skew_s: float | None = None  # the latest median (ours minus the swarm's)
        self._warned = False

    async def run(self) -> None:
        await asyncio.sleep(FIRST_CHECK_S)
        while True:
            await self.check(self._candidates())
            await asyncio.sleep(CHECK_EVERY_S)

    def _candidates(self) -> list[PeerID]:
        peers = list(self.host.connections)
        random.shuffle(peers)
        return peers[:SAMPLE_PEERS]

    async def check(self, peers: Iterable[PeerID]) -> float | None:
        """Ping `peers` (at once), update the estimate; the median skew."""
        await asyncio.gather(*(self._ping(p) for p in peers))
        self.skew_s = self.estimate.median(time.monotonic())
        self._say()
        return self.skew_s

    async def _ping(self, peer: PeerID) -> None:
        sent = time.time()
        try:
            ask = {"from": [], "client": True}
            reply = await rpc.call(
                self.host, peer, DEFAULT_PROTOCOL, "ping", ask, timeout=PING_TIMEOUT_S
            )
        except Exception as e:  # a peer that does not answer tells nothing
            log.debug("clock check: %s did not answer: %r", peer, e)
            return
        received = time.time()
        theirs = reply.get("t") if isinstance(reply, dict) else None
        if isinstance(theirs, int | float) and not isinstance(theirs, bool):
            self.estimate.observe(peer, sent, float(theirs), received, time.monotonic())

    def _say(self) -> None:
        skew = self.skew_s
        off = skew is not None and abs(skew) > LIMIT_S
        if off and not self._warned:
            assert skew is not None
            peers = self.estimate.peers(time.monotonic())
            log.warning(
                "this peer's clock is %+.0f s off the median of %d peers' clocks; rounds and "
                "DHT records need clocks within %.0f s: enable time synchronization (NTP, "
                "e.g. `timedatectl set-ntp true`)",
                skew,
                peers,
                LIMIT_S,
            )
        elif not off and self._warned and skew is not None:
            log.info("this peer's clock is within %.1f s of its peers' again", abs(skew))
        if skew is not None:
            self._warned = off
