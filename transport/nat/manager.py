"""NatManager: the one entry point of NAT traversal for a host.

It runs identify on every connection, votes on observed addresses, asks peers
to dial it back (AutoNAT) and decides whether it is public, private or unknown,
serves as a relay while public, keeps relay reservations while private, punches
holes through relayed connections, and tells the host (and through it the DHT)
which addresses to advertise: confirmed public ones and relay addresses only.

    nat = NatManager(host, config=NatConfig())
    nat.directory = DHTRelayDirectory(dht)   # once the DHT runs: relays listed there
    await nat.start()
    ...
    nat.status()      # reachability, addresses, reservations, connections
    await nat.aclose()   # before host.aclose()

The host must be built with ``HostConfig(reuse_port=True)`` so that outgoing
connections leave from the listen port (observed addresses and hole punching
depend on it).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable

from ..connection import Connection
from ..host import Host
from ..identity import PeerID
from ..multiaddr import Multiaddr
from ..tasks import TaskSet
from . import autonat, holepunch
from .autonat import AutoNAT, ProbeResult, Reachability, ReachabilityTracker
from .config import NatConfig
from .directory import RelayDirectory
from .holepunch import HolePuncher
from .identify import IdentifyInfo, IdentifyService
from .observed import ObservedAddresses
from .reachability import has_public_interface, over_lan
from .relay import RelayService
from .relay_client import RelayClient
from .relays import RelayKeeper
from .report import connection_kinds, reachability_detail

log = logging.getLogger("shoal.transport.nat")

PARALLEL_PROBES = 3  # AutoNAT servers asked at once while reachability is unknown
LAN_NEIGHBOURS = 1024  # IPs of peers heard on our link kept (`heard_on_lan`)


class NatManager:
    def __init__(
        self,
        host: Host,
        directory: RelayDirectory | None = None,
        config: NatConfig | None = None,
    ) -> None:
        """`directory`: where relays are advertised and found (the DHT's, see
        `shoal.dht.relay_directory`); may be set later, once the DHT has bootstrapped."""
        self.host = host
        self.config = config = config or NatConfig()
        self._loop = asyncio.get_running_loop()
        forced = None if config.reachability == "auto" else Reachability(config.reachability)
        self.tracker = ReachabilityTracker(
            config.probe_window,
            config.private_score,
            forced,
            recheck_interval=config.recheck_interval,
        )
        self.tracker.public_interface = has_public_interface(host.interface_addresses())
        self.observed = ObservedAddresses(config.observed_threshold, config.observed_ttl)
        self.identify = IdentifyService(
            host,
            agent=config.agent,
            timeout=config.identify_timeout,
            on_identified=self._on_identified,
        )
        self.autonat = AutoNAT(host, config)
        self.relay = RelayService(
            host,
            config.relay_limits,
            # Not refused for being unconfirmed: a peer with a public interface serves
            # while AutoNAT has not decided (a bootstrap machine must not go dark for
            # one slow dial-back).
            accepting=lambda: config.relay_service and self.tracker.may_serve_relay,
            addresses=self.confirmed_addresses,
        )
        self.relay_client = RelayClient(
            host, config, on_change=self._notify, known_addresses=self._known_addresses
        )
        self.puncher = HolePuncher(host, config, self._punch_addresses)
        self.peers: dict[PeerID, IdentifyInfo] = {}
        self._tasks = TaskSet(log, "NAT")
        self._wake = asyncio.Event()
        self._changed = asyncio.Event()
        self._next_probe = 0.0
        self._probing: set[PeerID] = set()  # servers asked, answer pending
        self._unanswered = 0  # probes in a row that no server answered
        self._probed_at: dict[PeerID, float] = {}
        # IPs of peers heard on our link (mDNS): direct connections to them are over
        # the LAN (`over_lan`), no proof of how the internet reaches us.
        self.lan_neighbours: set[str] = set()
        self.relay_keeper = RelayKeeper(
            host,
            config,
            self.relay_client,
            self._tasks,
            lan_neighbours=self.lan_neighbours,
            peers=lambda: self.peers,
            reachability=lambda: self.reachability,
            confirmed_addresses=self.confirmed_addresses,
            notify=self._notify,
        )
        self.relay_keeper.set_directory(directory)
        self._started = False
        self._closed = False
        # Called when what we advertise changes (reachability decided, a relay reserved):
        # the DHT tells its neighbours, or nobody adds a peer that became dialable.
        self.address_listeners: list[Callable[[], None]] = []
        self._advertised: list[Multiaddr] = []

    # --- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        if not self.host.config.reuse_port:
            log.warning(
                "NAT traversal without HostConfig(reuse_port=True): observed addresses "
                "will not match the listen port and hole punching will not work"
            )
        self._started = True
        self.tracker.public_interface = has_public_interface(self.host.interface_addresses())
        self.autonat.start()
        if self.config.relay_service:
            self.relay.start()
        self.relay_client.start()
        if self.config.hole_punching:
            self.puncher.start()
        self.host.set_address_provider(self.advertised_addresses)
        self.identify.start()  # last: it may fire for existing connections at once
        self._tasks.spawn(self._run())

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.host.set_address_provider(None)
        self.identify.close()
        self.autonat.close()
        self.relay.close()
        self.puncher.close()
        await self._tasks.aclose()
        await self.relay_client.aclose()
        self._notify()

    async def __aenter__(self) -> NatManager:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @property
    def directory(self) -> RelayDirectory | None:
        """Where relays are advertised and found; may be set after start()."""
        return self.relay_keeper.directory

    @directory.setter
    def directory(self, directory: RelayDirectory | None) -> None:
        self.relay_keeper.set_directory(directory)
        self._notify()

    # --- what we know ---------------------------------------------------------------------------

    @property
    def reachability(self) -> Reachability:
        return self.tracker.reachability

    def confirmed_addresses(self) -> list[Multiaddr]:
        """Our addresses that a dial-back reached (with /p2p/ID)."""
        return [a.with_peer_id(self.host.peer_id) for a in self.tracker.confirmed()]

    def observed_addresses(self) -> list[Multiaddr]:
        """Addresses enough distinct peers see us at (trusted)."""
        return self.observed.trusted(self._loop.time())

    def relay_addresses(self) -> list[Multiaddr]:
        return self.relay_client.circuit_addresses()

    def advertised_addresses(self) -> list[Multiaddr]:
        """What the host advertises: confirmed public addresses and relay addresses."""
        out = list(self.confirmed_addresses())
        if self.tracker.forced is Reachability.PUBLIC:
            # Declared public (e.g. a forwarded port): trust the interfaces and observers.
            out += self.observed_addresses()
            out += [a for a in self.host.interface_addresses() if not a.is_unspecified]
        if self.reachability is not Reachability.PUBLIC:
            out += self.relay_addresses()
        return list(dict.fromkeys(a.with_peer_id(self.host.peer_id) for a in out))

    def heard_on_lan(self, ips: Iterable[str]) -> None:
        """Peers at `ips` were heard on our link (mDNS announcements: claims, which can
        only make us trust fewer dial-backs). Bounded: the newest LAN_NEIGHBOURS."""
        for ip in ips:
            self.lan_neighbours.add(ip)
        while len(self.lan_neighbours) > LAN_NEIGHBOURS:
            self.lan_neighbours.pop()

    @property
    def serves_dht(self) -> bool:
        """Whether this peer should serve as a DHT hop for others (not while private)."""
        return self.reachability is not Reachability.PRIVATE

    def connection_kinds(self) -> list[dict[str, object]]:
        """Every open connection: its kind ("direct" | "relayed" | "hole-punched"), the
        relay it goes through, and its byte counters."""
        return connection_kinds(self.host, self.peers)

    def reachability_detail(self) -> dict[str, object]:
        """Why we believe what we believe: the dial-back evidence and the last change."""
        return reachability_detail(self.tracker, self._loop.time())

    def status(self) -> dict[str, object]:
        """Everything the status endpoint shows about NAT traversal (JSON-serializable)."""
        now = self._loop.time()
        return {
            "reachability": self.reachability.value,
            "confirmed_addresses": [str(a) for a in self.confirmed_addresses()],
            "observed_addresses": [
                {"addr": str(a), "observers": n, "trusted": n >= self.observed.threshold}
                for a, n in self.observed.candidates(now)
            ],
            "advertised_addresses": [str(a) for a in self.advertised_addresses()],
            "reservations": [
                {
                    "relay": str(r.relay),
                    "addrs": [str(a) for a in r.addrs],
                    "expires_in": round(r.expires - now, 1),
                }
                for r in self.relay_client.reservations.values()
            ],
            "reservation_errors": {
                str(relay_id): error for relay_id, error in self.relay_client.last_error.items()
            },
            "relay_service": {
                "enabled": self.config.relay_service,
                "serving": self.config.relay_service and self.tracker.may_serve_relay,
                **self.relay.status(),
            },
            "autonat": {
                "results": [
                    {"server": str(r.server), "ok": r.ok, "addr": str(r.addr) if r.addr else None}
                    for r in self.tracker.results
                ],
                "detail": self.reachability_detail(),
                "served": dict(self.autonat.served),
            },
            "hole_punching": {
                "attempts": self.puncher.stats.attempts,
                "successes": self.puncher.stats.successes,
                "failures": self.puncher.stats.failures,
                "last_rtt_ms": None
                if self.puncher.stats.last_rtt_s is None
                else round(self.puncher.stats.last_rtt_s * 1000, 2),
                "results": list(self.puncher.stats.results),
            },
            "connections": self.connection_kinds(),
        }

    async def wait_for(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """Wait (at most `timeout`) until `predicate()` holds; re-checked on every change."""
        try:
            async with asyncio.timeout(timeout):
                while not predicate():
                    self._changed.clear()
                    try:
                        async with asyncio.timeout(0.2):  # also catch changes we do not signal
                            await self._changed.wait()
                    except TimeoutError:
                        pass
        except TimeoutError:
            return predicate()
        return True

    # --- events -------------------------------------------------------------------------------

    def _notify(self) -> None:
        self._wake.set()
        self._changed.set()
        if self._started and self.address_listeners:
            advertised = self.advertised_addresses()
            if advertised != self._advertised:
                self._advertised = advertised
                for listener in self.address_listeners:
                    listener()

    def _on_identified(self, conn: Connection, info: IdentifyInfo) -> None:
        peer = conn.remote_peer
        self.peers[peer] = info
        if len(self.peers) > 4096:  # forget peers we are no longer connected to
            connected = self.host.connections
            self.peers = {p: i for p, i in self.peers.items() if p in connected}
        now = self._loop.time()
        if info.observed is not None and self._counts_as_observation(conn):
            before = self.observed.observed_by(peer, now)
            trusted_changed = self.observed.record(peer, info.observed, now)
            if trusted_changed or (before is not None and before != info.observed):
                log.debug("%s observes us at %s (was %s)", peer.short(), info.observed, before)
                self._addresses_changed()
        if (
            self.reachability is Reachability.UNKNOWN
            and conn.kind != "relayed"
            and not over_lan(conn, self.lan_neighbours)
            and autonat.PROTOCOL in info.protocols
        ):
            self._next_probe = 0.0  # a new server while we do not know: ask it now
        if (
            conn.kind == "relayed"
            and not conn.outbound
            and self.host.connection(peer) is conn  # not a duplicate on its way out
            and self.config.hole_punching
            and holepunch.PROTOCOL in info.protocols
        ):
            # We accepted a relayed connection: we start the punch (DCUtR's "B").
            conn.spawn(self._punch(conn))
        self._notify()

    def _counts_as_observation(self, conn: Connection) -> bool:
        """Only connections from our listen port show the mapping others can dial."""
        if conn.kind == "relayed" or conn.local_address is None:
            return False
        if over_lan(conn, self.lan_neighbours):
            return False
        if not conn.outbound:
            return True
        ports = {a.tcp_endpoint()[1] for a in self.host.listen_addrs if a.tcp_endpoint()}
        return conn.local_address[1] in ports

    def _addresses_changed(self) -> None:
        self.tracker.public_interface = has_public_interface(self.host.interface_addresses())
        keep = {a for a, _ in self.observed.candidates(self._loop.time())}
        keep |= {a.without_peer_id() for a in self.host.interface_addresses()}
        if self.tracker.forget(lambda a: a in keep):
            self._notify()
        self._next_probe = 0.0  # re-check now
        self._wake.set()

    def _known_addresses(self, peer: PeerID) -> list[Multiaddr]:
        out = list(self.relay_keeper.dht_relays.get(peer, []))
        info = self.peers.get(peer)
        if info is not None:
            out += [a for a in info.addrs if a.is_direct_tcp]
        return out

    def _punch_addresses(self) -> list[Multiaddr]:
        self._refresh_observations()
        now = self._loop.time()
        return list(dict.fromkeys([*self.tracker.confirmed(), *self.observed.best_guess(now)]))

    async def _punch(self, conn: Connection) -> None:
        await self.puncher.punch(conn)
        self._notify()

    # --- the loop -------------------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            now = self._loop.time()
            waits = [self.config.recheck_interval]
            # While we do not know, ask several servers at once: one slow one must not
            # hold the answer back (each failure alone decides nothing anyway).
            parallel = PARALLEL_PROBES if self.reachability is Reachability.UNKNOWN else 1
            if self.tracker.forced is None and len(self._probing) < parallel:
                if now >= self._next_probe:
                    while len(self._probing) < parallel and self._start_probe():
                        pass
                    if not self._probing:  # nobody to ask: look again soon
                        self._next_probe = now + self.config.recheck_unknown
                if self._next_probe > now:
                    waits.append(self._next_probe - now)
                # (else: probes are out; their ends wake this loop)
            waits.append(self.relay_keeper.manage_relays(now))
            waits.append(self.relay_keeper.manage_directory(now))
            self._wake.clear()
            try:
                async with asyncio.timeout(max(0.05, min(waits))):
                    await self._wake.wait()
            except TimeoutError:
                pass

    def _start_probe(self) -> bool:
        now = self._loop.time()
        servers = []
        for peer, conn in self.host.connections.items():
            info = self.peers.get(peer)
            if conn.kind == "relayed" or info is None or autonat.PROTOCOL not in info.protocols:
                continue
            if over_lan(conn, self.lan_neighbours):
                continue  # it would dial us back on the LAN: no proof the internet can
            if peer not in self._probing:
                servers.append((self._probed_at.get(peer, -1e18), peer, conn))
        if not servers:
            return False
        servers.sort(key=lambda s: s[0])
        _, peer, conn = servers[0]
        if len(self._probed_at) > 4096:  # bounded: keep the connected peers only
            self._probed_at = {p: t for p, t in self._probed_at.items() if p in self.peers}
        self._probed_at[peer] = now
        self._probing.add(peer)
        self._tasks.spawn(self._probe(conn))
        return True

    def _refresh_observations(self) -> None:
        """Renew the votes of observers we are still connected to (identify ran once, when
        the connection opened; the view it gave holds while the connection does)."""
        now = self._loop.time()
        for conn, info in list(self.identify.infos.items()):
            if conn.is_open and info.observed is not None and self._counts_as_observation(conn):
                self.observed.record(conn.remote_peer, info.observed, now)

    async def _probe(self, conn: Connection) -> None:
        result: ProbeResult | None = None
        try:
            self._refresh_observations()
            now = self._loop.time()
            addrs = []
            seen = self.observed.observed_by(conn.remote_peer, now)
            if seen is not None:
                addrs.append(seen)
            addrs += [a for a, _ in self.observed.candidates(now)]
            addrs += [
                a.without_peer_id() for a in self.host.interface_addresses() if not a.is_unspecified
            ]
            result = await self.autonat.probe(conn, addrs)
        finally:
            self._probing.discard(conn.remote_peer)
            now = self._loop.time()
            if result is None:
                # Try another server soon, backing off while none will answer.
                self._unanswered += 1
                delay = min(self.config.recheck_unknown, 0.5) * 2 ** min(self._unanswered, 10)
                self._next_probe = now + min(delay, self.config.recheck_interval)
            else:
                self._unanswered = 0
                before = self.reachability
                if self.tracker.record(result):
                    self._notify()
                if self.reachability is not before:
                    # Once per change, with the evidence: which servers said what.
                    log.info(
                        "reachability: %s -> %s (%s)",
                        before.value,
                        self.reachability.value,
                        self.tracker.reason,
                    )
                self._next_probe = now + self.tracker.next_delay()
            self._wake.set()
