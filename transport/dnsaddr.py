"""`/dnsaddr/` bootstrap names: resolved from DNS TXT records as libp2p specifies.

A name ``/dnsaddr/DOMAIN[/p2p/ID]`` stands for the addresses published as TXT
records at ``_dnsaddr.DOMAIN``, one ``dnsaddr=MULTIADDR`` per record; a value
may itself be a ``/dnsaddr/`` name (resolved in turn, to a depth limit). With
``/p2p/ID`` only addresses of that peer are kept.

A DNS answer is a claim by whoever answers (or spoofs) the query: the walk
bounds the names it looks up, the records it reads per answer, the addresses
it keeps and the nesting; a record that does not parse is skipped with a log
line. What it yields is only where to dial: the handshake then checks the
/p2p/ID of each address, so a lying record can waste a dial, never impersonate
a peer. `DnsaddrWalk` is the sans-I/O walk; `resolve_dnsaddr` drives it with
dnspython's asyncio resolver.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

from .identity import PeerID
from .multiaddr import Multiaddr, MultiaddrError

if TYPE_CHECKING:
    from dns.asyncresolver import Resolver

__all__ = [
    "DnsaddrName",
    "DnsaddrResult",
    "DnsaddrWalk",
    "is_dnsaddr",
    "parse_nameserver",
    "resolve_dnsaddr",
]

log = logging.getLogger("shoal.transport.dnsaddr")

PREFIX: Final = "/dnsaddr/"
TXT_PREFIX: Final = "dnsaddr="
MAX_DEPTH: Final = 4  # nested /dnsaddr/ names below the first (libp2p's lists use 1)
MAX_LOOKUPS: Final = 16  # DNS queries per resolution, all levels together
MAX_RECORDS: Final = 32  # TXT values read per answer; the rest are ignored
MAX_ADDRS: Final = 32  # addresses a resolution yields
MAX_VALUE_LEN: Final = 1024  # a TXT value (its strings joined); multiaddrs are shorter
LOOKUP_TIMEOUT: Final = 3.0
RESOLVE_TIMEOUT: Final = 8.0

_LABEL: Final = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9])?")


class DnsaddrError(ValueError):
    """Not a valid `/dnsaddr/DOMAIN[/p2p/ID]` name."""


def is_dnsaddr(text: str) -> bool:
    return text.startswith(PREFIX)


def _check_domain(domain: str) -> None:
    if not domain or len(domain) > 253:
        raise DnsaddrError(f"bad DNS name {domain[:80]!r} (1..253 characters)")
    for label in domain.split("."):
        if not _LABEL.fullmatch(label):
            raise DnsaddrError(f"bad DNS name {domain!r} (label {label[:70]!r})")


@dataclass(frozen=True, slots=True)
class DnsaddrName:
    """``/dnsaddr/DOMAIN[/p2p/ID]``: a name that resolves to addresses."""

    domain: str
    peer_id: PeerID | None = None

    @classmethod
    def parse(cls, text: str) -> DnsaddrName:
        if len(text) > MAX_VALUE_LEN or not is_dnsaddr(text):
            raise DnsaddrError(f"not a /dnsaddr/ name: {text[:80]!r}")
        parts = text[len(PREFIX) :].split("/")
        domain = parts[0]
        _check_domain(domain)
        if len(parts) == 1:
            return cls(domain)
        if len(parts) == 3 and parts[1] == "p2p":
            try:
                return cls(domain, PeerID.from_base58(parts[2]))
            except ValueError:
                raise DnsaddrError(f"bad peer ID in {text[:120]!r}") from None
        raise DnsaddrError(f"expected /dnsaddr/DOMAIN or /dnsaddr/DOMAIN/p2p/ID, got {text!r}")

    def __str__(self) -> str:
        tail = "" if self.peer_id is None else f"/p2p/{self.peer_id.to_base58()}"
        return f"{PREFIX}{self.domain}{tail}"

    @property
    def query_name(self) -> str:
        return f"_dnsaddr.{self.domain}"


@dataclass(slots=True)
class DnsaddrResult:
    """What a resolution found: addresses, and a line per thing it skipped or failed on."""

    name: DnsaddrName
    addrs: list[Multiaddr] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def as_json(self) -> dict[str, object]:
        return {
            "name": str(self.name),
            "addrs": [str(a) for a in self.addrs],
            "problems": list(self.problems),
        }


class DnsaddrWalk:
    """The sans-I/O resolution of one name: which DNS name to ask next, and what the
    answers add. Breadth first; every bound of the module docstring applies."""

    def __init__(self, name: DnsaddrName) -> None:
        self.result = DnsaddrResult(name)
        self._wanted = name.peer_id
        self._queue: deque[tuple[DnsaddrName, int]] = deque([(name, 0)])
        self._asked: set[str] = set()
        self.lookups = 0

    def next_query(self) -> tuple[DnsaddrName, int] | None:
        """The next (name, depth) to look up, or None when the walk is over."""
        while self._queue and len(self.result.addrs) < MAX_ADDRS:
            name, depth = self._queue.popleft()
            key = name.domain.lower()
            if key in self._asked:
                continue  # a loop, or two records naming one domain: asked once
            if self.lookups >= MAX_LOOKUPS:
                self._skip(f"{name}: not looked up (more than {MAX_LOOKUPS} lookups)")
                self._queue.clear()
                return None
            self._asked.add(key)
            self.lookups += 1
            return name, depth
        return None

    def failed(self, name: DnsaddrName, reason: str) -> None:
        self._skip(f"{name}: {reason}")

    def answer(self, name: DnsaddrName, depth: int, values: Iterable[bytes]) -> None:
        """The TXT values of `_dnsaddr.DOMAIN` (each value's strings already joined)."""
        for i, raw in enumerate(values):
            if i >= MAX_RECORDS:
                self._skip(f"{name}: records past the first {MAX_RECORDS} ignored")
                return
            self._record(name, depth, raw)

    def _record(self, name: DnsaddrName, depth: int, raw: bytes) -> None:
        if len(raw) > MAX_VALUE_LEN:
            self._skip(f"{name}: a record of {len(raw)} bytes skipped (limit {MAX_VALUE_LEN})")
            return
        try:
            text = raw.decode("ascii")
        except UnicodeDecodeError:
            self._skip(f"{name}: a record that is not ASCII skipped")
            return
        if not text.startswith(TXT_PREFIX):
            return  # another use of the TXT name (libp2p: ignore it, silently)
        value = text[len(TXT_PREFIX) :]
        if is_dnsaddr(value):
            self._nested(name, depth, value)
            return
        try:
            addr = Multiaddr(value)
        except MultiaddrError as e:
            # Also the transports shoal does not speak (/udp/.../quic-v1 in libp2p's lists).
            self._skip(f"{name}: record skipped: {e.reason}", level=logging.DEBUG)
            return
        if not (addr.is_direct_tcp or addr.is_relayed):
            self._skip(f"{name}: {addr} skipped: not an address to dial")
            return
        if self._wanted is not None and addr.peer_id != self._wanted:
            return  # another peer's address: the /p2p/ filter of the name
        if addr not in self.result.addrs and len(self.result.addrs) < MAX_ADDRS:
            self.result.addrs.append(addr)

    def _nested(self, name: DnsaddrName, depth: int, value: str) -> None:
        try:
            inner = DnsaddrName.parse(value)
        except DnsaddrError as e:
            self._skip(f"{name}: record skipped: {e}")
            return
        if depth + 1 > MAX_DEPTH:
            self._skip(f"{name}: {inner} not followed (nested deeper than {MAX_DEPTH})")
            return
        wanted = self._wanted
        if inner.peer_id is not None and wanted is not None and inner.peer_id != wanted:
            return  # names another peer
        self._queue.append((inner, depth + 1))

    def _skip(self, line: str, level: int = logging.INFO) -> None:
        log.log(level, "dnsaddr %s", line)
        if len(self.result.problems) < MAX_RECORDS:
            self.result.problems.append(line)


def parse_nameserver(text: str) -> tuple[str, int]:
    """`IP` or `IP:PORT` (`[IPv6]:PORT`) of a DNS server; ValueError when malformed."""
    import ipaddress

    text = text.strip()
    host, port = text, 53
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        if rest:
            if not rest.startswith(":"):
                raise ValueError(f"bad DNS server {text!r}")
            port = int(rest[1:])
    elif text.count(":") == 1:
        host, _, port_text = text.partition(":")
        port = int(port_text)
    ipaddress.ip_address(host)  # a name would itself need a resolver
    if not 0 < port < 65536:
        raise ValueError(f"bad port in DNS server {text!r}")
    return host, port


def _resolver(nameservers: Sequence[tuple[str, int]]) -> Resolver:
    import dns.asyncresolver
    import dns.nameserver

    if not nameservers:
        return dns.asyncresolver.Resolver()  # the system's (/etc/resolv.conf)
    resolver = dns.asyncresolver.Resolver(configure=False)
    resolver.nameservers = [dns.nameserver.Do53Nameserver(ip, port) for ip, port in nameservers]
    return resolver


async def _txt_values(resolver: Resolver, query: str) -> list[bytes]:
    import dns.exception
    import dns.resolver

    try:
        answer = await resolver.resolve(query, "TXT", lifetime=LOOKUP_TIMEOUT, search=False)
    except dns.resolver.NXDOMAIN:
        raise LookupError("no such name") from None
    except dns.resolver.NoAnswer:
        return []
    except dns.exception.Timeout:
        raise LookupError("DNS timed out") from None
    except dns.exception.DNSException as e:
        raise LookupError(f"DNS failed: {type(e).__name__}") from None
    return [b"".join(rdata.strings) for rdata in answer]


async def resolve_dnsaddr(
    name: DnsaddrName,
    *,
    nameservers: Sequence[tuple[str, int]] = (),
    timeout: float = RESOLVE_TIMEOUT,
) -> DnsaddrResult:
    """The addresses behind `name` (never raises for what DNS says; see `.problems`).
    `nameservers`: (IP, port) of the DNS servers to ask; empty: the system's."""
    walk = DnsaddrWalk(name)
    try:
        resolver = _resolver(nameservers)
    except Exception as e:  # no /etc/resolv.conf, or one dnspython cannot read
        walk.failed(name, f"no DNS resolver: {type(e).__name__}: {e}"[:200])
        return walk.result
    try:
        async with asyncio.timeout(timeout):
            while (query := walk.next_query()) is not None:
                current, depth = query
                try:
                    values = await _txt_values(resolver, current.query_name)
                except LookupError as e:
                    walk.failed(current, str(e))
                    continue
                walk.answer(current, depth, values)
    except TimeoutError:
        walk.failed(name, f"resolution took longer than {timeout:.0f} s; kept what was found")
    return walk.result
