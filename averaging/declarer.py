"""Our matchmaking declaration in the DHT (an owner-signed subkey of
``<key>/matchmaking``) and reading everyone's: the matchmaker's only DHT traffic."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from shoal.dht.node import DHTError, DHTNode
from shoal.dht.records import RecordError, owner_marker
from shoal.dht.routing import dialable_addrs
from shoal.transport.errors import TransportError
from shoal.transport.identity import PeerID
from shoal.transport.multiaddr import Multiaddr

from .matchmaking_rules import MAX_ADDRS, Declaration, PeerState, merge_views, parse_view

log = logging.getLogger("shoal.averaging.matchmaking")

# Each DHT read or write of one call is bounded by this (and by the call's deadline).
DHT_TIMEOUT = 2.0
# Replicas a poll reads, drawn among the k its last full read found (`DHTNode.get`'s
# `sample`): every declaration is stored on all k, and reading all k delivered each
# one k times to every poller (180 KB a peer a round at 16 peers).
POLL_REPLICAS = 3


class Declarer:
    """Our declaration in the DHT (owner-signed subkey of ``<key>/matchmaking``) and
    reading everyone's: the matchmaker's only DHT traffic."""

    def __init__(
        self,
        dht: DHTNode,
        dht_key: str,
        declaration_ttl: float,
        bandwidth: float,
        abortable: Callable[[Awaitable[Any]], Awaitable[Any]],
    ) -> None:
        self.dht = dht
        self.host = dht.host
        self.peer_id = dht.peer_id
        self.dht_key = dht_key
        self.declaration_ttl = declaration_ttl
        self.bandwidth = bandwidth
        self._abortable = abortable
        self._subkey = owner_marker(self.peer_id)
        self._loop = asyncio.get_running_loop()
        self._expiration = 0.0
        self.declared_at = -float("inf")  # loop time of our last declaration
        self.declared: tuple[PeerState, bytes] = (PeerState.LEFT, b"")  # what it said
        self._latest: Declaration | None = None  # our last declaration (with its expiration)
        # Our last read reached no other peer's declaration (failed, or answered by no
        # replica holding any): we may be cut off from the DHT (see matchmaking_island).
        self.cut_off = False

    def seen_in(self, view: dict[PeerID, Declaration]) -> bool:
        """Whether `view` (read from the DHT) holds our latest declaration."""
        ours = view.get(self.peer_id)
        return ours is not None and ours.expiration >= self._expiration

    def addrs(self) -> tuple[Multiaddr, ...]:
        """Our addresses as declarations and groups carry them: without the trailing
        /p2p/ of our own ID (the record's owner names us; a dial adds it back), which
        was 53 of a declaration's 139 bytes, stored on 3 replicas and read by every
        poller, twice a round."""
        return dialable_addrs(self.peer_id, self.host.addresses(), MAX_ADDRS)

    async def poll(
        self, previous: dict[PeerID, Declaration], end: float
    ) -> dict[PeerID, Declaration]:
        """The current declarations: those read now merged into `previous` (see
        `merge_views`); the previous view when the DHT does not answer in time."""
        timeout = min(DHT_TIMEOUT, end - self._loop.time())
        if timeout <= 0:
            return previous
        try:
            # The lookup ends at `timeout` with the replicas that answered by then
            # (merged into what we saw): under a stalled loop or a partition, every
            # read of all k replicas could run out of time and we would see no one.
            # The outer bound only catches a lookup that does not stop when told.
            async with asyncio.timeout(timeout + DHT_TIMEOUT):
                value = await self._abortable(
                    self.dht.get(self.dht_key, latest=True, within=timeout, sample=POLL_REPLICAS)
                )
        except (TimeoutError, DHTError, TransportError, OSError) as e:
            log.debug("%s: reading declarations failed: %r", self.dht_key, e)
            self.cut_off = True
            return previous
        now = time.time()
        fresh = parse_view(value.subkeys if value is not None else None, now)
        self.cut_off = not any(p != self.peer_id for p in fresh)
        return merge_views(previous, fresh, now)

    def hello(self) -> dict[str, Any]:
        """What we answer ``hello``: our latest declaration (state and version, which
        older peers read, then the rest with the expiration it was stored with) and
        whether we are cut off from the DHT."""
        state, version = self.declared
        reply: dict[str, Any] = {"state": str(state), "version": version}
        if self._latest is not None:
            reply.update(self._latest.to_value())
            reply["expiration"] = self._latest.expiration
        reply["cut_off"] = self.cut_off
        return reply

    def move(self, dht_key: str) -> str:
        """Declare under `dht_key` from now on (a Moshpit cell's); the key we left."""
        left, self.dht_key = self.dht_key, dht_key
        return left

    async def withdraw(self, dht_key: str, *, timeout: float = DHT_TIMEOUT) -> bool:
        """Declare "left" under `dht_key`, which we no longer declare under (a cell we
        moved out of), so that its leaders stop waiting for us; our declaration
        under the current key is unchanged."""
        expiration = max(time.time() + self.declaration_ttl, self._expiration + 1e-3)
        self._expiration = expiration
        decl = Declaration(
            self.peer_id, PeerState.LEFT, b"", self.addrs(), self.bandwidth, expiration, None
        )
        try:
            async with asyncio.timeout(timeout):
                return await self.dht.store(
                    dht_key, decl.to_value(), expiration, subkey=self._subkey
                )
        except (TimeoutError, DHTError, TransportError, OSError, RecordError) as e:
            log.debug("%s: declaring that we left failed: %r", dht_key, e)
            return False

    async def declare(
        self,
        state: PeerState,
        version: bytes,
        *,
        end: float | None = None,
        timeout: float = DHT_TIMEOUT,
        at_least: float = 0.0,
        work: int | None = None,
        slot: int | None = None,
    ) -> bool:
        """Store our declaration (`work`: of the lineage that made `version`, see
        `Outlook.lineage`; `slot`: the grid slot a "looking" is for); False when the
        DHT did not take it in time."""
        if end is not None:
            timeout = max(min(timeout, end - self._loop.time()), at_least)
        if timeout <= 0:
            return False
        # Strictly later than our previous one: the later expiration wins everywhere.
        expiration = max(time.time() + self.declaration_ttl, self._expiration + 1e-3)
        self._expiration = expiration
        self.declared_at = self._loop.time()
        self.declared = (state, version)
        decl = Declaration(
            self.peer_id, state, version, self.addrs(), self.bandwidth, expiration, work, slot
        )
        self._latest = decl
        try:
            async with asyncio.timeout(timeout):
                return await self.dht.store(
                    self.dht_key, decl.to_value(), expiration, subkey=self._subkey
                )
        except (TimeoutError, DHTError, TransportError, OSError, RecordError) as e:
            log.debug("%s: declaring %s failed: %r", self.dht_key, state, e)
            return False
