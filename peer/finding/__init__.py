"""Finding a first peer without being handed an address: named networks, `/dnsaddr/`, mDNS.

`find_bootstrap` turns the configuration into addresses to join through:
--bootstrap when given, else the bootstrap list of the --network (shipped, or
the user's --networks file), each `/dnsaddr/` name resolved from DNS. mDNS
(`mdns.py`) finds peers of the same network on the local link; `mdns_interfaces`
says where it runs for an --mdns setting.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shoal.transport.dnsaddr import DnsaddrName, DnsaddrResult, resolve_dnsaddr
from shoal.transport.identity import PeerID
from shoal.transport.multiaddr import Multiaddr

from .mdns import MdnsDiscovery
from .networks import DEFAULT_NETWORK, BootstrapEntry, NetworkError, load_networks

__all__ = [
    "DEFAULT_NETWORK",
    "MDNS_FIRST_WAIT",
    "Found",
    "browse_mdns",
    "find_bootstrap",
    "mdns_interfaces",
    "resolve_entries",
]

MDNS_FIRST_WAIT = 2.5  # a peer with no way in listens this long for LAN peers


@dataclass(slots=True)
class Found:
    """Where the bootstrap addresses came from, and what each step found."""

    network: str
    source: str  # "--bootstrap" (flag, variable or config file) or "network NAME"
    entries: list[str] = field(default_factory=list)
    addrs: list[Multiaddr] = field(default_factory=list)
    dnsaddr: list[DnsaddrResult] = field(default_factory=list)
    mdns: list[tuple[str, list[str]]] = field(default_factory=list)  # (peer ID, addresses)
    error: str | None = None  # the networks file or name was wrong
    mdns_on: bool = False  # whether mDNS was listened to
    mdns_error: str | None = None  # mDNS could not start (no multicast here)

    def as_json(self) -> dict[str, Any]:
        return {
            "network": self.network,
            "source": self.source,
            "entries": self.entries,
            "addrs": [str(a) for a in self.addrs],
            "dnsaddr": [r.as_json() for r in self.dnsaddr],
            "mdns": [{"peer": p, "addrs": a} for p, a in self.mdns],
            "error": self.error,
            "mdns_on": self.mdns_on,
            "mdns_error": self.mdns_error,
        }


async def resolve_entries(
    entries: Sequence[BootstrapEntry], nameservers: Sequence[tuple[str, int]] = ()
) -> tuple[list[Multiaddr], list[DnsaddrResult]]:
    """Addresses for `entries`, in their order: a `/dnsaddr/` name's addresses where it
    stood (names resolved concurrently)."""
    names = [e for e in entries if isinstance(e, DnsaddrName)]
    results = await asyncio.gather(*(resolve_dnsaddr(n, nameservers=nameservers) for n in names))
    by_name = dict(zip(names, results, strict=True))
    addrs: list[Multiaddr] = []
    for entry in entries:
        addrs.extend(by_name[entry].addrs if isinstance(entry, DnsaddrName) else [entry])
    return list(dict.fromkeys(addrs)), list(results)


async def find_bootstrap(
    bootstrap: Sequence[BootstrapEntry],
    network: str = DEFAULT_NETWORK,
    networks_file: Path | None = None,
    nameservers: Sequence[tuple[str, int]] = (),
) -> Found:
    """The addresses to join through: `bootstrap` (--bootstrap) when given, else the
    list of `network` (shipped, or from the user's `networks_file`)."""
    if bootstrap:
        found = Found(network, "--bootstrap", [str(e) for e in bootstrap])
        entries: Sequence[BootstrapEntry] = bootstrap
    else:
        found = Found(network, f"network {network}")
        try:
            known = load_networks(networks_file).get(network)
        except NetworkError as e:
            found.error = str(e)
            return found
        if known is None:
            # A network known by name only (a LAN's, found over mDNS): no list, no error.
            found.source += " (no list: neither shipped nor in --networks)"
            return found
        entries = known.bootstrap
        found.entries = [str(e) for e in entries]
    found.addrs, found.dnsaddr = await resolve_entries(entries, nameservers)
    return found


def mdns_interfaces(mode: str, listen: Sequence[Multiaddr]) -> list[str] | bool | None:
    """Where mDNS runs for --mdns `mode`: False (not at all), None (every interface) or
    the interface IPs. auto: the interfaces the peer listens on, none when that is
    loopback only (no LAN there); on: loopback too; an IP: that interface only."""
    if mode == "off":
        return False
    if mode not in ("auto", "on"):
        return [mode]
    ips = [e[0] for e in (a.tcp_endpoint() for a in listen) if e is not None]
    if not ips or any(ip in ("0.0.0.0", "::") for ip in ips):
        return None
    if all(ip.startswith("127.") or ip == "::1" for ip in ips):
        return ["127.0.0.1"] if mode == "on" else False
    return [ip for ip in ips if ":" not in ip and not ip.startswith("127.")] or None


async def browse_mdns(
    found: Found, me: PeerID, mode: str, wait: float, *, until_first: bool = False
) -> None:
    """Listen `wait` seconds (`until_first`: until a first peer) for peers of `found`'s
    network over mDNS (--mdns `mode`, on every interface for auto) without announcing;
    what is heard goes to `found.mdns`, and their addresses to `found.addrs`."""
    interfaces = mdns_interfaces(mode, [Multiaddr("/ip4/0.0.0.0/tcp/0")])
    if interfaces is False:
        return
    found.mdns_on = True
    mdns = MdnsDiscovery(me, found.network, interfaces=interfaces or None)
    try:
        await mdns.start()
        if until_first:
            await mdns.wait_for_peer(wait)
        else:
            await asyncio.sleep(wait)  # a report of everything heard in that time
    except Exception as e:  # no multicast here, no such interface
        found.mdns_error = repr(e)[:200]
    finally:
        await mdns.aclose()
    for peer in mdns.found.values():
        found.mdns.append((str(peer.peer_id), [str(a) for a in peer.addrs]))
        for addr in peer.addrs[:2]:
            if addr not in found.addrs:
                found.addrs.append(addr)
