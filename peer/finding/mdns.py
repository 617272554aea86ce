"""mDNS: find the peers of the same network on the local link, and be found (zeroconf).

Each peer registers a service of type `_shoal._udp.local.` under a random
instance name (libp2p's mDNS spec: the name says nothing about the peer), its
TXT record carrying its peer ID (`id`), its network (`net`), whether it has
finished starting (`s`, 0 or 1) and up to `MAX_ADDRS` addresses (`a0`, `a1`,
...). Peers browse for that type and read each announcement they hear.

An announcement is a claim by anyone on the link: it is size-checked and
parsed strictly (`parse_announcement`), kept only for our own network, and
what it yields is addresses carrying the claimed /p2p/ID, so the dial that
follows succeeds only if the handshake authenticates that very peer. The
peers kept, the properties read and the lookups in flight are bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

from shoal.transport.identity import PeerID
from shoal.transport.multiaddr import Multiaddr, MultiaddrError

__all__ = [
    "SERVICE_TYPE",
    "MdnsDiscovery",
    "MdnsPeer",
    "announcement",
    "parse_announcement",
]

log = logging.getLogger("shoal.peer.mdns")

SERVICE_TYPE: Final = "_shoal._udp.local."
MAX_ADDRS: Final = 8
MAX_PROPERTIES: Final = 16  # id, net, s, a0..a7 and room for a later key
MAX_VALUE_LEN: Final = 255  # one TXT string
MAX_PEERS: Final = 64  # peers remembered from mDNS
MAX_LOOKUPS_IN_FLIGHT: Final = 8
LOOKUP_TIMEOUT_MS: Final = 2000


@dataclass(frozen=True, slots=True)
class MdnsPeer:
    peer_id: PeerID
    addrs: tuple[Multiaddr, ...]  # each ends in /p2p/<peer_id>
    settled: bool  # past its start-up: it already hosts or trains (or serves the DHT)


def announcement(
    peer_id: PeerID, network: str, addrs: Sequence[Multiaddr], settled: bool
) -> dict[str, str]:
    """The TXT properties announcing this peer."""
    props = {"id": peer_id.to_base58(), "net": network, "s": "1" if settled else "0"}
    for i, addr in enumerate(addrs[:MAX_ADDRS]):
        props[f"a{i}"] = str(addr.without_peer_id())
    return props


def parse_announcement(
    properties: dict[bytes, bytes | None], network: str
) -> tuple[MdnsPeer | None, str]:
    """(the peer an announcement describes, or None; why not, when None)."""
    if len(properties) > MAX_PROPERTIES:
        return None, f"{len(properties)} TXT properties (limit {MAX_PROPERTIES})"
    text: dict[str, str] = {}
    for key, value in properties.items():
        if value is None or len(key) > 8 or len(value) > MAX_VALUE_LEN:
            continue
        try:
            text[key.decode("ascii")] = value.decode("ascii")
        except UnicodeDecodeError:
            return None, "a TXT property that is not ASCII"
    if text.get("net") != network:
        return None, f"network {text.get('net', '')[:64]!r}, not ours"
    try:
        peer = PeerID.from_base58(text.get("id", ""))
    except ValueError:
        return None, "no valid peer ID"
    addrs: list[Multiaddr] = []
    for i in range(MAX_ADDRS):
        raw = text.get(f"a{i}")
        if raw is None:
            continue
        try:
            addr = Multiaddr(raw)
        except MultiaddrError as e:
            log.debug("mDNS: %s announced a bad address: %s", peer.short(), e.reason)
            continue
        if not addr.is_direct_tcp or addr.peer_id not in (None, peer):
            continue  # only direct addresses of the announcing peer itself
        addrs.append(addr.with_peer_id(peer))
    if not addrs:
        return None, "no address to dial"
    return MdnsPeer(peer, tuple(dict.fromkeys(addrs)), text.get("s") == "1"), ""


def _service_info(
    instance: str, peer_id: PeerID, network: str, addrs: Sequence[Multiaddr], settled: bool
) -> Any:
    from zeroconf.asyncio import AsyncServiceInfo

    endpoints = [e for e in (a.tcp_endpoint() for a in addrs) if e is not None]
    ips = [socket.inet_aton(ip) for ip, _ in endpoints if ":" not in ip]
    return AsyncServiceInfo(
        SERVICE_TYPE,
        f"{instance}.{SERVICE_TYPE}",
        addresses=ips,
        port=endpoints[0][1] if endpoints else 0,
        properties=announcement(peer_id, network, addrs, settled),
        server=f"{instance}.local.",
    )


class MdnsDiscovery:
    """Announce this peer (when `addrs` gives any) and collect the peers heard.

    `interfaces`: the IPs of the interfaces to use (None: all of them);
    `on_peer(peer)`: called for each peer heard (first time, or with new addresses).
    """

    def __init__(
        self,
        peer_id: PeerID,
        network: str,
        *,
        addrs: Callable[[], list[Multiaddr]] = list,
        interfaces: Sequence[str] | None = None,
        on_peer: Callable[[MdnsPeer], None] | None = None,
    ) -> None:
        self.peer_id = peer_id
        self.network = network
        self.found: dict[PeerID, MdnsPeer] = {}
        self.rejected = 0
        self._addrs = addrs
        self._interfaces = list(interfaces) if interfaces is not None else None
        self._on_peer = on_peer
        self._instance = secrets.token_hex(16)
        self._zc: Any = None
        self._browser: Any = None
        self._info: Any = None
        self._registering: Any = None
        self._lookups: set[asyncio.Task[None]] = set()
        self._heard = asyncio.Event()

    async def start(self) -> None:
        from zeroconf import InterfaceChoice, IPVersion
        from zeroconf.asyncio import AsyncServiceBrowser, AsyncZeroconf

        interfaces = InterfaceChoice.All if self._interfaces is None else self._interfaces
        self._zc = AsyncZeroconf(interfaces=interfaces, ip_version=IPVersion.V4Only)
        addrs = self._addrs()
        if addrs:
            self._info = _service_info(self._instance, self.peer_id, self.network, addrs, False)
            # Probing and announcing go on in this task (about a second): held, or the
            # collector may take it, and awaited before the record changes.
            self._registering = await self._zc.async_register_service(self._info)
        self._browser = AsyncServiceBrowser(
            self._zc.zeroconf, SERVICE_TYPE, handlers=[self._on_change]
        )

    async def settled(self) -> None:
        """Say that this peer has finished starting (a newcomer then joins it)."""
        if self._zc is None or self._info is None:
            return
        try:
            if self._registering is not None:
                await self._registering
            self._info = _service_info(
                self._instance, self.peer_id, self.network, self._addrs() or [], True
            )
            await (await self._zc.async_update_service(self._info))
            log.info("mDNS: announced that this peer is up")
        except Exception as e:  # still announced, as starting: newcomers tie-break by ID
            log.info("mDNS: could not announce that this peer is up: %r", e)

    async def wait_for_peer(self, timeout: float) -> bool:
        """Whether a peer was heard within `timeout` seconds (at once if one was)."""
        if not self.found:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._heard.wait()
        return bool(self.found)

    def _on_change(self, *, zeroconf: Any, service_type: str, name: str, state_change: Any) -> None:
        from zeroconf import ServiceStateChange

        if state_change is ServiceStateChange.Removed:
            return  # a dead peer's addresses fail to dial; the DHT forgets it
        if name == f"{self._instance}.{SERVICE_TYPE}" or len(name) > 255:
            return
        if len(self._lookups) >= MAX_LOOKUPS_IN_FLIGHT:
            return  # a flood of names: the next announcement is heard again
        loop = asyncio.get_running_loop()
        task = loop.create_task(self._lookup(name))
        self._lookups.add(task)
        task.add_done_callback(self._lookups.discard)

    async def _lookup(self, name: str) -> None:
        from zeroconf.asyncio import AsyncServiceInfo

        info = AsyncServiceInfo(SERVICE_TYPE, name)
        try:
            if not await info.async_request(self._zc.zeroconf, LOOKUP_TIMEOUT_MS):
                return
        except Exception as e:  # a malformed record zeroconf refused
            log.debug("mDNS: no answer for %s: %r", name[:80], e)
            return
        peer, why = parse_announcement(info.properties or {}, self.network)
        if peer is None:
            self.rejected += 1
            log.debug("mDNS: %s ignored: %s", name[:80], why)
            return
        if peer.peer_id == self.peer_id:
            return
        known = self.found.get(peer.peer_id)
        if known == peer or (known is None and len(self.found) >= MAX_PEERS):
            return
        self.found[peer.peer_id] = peer
        log.info(
            "mDNS: found %s (%s) at %s",
            peer.peer_id.short(),
            "up" if peer.settled else "starting",
            ", ".join(map(str, peer.addrs)),
        )
        self._heard.set()
        if self._on_peer is not None:
            self._on_peer(peer)

    async def aclose(self) -> None:
        for task in list(self._lookups):
            task.cancel()
        if self._browser is not None:
            with contextlib.suppress(Exception):
                await self._browser.async_cancel()
        if self._registering is not None:
            self._registering.cancel()
        if self._zc is not None:
            with contextlib.suppress(Exception):
                if self._info is not None:
                    await self._zc.async_unregister_service(self._info)
            await self._zc.async_close()
            self._zc = None
