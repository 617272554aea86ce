"""An averager's "busy" declaration between rounds, and when it is due again."""

from __future__ import annotations

import time

from .matchmaking import Matchmaker


class Presence:
    """When we last declared in the matchmaking records that we take part and will look
    soon (`Averager.announce_presence`), so that it is renewed before it expires."""

    def __init__(self, matchmaker: Matchmaker, ttl: float) -> None:
        self._matchmaker = matchmaker
        self._ttl = ttl
        self.at = -float("inf")

    async def announce(self, version: bytes, work: int, timeout: float) -> bool:
        ok = await self._matchmaker.declare_busy(version, timeout=timeout, work=work)
        self.at = time.monotonic()
        return ok

    def lapsed(self) -> None:
        """Another declaration ("looking", "syncing") replaced ours: redeclare soon."""
        self.at = -float("inf")

    def renewed(self) -> None:
        """A round declared us busy (matchmaking does; after an abort it stays too)."""
        self.at = time.monotonic()

    def standing(self) -> bool:
        """Our last "busy" declaration has not expired: leaders still see it and wait
        for us (False once a round replaced it, `lapsed`)."""
        return time.monotonic() - self.at < self._ttl

    def due(self) -> bool:
        """Our last declaration is a third of its TTL old (or was left by a round that
        did not commit)."""
        return time.monotonic() - self.at >= self._ttl / 3
