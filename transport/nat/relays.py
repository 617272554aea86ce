"""Relay reservations kept while private, and relays advertised and found through
the directory (the DHT's): the relay side of `NatManager`."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection

from ..host import Host
from ..identity import PeerID
from ..multiaddr import Multiaddr
from ..tasks import TaskSet
from . import relay
from .autonat import Reachability
from .config import NatConfig
from .directory import RelayDirectory
from .identify import IdentifyInfo
from .reachability import over_lan
from .relay_client import RelayClient

log = logging.getLogger("shoal.transport.nat")

_DHT_LOOKUP_INTERVAL = 30.0
_DHT_TIMEOUT = 30.0
_MAX_BACKOFF = 60.0


class RelayKeeper:
    """Keeps `max_relays` reservations while private (with a backoff per relay that
    refused), and advertises our relay service in the directory while public."""

    def __init__(
        self,
        host: Host,
        config: NatConfig,
        relay_client: RelayClient,
        tasks: TaskSet,
        *,
        lan_neighbours: Collection[str] = (),
        peers: Callable[[], dict[PeerID, IdentifyInfo]],
        reachability: Callable[[], Reachability],
        confirmed_addresses: Callable[[], list[Multiaddr]],
        notify: Callable[[], None],
    ) -> None:
        self.host = host
        self._lan_neighbours = lan_neighbours  # (the manager's set: read as it grows)
        self.config = config
        self.relay_client = relay_client
        self._tasks = tasks
        self._peers = peers
        self._reachability = reachability
        self._confirmed_addresses = confirmed_addresses
        self._notify = notify
        self._loop = asyncio.get_running_loop()
        self.directory: RelayDirectory | None = None
        self.backoff: dict[PeerID, tuple[float, float]] = {}  # until, last delay
        self.errors: dict[PeerID, str] = {}  # the last refusal said, per relay
        self.reserving: set[PeerID] = set()
        self.dht_relays: dict[PeerID, list[Multiaddr]] = {}
        self.next_dht_lookup = 0.0
        self.next_dht_advert = 0.0

    def set_directory(self, directory: RelayDirectory | None) -> None:
        self.directory = directory
        self.next_dht_lookup = self.next_dht_advert = 0.0

    # --- reservations ---------------------------------------------------------------------------

    def wants_relays(self) -> bool:
        return self._reachability() is Reachability.PRIVATE

    def manage_relays(self, now: float) -> float:
        """Keep `max_relays` reservations while private, none otherwise; the next deadline."""
        if not self.wants_relays():
            for relay_id in self.relay_client.holding():
                self.relay_client.drop(relay_id)
            return self.config.recheck_interval
        holding = self.relay_client.holding() | self.reserving
        want = self.config.max_relays - len(holding)
        next_retry = self.config.recheck_interval
        if want <= 0:
            return next_retry
        for peer, addrs in self.candidates():
            if want <= 0:
                break
            if peer in holding:
                continue
            until, _ = self.backoff.get(peer, (0.0, 0.0))
            if until > now:
                next_retry = min(next_retry, until - now)
                continue
            want -= 1
            self.reserving.add(peer)
            self._tasks.spawn(self._reserve(peer, addrs))
        return next_retry

    def candidates(self) -> list[tuple[PeerID, list[Multiaddr]]]:
        out: dict[PeerID, list[Multiaddr]] = {}
        peers = self._peers()
        for peer, conn in self.host.connections.items():
            info = peers.get(peer)
            if (
                conn.kind != "relayed"
                and not over_lan(conn, self._lan_neighbours)
                and info is not None
                and relay.HOP_PROTOCOL in info.protocols
            ):
                out[peer] = [a for a in info.addrs if a.is_direct_tcp]
        for peer, addrs in self.dht_relays.items():
            if peer != self.host.peer_id:
                out.setdefault(peer, addrs)
        # Peers that advertise a direct (so confirmed public) address first: the others
        # are probably private themselves and would refuse.
        return sorted(out.items(), key=lambda kv: not kv[1])

    async def _reserve(self, peer: PeerID, addrs: list[Multiaddr]) -> None:
        try:
            await self.relay_client.keep(peer, addrs)
            self.backoff.pop(peer, None)
            self.errors.pop(peer, None)
        except Exception as e:
            _, last = self.backoff.get(peer, (0.0, 0.0))
            delay = min(_MAX_BACKOFF, max(self.config.relay_retry, last * 2))
            now = self._loop.time()
            if len(self.backoff) > 1024:  # bounded: forget the expired ones
                self.backoff = {p: (u, d) for p, (u, d) in self.backoff.items() if u > now}
            self.backoff[peer] = (now + delay, delay)
            # Said once per relay and reason; the retries that meet the same answer are
            # not news (a loopback-only peer meets "not publicly reachable" every time).
            said = self.errors.get(peer)
            level = logging.DEBUG if said == str(e) else logging.INFO
            self.errors[peer] = str(e)
            if len(self.errors) > 1024:
                peers = self._peers()
                self.errors = {p: m for p, m in self.errors.items() if p in peers}
            log.log(level, "no reservation on %s (retry in %.0fs): %s", peer.short(), delay, e)
        finally:
            self.reserving.discard(peer)
            self._notify()

    # --- the directory: relay advertisement and discovery ------------------------------------

    def manage_directory(self, now: float) -> float:
        if self.directory is None:
            return self.config.recheck_interval
        if self.wants_relays() and len(self.candidates()) < self.config.max_relays:
            if now >= self.next_dht_lookup:
                self.next_dht_lookup = now + _DHT_LOOKUP_INTERVAL
                self._tasks.spawn(self._discover_relays())
            return max(0.05, self.next_dht_lookup - now)
        if (
            self.config.relay_service
            and self._reachability() is Reachability.PUBLIC
            and self._confirmed_addresses()
        ):
            if now >= self.next_dht_advert:
                self.next_dht_advert = now + self.config.relay_dht_ttl / 2
                self._tasks.spawn(self._advertise_relay())
            return max(0.05, self.next_dht_advert - now)
        return self.config.recheck_interval

    async def _advertise_relay(self) -> None:
        assert self.directory is not None
        try:
            async with asyncio.timeout(_DHT_TIMEOUT):
                await self.directory.advertise(
                    self.host.peer_id, self._confirmed_addresses(), self.config.relay_dht_ttl
                )
        except Exception as e:
            self.next_dht_advert = self._loop.time() + 5.0
            log.info("could not advertise the relay: %r", e)

    async def _discover_relays(self) -> None:
        assert self.directory is not None
        try:
            async with asyncio.timeout(_DHT_TIMEOUT):
                listed = await self.directory.find()
        except Exception as e:
            log.info("relay lookup failed: %r", e)
            return
        for peer, advertised in list(listed.items())[:64]:
            if peer == self.host.peer_id:
                continue
            # Untrusted entries: only direct TCP addresses of the peer they name.
            addrs = [
                a.with_peer_id(peer)
                for a in advertised[:8]
                if a.is_direct_tcp and a.peer_id in (None, peer)
            ]
            if addrs:
                self.dht_relays.pop(peer, None)
                self.dht_relays[peer] = addrs
        while len(self.dht_relays) > 256:  # bounded: the least recently seen go first
            del self.dht_relays[next(iter(self.dht_relays))]
        self._notify()
