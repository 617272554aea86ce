"""A DHT node's background upkeep: stale buckets refreshed, its records
republished, and new addresses announced to the peers nearest to it."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from .publisher import Publisher
from .routing import RoutingTable

log = logging.getLogger("shoal.dht")

# A peer whose addresses changed re-announces itself at most this often (seconds).
ANNOUNCE_INTERVAL = 5.0


class Maintenance:
    """The loop of a node's upkeep; `wake` makes it recompute what is due."""

    def __init__(
        self,
        table: RoutingTable,
        publisher: Publisher,
        find_nodes: Callable[..., Awaitable[object]],
        refresh_interval: float,
        serves: Callable[[], bool] | None,
    ) -> None:
        self.table = table
        self.publisher = publisher
        self._find_nodes = find_nodes
        self.refresh_interval = refresh_interval
        self._serves = serves
        self._loop = asyncio.get_running_loop()
        self.announce_due = False
        self.announced_at = -ANNOUNCE_INTERVAL
        self.wake = asyncio.Event()

    def addresses_changed(self) -> None:
        self.announce_due = True
        self.wake.set()

    async def _announce(self) -> None:
        self.announce_due = False
        self.announced_at = self._loop.time()
        if self._serves is not None and not self._serves():
            return  # a client is in nobody's table
        try:
            await self._find_nodes([self.table.local_id])
        except Exception as e:
            log.debug("announcing our new addresses failed: %r", e)

    async def run(self) -> None:
        """Refresh stale buckets, republish our own records and announce new addresses
        when due."""
        next_refresh = self._loop.time() + self.refresh_interval
        while True:
            now_wall = time.time()
            due_republish = self.publisher.next_due()
            wait = next_refresh - self._loop.time()
            if due_republish is not None:
                wait = min(wait, due_republish - now_wall)
            if self.announce_due:
                announce_at = self.announced_at + ANNOUNCE_INTERVAL
                if announce_at <= self._loop.time():
                    await self._announce()
                    continue
                wait = min(wait, announce_at - self._loop.time())
            if wait > 0:
                self.wake.clear()
                try:
                    async with asyncio.timeout(wait):
                        await self.wake.wait()
                    continue  # something changed: recompute
                except TimeoutError:
                    pass
            await self.publisher.republish()
            if self._loop.time() >= next_refresh:
                await self.refresh()
                next_refresh = self._loop.time() + self.refresh_interval

    async def refresh(self, *, settle: int | None = None) -> None:
        """Look up a random target in every bucket not refreshed for an interval (at
        the join: every bucket, the far ones the lookup of our own ID left empty;
        `settle`: as `DHTNode.find_nodes`)."""
        now = self._loop.time()
        targets = self.table.buckets_to_refresh(now, self.refresh_interval)
        if not targets:
            return
        try:
            await self._find_nodes(targets, settle=settle)
        except Exception as e:
            log.warning("bucket refresh failed: %r", e)
            return
        now = self._loop.time()
        for t in targets:
            self.table.touch_bucket_for(t, now)
