"""Which inbound connections a host accepts, sans I/O: slots for handshakes apart.

A connection costs a slot from `connection_made` on, before anyone knows who is
on the other end. When half-open (handshaking) connections shared the 1,024
slots with authenticated ones, an attacker holding 32 IPs x 32 silent sockets,
renewed every 10 s handshake timeout, kept honest peers out. So:

- Half-open inbound connections have slots of their own: `max_pending` in all,
  `max_pending_per_ip` per address and `max_pending_per_subnet` per /24 (IPv4)
  or /48 (IPv6). When every half-open slot is taken, a newcomer from a subnet
  holding fewer half-open slots than the most crowded one takes the oldest of
  that subnet's; one from (one of) the most crowded subnets is refused. So an
  honest peer from another subnet always gets its handshake started, and a
  flood mostly meets refusals, which cost no handshake work. Over a per-IP or
  per-subnet cap the newcomer is refused: the attacker's own addresses pay.
- Established connections keep the caps they had (`max_connections` in all,
  `max_connections_per_ip`) plus `max_connections_per_subnet`.
- Outbound connections (we dialed) are never refused here, and half-open
  inbound ones do not count against our dials.
- Loopback addresses are exempt from the new caps (half-open ones, per subnet)
  when `exempt_loopback` (tests run whole swarms on 127.0.0.1); the per-IP cap
  on established connections applies to them as before.
- At `max_connections`, an inbound connection used to be refused before its
  handshake, since nobody knew yet who was dialing. But a round's members, which
  the host protects from trimming (`Host.protecting`), were refused like anyone
  else: in a simulated 256-peer burst with a limit of 96, about a third of the
  aborts that named a live member were a member refused at the limit. So at the
  limit `max_pending_at_limit` half-open connections (on top of the caps above,
  one per IP, the same subnet rule when they are all taken) still get their
  handshake, and `established` lets one in past the limit only if its
  authenticated peer is protected; the others are refused then. The reserve
  bounds the handshake work a flood at the limit can force, which refusing up
  front bounded before; a host holds at most `max_connections` plus its rounds'
  members.

`Admission` holds only counts keyed by an opaque connection key; the Host calls
`admit` at connection_made, `established` when the handshake finishes and
`closed` when the connection ends, and aborts whatever `admit` says to evict.
"""

from __future__ import annotations

import functools
import ipaddress
from collections import Counter, OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass

__all__ = ["Admission", "AdmissionLimits", "Verdict", "subnet_of"]


@dataclass(frozen=True, slots=True)
class AdmissionLimits:
    max_connections: int = 1024
    max_connections_per_ip: int = 32
    max_connections_per_subnet: int = 256
    max_pending: int = 256
    max_pending_per_ip: int = 16
    max_pending_per_subnet: int = 64
    exempt_loopback: bool = True
    # Established connections being closed (trimmed or idle) that no longer hold a slot:
    # at most this many (None: an eighth of max_connections, at least 8).
    max_draining: int | None = None
    # Half-open inbound connections let through at max_connections, each established
    # only if its peer is one the host protects (a round's member); 0: none.
    max_pending_at_limit: int = 8


@dataclass(frozen=True, slots=True)
class Verdict:
    refusal: str | None  # None: admitted
    evict: tuple[Hashable, ...] = ()  # half-open connections to drop for this one


PENDING, ESTABLISHED, EVICTED, DRAINING = "pending", "established", "evicted", "draining"


@dataclass(slots=True)
class _Entry:
    ip: str | None
    subnet: str | None
    inbound: bool
    exempt: bool
    state: str
    since: float
    at_limit: bool = False  # admitted past max_connections (`max_pending_at_limit`)


class _FairSlots:
    """Keys by subnet, oldest first, in a bounded number of slots. When all are taken,
    a newcomer from a subnet holding fewer than the most crowded one takes the oldest
    slot of that one; a newcomer from (one of) the most crowded subnets waits."""

    def __init__(self) -> None:
        self._by_subnet: dict[str | None, OrderedDict[Hashable, None]] = {}
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def victim(self, subnet: str | None) -> Hashable | None:
        """The key to evict for a newcomer from `subnet` (None: it waits instead)."""
        crowded = max(self._by_subnet.values(), key=len)
        if len(self._by_subnet.get(subnet, ())) + 1 > len(crowded):
            return None
        return next(iter(crowded))

    def add(self, key: Hashable, subnet: str | None) -> None:
        self._by_subnet.setdefault(subnet, OrderedDict())[key] = None
        self._count += 1

    def discard(self, key: Hashable, subnet: str | None) -> None:
        group = self._by_subnet.get(subnet)
        if group is not None and key in group:
            del group[key]
            self._count -= 1
            if not group:
                del self._by_subnet[subnet]


# (Both cached: every connection and every DHT contact asks, mostly about the same
# few addresses, and parsing one was 5% of a simulated 1,000-peer burst.)
@functools.lru_cache(maxsize=4096)
def subnet_of(ip: str) -> str | None:
    """The /24 (IPv4) or /48 (IPv6) an address is in; None if it is not an IP address."""
    try:
        addr = ipaddress.ip_address(ip.split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    prefix = 24 if addr.version == 4 else 48
    return str(ipaddress.ip_network(f"{addr}/{prefix}", strict=False))


@functools.lru_cache(maxsize=4096)
def _is_loopback(ip: str | None) -> bool:
    if ip is None:
        return False
    try:
        addr = ipaddress.ip_address(ip.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback


class Admission:
    """Counts of connections by state, address and subnet; decides admissions."""

    def __init__(self, limits: AdmissionLimits | None = None) -> None:
        self.limits = limits or AdmissionLimits()
        self._entries: dict[Hashable, _Entry] = {}
        # Half-open, not exempt: by subnet, oldest first (relayed ones under None).
        self._pending = _FairSlots()
        # Half-open ones admitted at the connection limit, exempt ones included.
        self._at_limit = _FairSlots()
        self._at_limit_ip: Counter[str] = Counter()
        self._per_ip: Counter[str] = Counter()  # every connection, any state
        self._per_subnet: Counter[str] = Counter()  # established inbound, not exempt
        self._pending_ip: Counter[str] = Counter()
        self._pending_subnet: Counter[str] = Counter()
        self.established_count = 0  # every connection not half-open inbound
        # Half-open loopback ones (exempt): they count against max_connections as before.
        self._exempt_pending = 0
        self.evicted = 0  # half-open connections dropped for newer ones
        self.draining_count = 0  # established ones closing, out of the count (`draining`)

    @property
    def pending(self) -> int:
        """Half-open inbound connections (handshaking)."""
        return len(self._pending)

    @property
    def pending_at_limit(self) -> int:
        """Half-open inbound connections admitted at the connection limit."""
        return len(self._at_limit)

    def connections_from(self, ip: str) -> int:
        return self._per_ip[ip]

    def admit(self, key: Hashable, ip: str | None, *, inbound: bool, now: float) -> Verdict:
        """A new connection from `ip` (None: relayed, the relay limits those)."""
        if key in self._entries:
            raise ValueError("connection admitted twice")
        lim = self.limits
        subnet = subnet_of(ip) if ip is not None else None
        exempt = lim.exempt_loopback and _is_loopback(ip)
        at_limit = False
        evict: list[Hashable] = []
        if inbound:
            refusal = self._refusal(ip, subnet, exempt)
            if refusal is not None:
                return Verdict(refusal)
            if not exempt and len(self._pending) >= lim.max_pending:
                oldest = self._pending.victim(subnet)
                if oldest is None:
                    # Its own subnet is (one of) the most crowded: it waits, not another.
                    return Verdict(f"handshake slots ({lim.max_pending}) full")
                evict.append(oldest)
            at_limit = self.established_count + self._exempt_pending >= lim.max_connections
            if at_limit:
                refusal, oldest = self._reserve(ip, subnet)
                if refusal is not None:
                    return Verdict(refusal)
                if oldest is not None and oldest not in evict:
                    evict.append(oldest)
            for oldest in evict:
                self._end_pending(oldest, EVICTED)  # counted nowhere until it closes
        self.evicted += len(evict)
        entry = _Entry(ip, subnet, inbound, exempt, PENDING if inbound else ESTABLISHED, now)
        entry.at_limit = at_limit
        self._entries[key] = entry
        if ip is not None:
            self._per_ip[ip] += 1
        if not inbound:
            self._add_established(entry)
            return Verdict(None)
        if exempt:
            self._exempt_pending += 1
        else:
            self._pending.add(key, subnet)
            if ip is not None:
                self._pending_ip[ip] += 1
                if subnet is not None:
                    self._pending_subnet[subnet] += 1
        if at_limit:
            self._at_limit.add(key, subnet)
            if ip is not None:
                self._at_limit_ip[ip] += 1
        return Verdict(None, tuple(evict))

    def _reserve(self, ip: str | None, subnet: str | None) -> tuple[str | None, Hashable | None]:
        """At the connection limit: a slot of `max_pending_at_limit` for a handshake
        whose peer may turn out to be protected (and the one it takes), or the refusal."""
        lim = self.limits
        full = f"connection limit ({lim.max_connections}) reached"
        if lim.max_pending_at_limit <= 0 or (ip is not None and self._at_limit_ip[ip] >= 1):
            return full, None
        if len(self._at_limit) < lim.max_pending_at_limit:
            return None, None
        oldest = self._at_limit.victim(subnet)
        return (full, None) if oldest is None else (None, oldest)

    def _refusal(self, ip: str | None, subnet: str | None, exempt: bool) -> str | None:
        lim = self.limits
        if ip is None:
            return None
        if self._per_ip[ip] >= lim.max_connections_per_ip:
            return f"per-IP connection limit ({lim.max_connections_per_ip}) reached"
        if exempt:
            return None
        if self._pending_ip[ip] >= lim.max_pending_per_ip:
            return f"per-IP handshake limit ({lim.max_pending_per_ip}) reached"
        if subnet is not None:
            if self._pending_subnet[subnet] >= lim.max_pending_per_subnet:
                return f"per-subnet handshake limit ({lim.max_pending_per_subnet}) reached"
            if self._per_subnet[subnet] >= lim.max_connections_per_subnet:
                return f"per-subnet connection limit ({lim.max_connections_per_subnet}) reached"
        return None

    def established(self, key: Hashable, *, protected: bool = False) -> str | None:
        """The connection's handshake finished; a refusal if the established slots
        filled up meanwhile (the caller closes it; `closed` still follows). A peer the
        host protects (`protected`: a round's member) gets in past the limit."""
        entry = self._entries.get(key)
        if entry is None or entry.state != PENDING:
            return None
        lim = self.limits
        refusal = None
        full = self.established_count >= lim.max_connections
        if full and (not entry.exempt or entry.at_limit) and not protected:
            refusal = f"connection limit ({lim.max_connections}) reached"
        elif (
            not entry.exempt
            and entry.subnet is not None
            and self._per_subnet[entry.subnet] >= lim.max_connections_per_subnet
        ):
            refusal = f"per-subnet connection limit ({lim.max_connections_per_subnet}) reached"
        self._end_pending(key, EVICTED if refusal else ESTABLISHED)
        if refusal is None:
            self._add_established(entry)
        return refusal

    @property
    def can_drain(self) -> bool:
        """Whether another closing connection may leave the established count."""
        lim = self.limits
        bound = lim.max_draining
        if bound is None:
            bound = max(8, lim.max_connections // 8)
        return self.draining_count < bound

    def draining(self, key: Hashable) -> None:
        """An established connection we are closing gracefully (trimmed, idle): it
        leaves the established count now, so that a newcomer takes its slot while it
        drains (streams in flight served, then its socket closes: seconds), rather
        than be refused. Within `max_draining` of them (`can_drain`), so the sockets
        open stay bounded; past that it keeps its slot until it closes."""
        entry = self._entries.get(key)
        if entry is None or entry.state != ESTABLISHED or not self.can_drain:
            return
        entry.state = DRAINING
        self._drop_established(entry)
        self.draining_count += 1

    def closed(self, key: Hashable) -> None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return
        if entry.state == PENDING:
            self._end_pending(key, EVICTED, entry)
        elif entry.state == ESTABLISHED:
            self._drop_established(entry)
        elif entry.state == DRAINING:
            self.draining_count -= 1
        if entry.ip is not None:
            _decrement(self._per_ip, entry.ip)

    def _end_pending(self, key: Hashable, state: str, entry: _Entry | None = None) -> None:
        entry = entry or self._entries[key]
        entry.state = state
        if entry.inbound and entry.exempt:
            self._exempt_pending -= 1
        self._pending.discard(key, entry.subnet)
        if entry.at_limit:
            entry.at_limit = False
            self._at_limit.discard(key, entry.subnet)
            if entry.ip is not None:
                _decrement(self._at_limit_ip, entry.ip)
        if entry.ip is not None and not entry.exempt:
            _decrement(self._pending_ip, entry.ip)
            if entry.subnet is not None:
                _decrement(self._pending_subnet, entry.subnet)

    def _add_established(self, entry: _Entry) -> None:
        self.established_count += 1
        if entry.inbound and not entry.exempt and entry.subnet is not None:
            self._per_subnet[entry.subnet] += 1

    def _drop_established(self, entry: _Entry) -> None:
        self.established_count -= 1
        if entry.inbound and not entry.exempt and entry.subnet is not None:
            _decrement(self._per_subnet, entry.subnet)


def _decrement(counter: Counter[str], key: str) -> None:
    counter[key] -= 1
    if counter[key] <= 0:
        del counter[key]
