"""Named networks: the bootstrap entries of `--network NAME`, shipped and user-defined.

The package ships `networks.toml` (the public list; it may be empty); a user's
TOML file of the same shape (`--networks FILE`) adds networks and replaces
shipped ones by name. An entry is a peer address or a `/dnsaddr/` name; both
are checked when the file is read, so a typo fails at start, in one line.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Final

from shoal.transport.dnsaddr import DnsaddrError, DnsaddrName, is_dnsaddr
from shoal.transport.multiaddr import Multiaddr, MultiaddrError

__all__ = [
    "DEFAULT_NETWORK",
    "BootstrapEntry",
    "Network",
    "NetworkError",
    "check_network_name",
    "load_networks",
    "parse_entry",
]

DEFAULT_NETWORK: Final = "public"
MAX_ENTRIES: Final = 64
_NAME: Final = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")

BootstrapEntry = Multiaddr | DnsaddrName


class NetworkError(ValueError):
    """A bad network name, file or entry; one line naming it."""


@dataclass(frozen=True, slots=True)
class Network:
    name: str
    bootstrap: tuple[BootstrapEntry, ...]
    origin: str  # "shipped" or the user's file


def check_network_name(name: str) -> str:
    name = name.strip().lower()
    if not _NAME.fullmatch(name):
        raise NetworkError(
            f"invalid network name {name!r}: 1-64 characters: lowercase letters, digits, "
            "'.', '_' or '-', starting with a letter or digit"
        )
    return name


def parse_entry(text: str) -> BootstrapEntry:
    """A bootstrap entry: a peer's address, or a `/dnsaddr/DOMAIN[/p2p/ID]` name."""
    text = text.strip()
    if is_dnsaddr(text):
        try:
            return DnsaddrName.parse(text)
        except DnsaddrError as e:
            raise NetworkError(str(e)) from None
    try:
        addr = Multiaddr(text)
    except MultiaddrError as e:
        raise NetworkError(str(e)) from None
    if not (addr.is_direct_tcp or addr.is_relayed):
        raise NetworkError(
            f"cannot bootstrap from {addr}: give a peer's address, such as "
            "/ip4/203.0.113.5/tcp/31337/p2p/12D3KooW..., or /dnsaddr/DOMAIN"
        )
    return addr


def _read(text: str, origin: str) -> dict[str, Network]:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise NetworkError(f"{origin} is not valid TOML: {e}") from None
    out = {}
    for raw_name, table in data.items():
        name = check_network_name(raw_name)
        entries = table.get("bootstrap") if isinstance(table, dict) else None
        if not isinstance(entries, list) or not all(isinstance(e, str) for e in entries):
            raise NetworkError(f'{origin}: [{raw_name}] needs bootstrap = ["ADDR", ...]')
        if len(entries) > MAX_ENTRIES:
            raise NetworkError(f"{origin}: [{raw_name}] lists more than {MAX_ENTRIES} entries")
        try:
            parsed = tuple(dict.fromkeys(parse_entry(e) for e in entries))
        except NetworkError as e:
            raise NetworkError(f"{origin}: [{raw_name}]: {e}") from None
        out[name] = Network(name, parsed, origin)
    return out


def load_networks(user_file: Path | None = None) -> dict[str, Network]:
    """The shipped networks, then the user's file's (which replace them by name)."""
    shipped = resources.files(__package__).joinpath("networks.toml").read_text()
    networks = _read(shipped, "shipped networks.toml")
    if user_file is not None:
        try:
            text = user_file.read_text()
        except OSError as e:
            raise NetworkError(f"cannot read networks file {user_file}: {e.strerror}") from None
        networks.update(_read(text, str(user_file)))
    return networks
