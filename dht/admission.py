"""Who gets in, and how much: IP diversity, request rate limits. No I/O.

An attacker can make peer IDs for free (an Ed25519 key is microseconds, and
grinding 16 bits of a node ID next to a key is a minute of CPU), but network
addresses cost money. So the DHT counts IP *groups* (the /24 of an IPv4
address, the /48 of an IPv6 one, about what one customer or one rented server
block gets) and bounds what any group may take:

- routing tables keep at most `per_group_bucket` contacts of a group per bucket
  and `per_group_table` in the whole table (`RoutingTable`);
- a lookup gives a group at most `per_group_lookup` of its `k` closest
  candidates (its beam), more only for slots no other group could fill, so
  Sybils ground next to a key and answering each other take a few slots and
  the honest peers behind them are still asked; the
  replicas of a store are picked the same way, and the early stop of a value
  lookup counts holders by group, not by peer;
- storage quotas per origin peer and group (`LocalStorage`), and request rate
  limits per peer, IP and group (`RequestAdmission`).

Loopback, private (RFC 1918, unique-local) and link-local addresses are exempt
by default: a LAN swarm, a container network or the loopback tests are one
group by nature, and an attacker on the public network cannot be reached there.
`DiversityPolicy(exempt=())` counts them too.
"""

from __future__ import annotations

import functools
import ipaddress
from collections.abc import Callable, Hashable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Final, TypeVar

from shoal.transport.admission import subnet_of
from shoal.transport.multiaddr import Multiaddr
from shoal.transport.ratelimit import KeyedBuckets

__all__ = [
    "DEFAULT_EXEMPT",
    "NO_DIVERSITY",
    "DiversityPolicy",
    "RateLimits",
    "RequestAdmission",
    "diverse",
    "ip_group",
]

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

DEFAULT_EXEMPT: Final[tuple[IPNetwork, ...]] = tuple(
    ipaddress.ip_network(n)
    for n in (
        "127.0.0.0/8",
        "10.0.0.0/8",
        "172.16.0.0/12",
        "192.168.0.0/16",
        "169.254.0.0/16",
        "::1/128",
        "fc00::/7",
        "fe80::/10",
    )
)

T = TypeVar("T")


def ip_group(ip: str, exempt: tuple[IPNetwork, ...] = DEFAULT_EXEMPT) -> str | None:
    """The group of an IP address ("198.51.100.0/24", "2001:db8:1::/48"), or None
    when it is exempt from diversity limits or not an IP address at all."""
    if exempt is DEFAULT_EXEMPT:
        return _default_group(ip)  # (hashing the networks per call costs more than the rest)
    return _group(ip, exempt)


@functools.lru_cache(maxsize=65536)
def _default_group(ip: str) -> str | None:
    return _group(ip, DEFAULT_EXEMPT)


@functools.lru_cache(maxsize=4096)
def _group(ip: str, exempt: tuple[IPNetwork, ...]) -> str | None:
    try:
        addr = ipaddress.ip_address(ip.split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    if any(addr in net for net in exempt if net.version == addr.version):
        return None
    return subnet_of(str(addr))  # (the same /24 or /48 as the host's admission limits)


@dataclass(frozen=True, slots=True)
class DiversityPolicy:
    """How many contacts, beam slots and replicas one IP group may take.

    Defaults: 2 per bucket (of 20) and 10 per table, after the S/Kademlia and
    libp2p practice of "a few"; 2 per lookup beam, so 200 Sybils in one /24
    hold 2 of the 20 candidates a lookup converges on and 2 of 20 replicas.
    """

    per_group_bucket: int = 2
    per_group_table: int = 10
    per_group_lookup: int = 2
    exempt: tuple[IPNetwork, ...] = DEFAULT_EXEMPT
    enabled: bool = True

    def __post_init__(self) -> None:
        if min(self.per_group_bucket, self.per_group_table, self.per_group_lookup) < 1:
            raise ValueError("diversity limits must be >= 1")

    def group_of_ip(self, ip: str | None) -> str | None:
        if not self.enabled or ip is None:
            return None
        return ip_group(ip, self.exempt)

    def group_of_addrs(self, addrs: Iterable[Multiaddr]) -> str | None:
        """The group of the first direct IP address in `addrs` (the one dialed first)."""
        if not self.enabled:
            return None
        for addr in addrs:
            proto, value = addr.components[0]
            if proto in ("ip4", "ip6") and value is not None and not addr.is_relayed:
                return ip_group(value, self.exempt)
        return None

    @property
    def lookup_cap(self) -> int | None:
        """The per-group cap of a lookup's beam and replica set (None: no cap)."""
        return self.per_group_lookup if self.enabled else None


NO_DIVERSITY: Final = DiversityPolicy(enabled=False)


def diverse(
    items: Iterable[T],
    cap: int | None,
    group_of: Callable[[T], str | None],
    count: int,
    *,
    fill: bool = False,
) -> list[T]:
    """The first `count` of `items` (in their order) taking at most `cap` per group.

    Items of group None are never capped (exempt addresses, relayed peers).
    `fill`: when fewer than `count` pass the cap, the closest of the others fill
    the rest, after them: a cap then only ever replaces a candidate by one of
    another group, never leaves a slot empty (a small network in one /24 is
    still searched in full).
    """
    out: list[T] = []
    if cap is None:
        for item in items:
            if len(out) >= count:
                break
            out.append(item)
        return out
    taken: dict[str, int] = {}
    over: list[T] = []
    for item in items:
        if len(out) >= count:
            break
        group = group_of(item)
        if group is not None:
            n = taken.get(group, 0)
            if n >= cap:
                if fill and len(over) < count:
                    over.append(item)
                continue
            taken[group] = n + 1
        out.append(item)
    if fill:
        out.extend(over[: count - len(out)])
    return out


def distinct_groups(groups: Iterator[tuple[Hashable, str | None]]) -> int:
    """How many distinct origins in (peer, group) pairs: a group counts once, a
    peer without a group counts by itself."""
    return len({group if group is not None else ("peer", peer) for peer, group in groups})


# ---------------------------------------------------------------- request rate limits


@dataclass(frozen=True, slots=True)
class RateLimits:
    """Requests per second (and bursts) one peer, one IP and one IP group may make.

    Defaults leave honest use far below them: a lookup asks one peer once, a
    busy peer asks a given peer a few times a second; the loaded benchmark (80
    operations in flight across 64 nodes) sends one node about 30 requests per
    second in all. IP and group limits apply only to non-exempt addresses (on a
    LAN or loopback, many honest peers share an IP).
    """

    per_peer: float = 100.0
    peer_burst: float = 400.0
    per_ip: float = 200.0
    ip_burst: float = 800.0
    per_group: float = 400.0
    group_burst: float = 1600.0
    # Told to a throttled requester: ask again after this many seconds.
    retry_after: float = 1.0
    max_keys: int = 4096


@dataclass
class RequestAdmission:
    """Token buckets per peer, IP and group; `admit` decides one request."""

    limits: RateLimits = field(default_factory=RateLimits)
    diversity: DiversityPolicy = field(default_factory=DiversityPolicy)

    def __post_init__(self) -> None:
        lim = self.limits
        self._peers = KeyedBuckets(lim.per_peer, lim.peer_burst, max_keys=lim.max_keys)
        self._ips = KeyedBuckets(lim.per_ip, lim.ip_burst, max_keys=lim.max_keys)
        self._groups = KeyedBuckets(lim.per_group, lim.group_burst, max_keys=lim.max_keys)
        self.refused = 0

    def admit(self, peer: Hashable, ip: str | None, now: float) -> bool:
        """Whether to answer a request from `peer` at observed `ip` now.

        Every limit is checked even after one refused, so a flood spends the
        tokens of all its keys (a peer cannot hide behind a fresh IP's burst).
        """
        ok = self._peers.take(peer, now)
        group = ip_group(ip, self.diversity.exempt) if ip is not None else None
        if group is not None:  # not exempt: count the IP and its group too
            ok = self._ips.take(ip, now) and ok
            ok = self._groups.take(group, now) and ok
        if not ok:
            self.refused += 1
        return ok
