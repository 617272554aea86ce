"""Multiaddrs: parse, format, validate and binary-encode peer addresses.

Our own implementation of the subset shoal speaks: ``/ip4``, ``/ip6``, ``/dns``,
``/dns4``, ``/dns6``, ``/tcp``, ``/p2p`` and ``/p2p-circuit``. Accepted shapes::

    /p2p/ID                                       peer known only by its ID
    /HOST/H/tcp/PORT[/p2p/ID]                     direct (HOST: ip4 ip6 dns dns4 dns6)
    [/HOST/H/tcp/PORT]/p2p/RELAY/p2p-circuit[/p2p/TARGET]   through a relay

Addresses arrive from the network, so input is size-checked before any work
and parsing is strict: every address has exactly one text spelling (no
trailing ``/``, no trailing dot in DNS names, no leading zeros in ports), which
keeps equality, deduplication and signed address records unambiguous.
"""

from __future__ import annotations

import functools
import ipaddress
import re
from collections.abc import Iterable, Iterator
from itertools import islice
from typing import Final

from .identity import PeerID

__all__ = [
    "MAX_BYTES_LEN",
    "MAX_COMPONENTS",
    "MAX_TEXT_LEN",
    "Multiaddr",
    "MultiaddrError",
    "from_socket_address",
    "parse_many",
]

# Far above anything valid (the longest valid address has 5 components and is
# well under 300 characters) yet small enough that hostile input is cheap.
MAX_TEXT_LEN: Final = 1024
MAX_BYTES_LEN: Final = 1024
MAX_COMPONENTS: Final = 16

# Standard multicodec codes (multiformats/multicodec table.csv).
_CODES: Final = {
    "ip4": 4,
    "tcp": 6,
    "ip6": 41,
    "dns": 53,
    "dns4": 54,
    "dns6": 55,
    "p2p-circuit": 290,
    "p2p": 421,
}
_NAMES: Final = {code: name for name, code in _CODES.items()}
_HOSTS: Final = ("ip4", "ip6", "dns", "dns4", "dns6")
_NO_VALUE: Final = frozenset({"p2p-circuit"})

_PORT_RE: Final = re.compile(r"0|[1-9][0-9]{0,4}")
_LABEL_RE: Final = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?")
_MAX_DNS_LEN: Final = 253
# Ed25519 IDs are 52 base58 characters / 38 bytes; the cap only bounds the
# base58 decoding (quadratic) done on hostile input.
_MAX_PEER_ID_TEXT: Final = 128
_MAX_PEER_ID_BYTES: Final = 128
_MAX_VARINT_BYTES: Final = 9  # multiformats unsigned-varint limit
_QUOTE_LIMIT: Final = 200

Component = tuple[str, str | None]
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


class MultiaddrError(ValueError):
    """An address that is not a valid shoal multiaddr; the message quotes it and the bad part."""

    def __init__(self, address: str, reason: str) -> None:
        super().__init__(f"invalid multiaddr {address}: {reason}")
        self.address = address  # already quoted (text) or hex (binary form)
        self.reason = reason


class _Invalid(Exception):
    """Internal: a reason, turned into MultiaddrError by the entry point that knows the address."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _quote_text(text: str) -> str:
    # Quote the whole address, except absurdly long hostile input: logs stay readable.
    if len(text) <= _QUOTE_LIMIT:
        return repr(text)
    return f"{text[:64]!r}... ({len(text)} characters)"


def _quote_bytes(data: bytes) -> str:
    if len(data) <= _QUOTE_LIMIT // 2:
        return f"bytes {data.hex()!r}"
    return f"bytes {data[:32].hex()!r}... ({len(data)} bytes)"


def _segment(proto: str, value: str | None) -> str:
    return f"/{proto}" if value is None else f"/{proto}/{value}"


# ---------------------------------------------------------------- values


def _normalize(proto: str, value: str) -> str:
    """The canonical text of a value, or _Invalid quoting it."""
    if proto == "ip4":
        try:
            return str(ipaddress.IPv4Address(value))
        except ValueError:
            raise _Invalid(f"bad IPv4 address {value!r}") from None
    if proto == "ip6":
        if "%" in value:
            raise _Invalid(f"bad IPv6 address {value!r} (zone IDs are not supported)")
        try:
            return str(ipaddress.IPv6Address(value))
        except ValueError:
            raise _Invalid(f"bad IPv6 address {value!r}") from None
    if proto == "tcp":
        if not _PORT_RE.fullmatch(value) or int(value) > 65535:
            raise _Invalid(f"bad TCP port {value!r} (decimal 0..65535, no sign or leading zeros)")
        return value
    if proto == "p2p":
        return _parse_peer_id(value).to_base58()
    # dns, dns4, dns6: kept as given (case included), only validated
    _check_dns_name(value)
    return value


def _check_dns_name(name: str) -> None:
    if len(name) > _MAX_DNS_LEN:
        raise _Invalid(f"bad DNS name {name!r} (longer than {_MAX_DNS_LEN} characters)")
    for label in name.split("."):
        if not label:
            # also rejects a trailing dot: one spelling per name
            raise _Invalid(f"bad DNS name {name!r} (empty label)")
        if not _LABEL_RE.fullmatch(label):
            raise _Invalid(
                f"bad DNS name {name!r} (label {label!r}: 1..63 letters, digits or '-', "
                "not starting or ending with '-')"
            )


def _parse_peer_id(text: str) -> PeerID:
    if len(text) > _MAX_PEER_ID_TEXT:
        raise _Invalid(f"bad peer ID {text!r} (too long)")
    try:
        return PeerID.from_base58(text)
    except ValueError:
        raise _Invalid(f"bad peer ID {text!r} (not a base58 Ed25519 peer ID)") from None


def _uvarint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if not n:
            out.append(byte)
            return bytes(out)
        out.append(byte | 0x80)


def _read_uvarint(data: bytes, pos: int) -> tuple[int, int]:
    value = 0
    for i in range(_MAX_VARINT_BYTES):
        if pos >= len(data):
            raise _Invalid(f"truncated varint at byte {pos}")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << (7 * i)
        if not byte & 0x80:
            # Non-minimal varints would give one address several encodings.
            if byte == 0 and i > 0:
                raise _Invalid(f"non-minimal varint ending at byte {pos - 1}")
            return value, pos
    raise _Invalid(f"varint longer than {_MAX_VARINT_BYTES} bytes at byte {pos}")


def _encode_value(proto: str, value: str | None) -> bytes:
    if value is None:
        return b""
    if proto == "ip4":
        return ipaddress.IPv4Address(value).packed
    if proto == "ip6":
        return ipaddress.IPv6Address(value).packed
    if proto == "tcp":
        return int(value).to_bytes(2, "big")
    raw = PeerID.from_base58(value).to_bytes() if proto == "p2p" else value.encode("ascii")
    return _uvarint(len(raw)) + raw


def _take(data: bytes, pos: int, size: int, proto: str) -> bytes:
    if size > len(data) - pos:
        raise _Invalid(f"truncated value for /{proto} (needs {size} bytes, {len(data) - pos} left)")
    return data[pos : pos + size]


def _decode_value(proto: str, data: bytes, pos: int) -> tuple[str | None, int]:
    if proto in _NO_VALUE:
        return None, pos
    if proto == "ip4":
        return str(ipaddress.IPv4Address(_take(data, pos, 4, proto))), pos + 4
    if proto == "ip6":
        return str(ipaddress.IPv6Address(_take(data, pos, 16, proto))), pos + 16
    if proto == "tcp":
        return str(int.from_bytes(_take(data, pos, 2, proto), "big")), pos + 2
    size, pos = _read_uvarint(data, pos)
    raw = _take(data, pos, size, proto)
    pos += size
    if proto == "p2p":
        if size > _MAX_PEER_ID_BYTES:
            raise _Invalid(f"bad peer ID bytes ({size} bytes)")
        try:
            return PeerID(raw).to_base58(), pos
        except ValueError:
            raise _Invalid(f"bad peer ID bytes {raw.hex()!r}") from None
    try:
        name = raw.decode("ascii")
    except UnicodeDecodeError:
        raise _Invalid(f"bad DNS name bytes {raw[:64].hex()!r} (not ASCII)") from None
    _check_dns_name(name)
    return name, pos


# ---------------------------------------------------------------- structure


def _check_structure(components: tuple[Component, ...]) -> None:
    """Raise _Invalid unless the components form one of the accepted shapes."""
    if not components:
        raise _Invalid("empty address")
    if len(components) > MAX_COMPONENTS:
        raise _Invalid(f"more than {MAX_COMPONENTS} components")
    # States: start -> host -> tcp -> peer -> circuit -> target
    state = "start"
    prev = ""
    for proto, value in components:
        seg = _segment(proto, value)
        if state == "start":
            if proto in _HOSTS:
                state = "host"
            elif proto == "p2p":
                state = "peer"
            elif proto == "tcp":
                raise _Invalid(f"{seg!r} must follow /ip4, /ip6, /dns, /dns4 or /dns6")
            else:
                raise _Invalid(f"{seg!r} must follow /p2p/RELAY_ID")
        elif state == "host":
            if proto != "tcp":
                raise _Invalid(f"missing /tcp after {prev!r} (got {seg!r})")
            state = "tcp"
        elif state == "tcp" and proto == "p2p":
            state = "peer"
        elif state == "peer" and proto == "p2p-circuit":
            state = "circuit"
        elif state == "circuit" and proto == "p2p":
            state = "target"
        elif proto == "p2p-circuit" and state in ("circuit", "target"):
            raise _Invalid(f"a second {seg!r} (relaying through relays is not supported)")
        elif proto == "p2p-circuit":
            raise _Invalid(f"{seg!r} must follow /p2p/RELAY_ID (got it after {prev!r})")
        else:
            raise _Invalid(f"unexpected {seg!r} after {prev!r}")
        prev = seg
    if state == "host":
        raise _Invalid(f"missing /tcp after {prev!r}")


def _parse_text(text: str) -> list[Component]:
    """Split and normalize text into components; no structure check (fragments allowed)."""
    if not isinstance(text, str):
        raise TypeError(f"multiaddr text must be str, not {type(text).__name__}")
    if len(text) > MAX_TEXT_LEN:
        raise _Invalid(f"longer than {MAX_TEXT_LEN} characters")
    if not text or text == "/":
        raise _Invalid("empty address")
    if text[0] != "/":
        raise _Invalid("must start with '/'")
    if text.count("/") > 2 * MAX_COMPONENTS:
        raise _Invalid(f"more than {MAX_COMPONENTS} components")
    parts = text[1:].split("/")
    if parts[-1] == "":
        raise _Invalid("trailing '/' (not part of the canonical form)")
    components: list[Component] = []
    i = 0
    while i < len(parts):
        proto = parts[i]
        if proto not in _CODES:
            if not proto:
                raise _Invalid(f"empty protocol name at component {len(components) + 1}")
            if components and components[-1][1] is not None:
                # e.g. /ip4/1.2.3.4/5.6.7.8: more likely an extra value than a protocol
                last = _segment(*components[-1])
                raise _Invalid(f"unknown protocol {proto!r} (extra value after {last!r}?)")
            raise _Invalid(f"unknown protocol {proto!r}")
        if proto in _NO_VALUE:
            components.append((proto, None))
            i += 1
            continue
        if i + 1 >= len(parts) or not parts[i + 1]:
            raise _Invalid(f"missing value for /{proto}")
        components.append((proto, _normalize(proto, parts[i + 1])))
        i += 2
    return components


def _normalize_components(items: Iterable[Component]) -> list[Component]:
    out: list[Component] = []
    for item in items:
        if not (isinstance(item, tuple) and len(item) == 2):
            raise _Invalid(f"component {item!r} is not a (protocol, value) pair")
        proto, value = item
        if not isinstance(proto, str) or proto not in _CODES:
            raise _Invalid(f"unknown protocol {proto!r}")
        if proto in _NO_VALUE:
            if value is not None:
                raise _Invalid(f"/{proto} takes no value (got {value!r})")
            out.append((proto, None))
            continue
        if value is None or value == "":
            raise _Invalid(f"missing value for /{proto}")
        if not isinstance(value, str):
            raise _Invalid(f"value for /{proto} must be str, not {type(value).__name__}")
        out.append((proto, _normalize(proto, value)))
    return out


def _raw_text(items: Iterable[object]) -> str:
    """Best-effort text of unvalidated components, only for error messages."""
    parts = []
    for item in items:
        if isinstance(item, tuple) and len(item) == 2:
            proto, value = item
            parts.append(f"/{proto}" if value is None else f"/{proto}/{value}")
        else:
            parts.append(f"/{item!r}")
    return "".join(parts)


@functools.lru_cache(maxsize=8192)
def _parse_checked(text: str) -> tuple[Component, ...]:
    """Normalized, structure-checked components of `text`. Cached: a DHT sees the
    same few thousand addresses in every answer, and parsing IPs is slow."""
    try:
        components = tuple(_parse_text(text))
        _check_structure(components)
    except _Invalid as e:
        raise MultiaddrError(_quote_text(text), e.reason) from None
    return components


@functools.lru_cache(maxsize=8192)
def _ip_object(proto: str, value: str) -> IPAddress:
    return ipaddress.IPv4Address(value) if proto == "ip4" else ipaddress.IPv6Address(value)


# ---------------------------------------------------------------- Multiaddr


class Multiaddr:
    """An immutable, hashable, validated multiaddr; equal when the normalized components are."""

    __slots__ = ("_components", "_text")
    _components: tuple[Component, ...]
    _text: str | None

    def __init__(self, addr: str | Multiaddr) -> None:
        components = addr._components if isinstance(addr, Multiaddr) else _parse_checked(addr)
        object.__setattr__(self, "_components", components)
        object.__setattr__(self, "_text", None)

    @classmethod
    def parse(cls, text: str) -> Multiaddr:
        """Parse the text form; raises MultiaddrError."""
        return cls(text)

    @classmethod
    def from_components(cls, components: Iterable[Component]) -> Multiaddr:
        """Build from (protocol, value) pairs, e.g. ``[("ip4", "1.2.3.4"), ("tcp", "5")]``."""
        # islice: never pull more than the limit out of an untrusted iterable
        items = list(islice(components, MAX_COMPONENTS + 1))
        try:
            normalized = tuple(_normalize_components(items))
            _check_structure(normalized)
        except _Invalid as e:
            raise MultiaddrError(_quote_text(_raw_text(items)), e.reason) from None
        return cls._trusted(normalized)

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> Multiaddr:
        """Decode the standard binary form; raises MultiaddrError (only) on bad input."""
        if not isinstance(data, bytes | bytearray | memoryview):
            raise TypeError(f"multiaddr bytes must be bytes-like, not {type(data).__name__}")
        data = bytes(data)
        try:
            components = tuple(_decode(data))
            _check_structure(components)
        except _Invalid as e:
            raise MultiaddrError(_quote_bytes(data), e.reason) from None
        return cls._trusted(components)

    @classmethod
    def _trusted(cls, components: tuple[Component, ...]) -> Multiaddr:
        # For components that are already normalized and structure-checked.
        self = object.__new__(cls)
        object.__setattr__(self, "_components", components)
        object.__setattr__(self, "_text", None)
        return self

    # -- immutability, identity, text

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("Multiaddr is immutable")

    def __delattr__(self, name: str) -> None:
        raise AttributeError("Multiaddr is immutable")

    def __reduce__(self) -> tuple[type[Multiaddr], tuple[str]]:
        # The frozen __setattr__ defeats the default slots pickling.
        return (Multiaddr, (str(self),))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Multiaddr):
            return NotImplemented
        return self._components == other._components

    def __hash__(self) -> int:
        return hash(self._components)

    def __str__(self) -> str:
        text = self._text
        if text is None:
            text = "".join(_segment(p, v) for p, v in self._components)
            object.__setattr__(self, "_text", text)
        return text

    def __repr__(self) -> str:
        return f"Multiaddr({str(self)!r})"

    def __bytes__(self) -> bytes:
        return self.to_bytes()

    def to_bytes(self) -> bytes:
        """The standard binary form (varint code, then the value)."""
        return b"".join(_uvarint(_CODES[p]) + _encode_value(p, v) for p, v in self._components)

    # -- accessors

    @property
    def components(self) -> tuple[Component, ...]:
        """(protocol, value) pairs; value is None for /p2p-circuit."""
        return self._components

    def protocols(self) -> list[str]:
        return [p for p, _ in self._components]

    def value_for(self, proto: str) -> str | None:
        """The value of the first `proto` component, or None."""
        for p, v in self._components:
            if p == proto:
                return v
        return None

    @property
    def peer_id(self) -> PeerID | None:
        """The last /p2p ID: the target peer (for a relayed address too)."""
        for p, v in reversed(self._components):
            if p == "p2p" and v is not None:
                return PeerID.from_base58(v)
        return None

    @property
    def relay_peer_id(self) -> PeerID | None:
        """The /p2p ID just before /p2p-circuit, or None for an address not relayed."""
        for i, (p, _) in enumerate(self._components):
            if p == "p2p-circuit":
                relay = self._components[i - 1][1]  # structure guarantees /p2p/RELAY
                return PeerID.from_base58(relay) if relay is not None else None
        return None

    @property
    def is_relayed(self) -> bool:
        return any(p == "p2p-circuit" for p, _ in self._components)

    @property
    def is_direct_tcp(self) -> bool:
        """A host and TCP port to dial directly (not through a relay)."""
        return self._components[0][0] in _HOSTS and not self.is_relayed

    @property
    def family(self) -> str | None:
        """Host protocol of the first hop ("ip4", "ip6", "dns", "dns4", "dns6"), or None."""
        first = self._components[0][0]
        return first if first in _HOSTS else None

    def tcp_endpoint(self) -> tuple[str, int] | None:
        """(host, port) to dial for a direct address; host is IP text (no brackets) or DNS name."""
        if not self.is_direct_tcp:
            return None
        (_, host), (_, port) = self._components[:2]
        if host is None or port is None:  # unreachable: the structure check guarantees both
            return None
        return host, int(port)

    def _ip(self) -> IPAddress | None:
        proto, value = self._components[0]
        if value is None or proto not in ("ip4", "ip6"):
            return None
        return _ip_object(proto, value)

    # The IP predicates look at the first hop's IP (the relay's for a relayed
    # address); DNS names are not resolved, so they are never true for them.

    @property
    def is_unspecified(self) -> bool:
        """0.0.0.0 or :: (a listen-on-all address, not dialable)."""
        ip = self._ip()
        return ip is not None and ip.is_unspecified

    @property
    def is_loopback(self) -> bool:
        ip = self._ip()
        return ip is not None and ip.is_loopback

    @property
    def is_private(self) -> bool:
        """ipaddress `is_private`: RFC 1918, ULA, link-local, loopback, ..."""
        ip = self._ip()
        return ip is not None and ip.is_private

    @property
    def is_public_ip(self) -> bool:
        """A globally routable IP (ipaddress `is_global`)."""
        ip = self._ip()
        return ip is not None and ip.is_global

    # -- derived addresses

    def encapsulate(self, other: Multiaddr | str) -> Multiaddr:
        """This address followed by `other` (as text, a fragment such as ``/p2p-circuit``)."""
        if isinstance(other, Multiaddr):
            tail: list[Component] = list(other._components)
        elif isinstance(other, str):
            try:
                tail = _parse_text(other)
            except _Invalid as e:
                raise MultiaddrError(_quote_text(str(self) + other), e.reason) from None
        else:
            raise TypeError(f"can only encapsulate a Multiaddr or str, not {type(other).__name__}")
        return self._derived((*self._components, *tail), f"{self}{other}")

    def with_peer_id(self, peer_id: PeerID | str) -> Multiaddr:
        """Append /p2p/ID, replacing a trailing /p2p component."""
        if isinstance(peer_id, PeerID):
            value = peer_id.to_base58()
        else:
            try:
                value = _normalize("p2p", peer_id)
            except _Invalid as e:
                raise MultiaddrError(_quote_text(f"{self}/p2p/{peer_id}"), e.reason) from None
        base = self._components[:-1] if self._components[-1][0] == "p2p" else self._components
        components = (*base, ("p2p", value))
        return self._derived(components, "".join(_segment(p, v) for p, v in components))

    def without_peer_id(self) -> Multiaddr:
        """Drop a trailing /p2p component (an address that is only /p2p/ID has nothing left)."""
        if self._components[-1][0] != "p2p":
            return self
        if len(self._components) == 1:
            raise MultiaddrError(_quote_text(str(self)), "nothing left without the peer ID")
        return self._derived(self._components[:-1], str(self))

    def _derived(self, components: tuple[Component, ...], text: str) -> Multiaddr:
        try:
            _check_structure(components)
        except _Invalid as e:
            raise MultiaddrError(_quote_text(text), e.reason) from None
        return Multiaddr._trusted(components)


def _decode(data: bytes) -> Iterator[Component]:
    if len(data) > MAX_BYTES_LEN:
        raise _Invalid(f"longer than {MAX_BYTES_LEN} bytes")
    if not data:
        raise _Invalid("empty address")
    pos = 0
    count = 0
    while pos < len(data):
        count += 1
        if count > MAX_COMPONENTS:
            raise _Invalid(f"more than {MAX_COMPONENTS} components")
        start = pos
        code, pos = _read_uvarint(data, pos)
        proto = _NAMES.get(code)
        if proto is None:
            raise _Invalid(f"unknown protocol code {code} at byte {start}")
        value, pos = _decode_value(proto, data, pos)
        yield proto, value


# ---------------------------------------------------------------- helpers


def from_socket_address(host: str, port: int) -> Multiaddr:
    """The /ip4 or /ip6 + /tcp address of a socket address (IPv4-mapped IPv6 becomes /ip4)."""
    if not isinstance(host, str):
        raise TypeError(f"host must be str, not {type(host).__name__}")
    if isinstance(port, bool) or not isinstance(port, int):
        raise TypeError(f"port must be int, not {type(port).__name__}")
    proto = "ip6" if ":" in host else "ip4"
    if proto == "ip6" and "%" not in host:
        try:
            mapped = ipaddress.IPv6Address(host).ipv4_mapped
        except ValueError:
            mapped = None  # from_components reports the bad address
        if mapped is not None:
            proto, host = "ip4", str(mapped)
    return Multiaddr.from_components([(proto, host), ("tcp", str(port))])


def parse_many(values: Iterable[str | Multiaddr]) -> list[Multiaddr]:
    """Parse each value (surrounding whitespace stripped, blank entries skipped), in order.

    Meant for config lists (e.g. a split SHOAL_* variable); the first bad entry raises.
    """
    out: list[Multiaddr] = []
    for value in values:
        if isinstance(value, Multiaddr):
            out.append(value)
            continue
        text = value.strip() if isinstance(value, str) else value
        if text:
            out.append(Multiaddr(text))
    return out
