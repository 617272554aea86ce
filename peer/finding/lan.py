"""A running peer's mDNS: announce it, join the peers heard, decide who hosts on a new LAN.

A peer with no other way in listens `MDNS_FIRST_WAIT` seconds before starting
its DHT: the peers it hears become its bootstrap peers. Two peers started
together hear each other; the one with the lower peer ID hosts and the other
joins it, and a peer that has finished starting (`settled`) is always joined.
Peers heard later are joined into the running DHT, so two networks that
started apart on one LAN become one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from shoal.transport.multiaddr import Multiaddr

from .mdns import MdnsDiscovery, MdnsPeer

if TYPE_CHECKING:
    from shoal.dht.node import DHTNode
    from shoal.transport.host import Host

__all__ = ["LanFinder"]

log = logging.getLogger("shoal.peer.mdns")

MAX_JOINS_IN_FLIGHT = 4
JOIN_TIMEOUT = 10.0


class LanFinder:
    """mDNS for a daemon. `interfaces`: the IPs to use, None for every interface."""

    def __init__(
        self,
        host: Host,
        network: str,
        interfaces: Sequence[str] | None,
        on_neighbour: Callable[[list[str]], None] | None = None,
    ) -> None:
        """`on_neighbour`: given the IPs of each peer heard on our link
        (`NatManager.heard_on_lan`: their dial-backs prove nothing of the internet)."""
        self.host = host
        self._on_neighbour = on_neighbour
        self._interfaces = None if interfaces is None else list(interfaces)
        self.mdns = MdnsDiscovery(
            host.peer_id,
            network,
            addrs=self._announced,
            interfaces=self._interfaces,
            on_peer=self._heard,
        )
        self._dht: DHTNode | None = None
        self._joins: set[asyncio.Task[None]] = set()
        self.joins_failed = 0  # heard peers that did not join (a dead one, or a liar)

    def _announced(self) -> list[Multiaddr]:
        if self._interfaces is None:
            return self.host.interface_addresses(include_loopback=False)
        wanted = set(self._interfaces)
        return [
            a
            for a in self.host.interface_addresses(include_loopback=True)
            if (e := a.tcp_endpoint()) is not None and e[0] in wanted
        ]

    async def start(self) -> None:
        await self.mdns.start()

    async def first_peers(self, timeout: float) -> tuple[list[Multiaddr], bool]:
        """(addresses of the peers heard within `timeout`, whether to join their
        experiment rather than host one)."""
        if not await self.mdns.wait_for_peer(timeout):
            return [], False
        peers = list(self.mdns.found.values())
        me = self.host.peer_id.to_bytes()
        joins = any(p.settled or p.peer_id.to_bytes() < me for p in peers)
        return [a for p in peers for a in p.addrs[:2]], joins

    def settled_addrs(self) -> list[Multiaddr]:
        """The addresses of the peers heard that finished starting (in a network)."""
        return [a for p in self.mdns.found.values() if p.settled for a in p.addrs[:2]]

    def attach(self, dht: DHTNode) -> None:
        """Join peers heard from now on (and those heard already) into `dht`."""
        self._dht = dht
        for peer in list(self.mdns.found.values()):
            self._heard(peer)

    def _heard(self, peer: MdnsPeer) -> None:
        if self._on_neighbour is not None:
            self._on_neighbour([e[0] for a in peer.addrs if (e := a.tcp_endpoint()) is not None])
        dht = self._dht
        if dht is None or self.host.connection(peer.peer_id) is not None:
            return
        if not peer.settled:
            return  # no DHT to join yet: it joins us, or says it is up (heard again) later
        if len(self._joins) >= MAX_JOINS_IN_FLIGHT:
            return
        task = asyncio.get_running_loop().create_task(self._join(dht, peer))
        self._joins.add(task)
        task.add_done_callback(self._joins.discard)

    async def _join(self, dht: DHTNode, peer: MdnsPeer) -> None:
        # Each address carries the announced /p2p/ID: the handshake checks it.
        try:
            async with asyncio.timeout(JOIN_TIMEOUT):
                await dht.bootstrap(list(peer.addrs), attempts=1, quiet=True)
            log.info("mDNS: joined %s", peer.peer_id.short())
        except Exception as e:
            self.joins_failed += 1
            log.info("mDNS: could not join %s: %s", peer.peer_id.short(), type(e).__name__)

    async def settled(self) -> None:
        await self.mdns.settled()

    async def aclose(self) -> None:
        for task in list(self._joins):
            task.cancel()
        with contextlib.suppress(Exception):
            await self.mdns.aclose()
