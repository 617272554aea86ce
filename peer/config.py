"""The daemon's configuration: one table of options, read from flags and SHOAL_* variables.

Each option is declared once in `OPTIONS` (flag, environment variable, help);
the argparse options, the environment lookup, the validation and the
"effective configuration" log lines are all derived from that table, so a new
option (DHT bootstrap peers, HTTP status port, ...) is one entry plus one
`Config` field.

Precedence (DESIGN.md): a command-line flag, overridden by its SHOAL_*
environment variable, else the default. The environment wins because that is
what docker users set, while the image's command line is fixed.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from shoal.transport.host import DEFAULT_LISTEN, HostConfig
from shoal.transport.identity import PeerID
from shoal.transport.multiaddr import Multiaddr, MultiaddrError

__all__ = [
    "DEFAULT_DATA_DIR",
    "IDENTITY_FILE",
    "LOG_LEVELS",
    "OPTIONS",
    "Config",
    "ConfigError",
    "Option",
    "add_options",
    "build_config",
]

DEFAULT_DATA_DIR = "~/.shoal"
IDENTITY_FILE = "identity.key"
LOG_LEVELS = ("debug", "info", "warning", "error")


class ConfigError(ValueError):
    """A configuration mistake by the user; the message is one line naming the flag or variable."""


@dataclass(frozen=True, slots=True)
class Option:
    name: str  # Config field; the flag is --name with dashes
    env: str
    help: str
    metavar: str
    default_text: str  # how the default reads in --help
    repeatable: bool = False  # a list: repeat the flag, or comma-separate (the env var)
    many: bool = False  # the flag also takes several values at once: --flag A B

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


OPTIONS: dict[str, Option] = {
    o.name: o
    for o in (
        Option(
            "data_dir",
            "SHOAL_DATA_DIR",
            "directory for the identity key and (later) checkpoints",
            "DIR",
            DEFAULT_DATA_DIR,
        ),
        Option(
            "listen",
            "SHOAL_LISTEN",
            "multiaddr to listen on; repeat the flag for several",
            "MULTIADDR",
            " and ".join(DEFAULT_LISTEN),
            repeatable=True,
        ),
        Option(
            "announce",
            "SHOAL_ANNOUNCE",
            "multiaddr to advertise instead of the detected ones (e.g. a public IP or "
            "DNS name behind port forwarding); repeat the flag for several",
            "MULTIADDR",
            "the detected addresses",
            repeatable=True,
        ),
        Option(
            "bootstrap",
            "SHOAL_BOOTSTRAP",
            "multiaddr of a peer to join the network through (/ip4/.../tcp/N/p2p/ID); "
            "several may follow the flag; without any, this peer starts a new network",
            "MULTIADDR",
            "none: start a new network",
            repeatable=True,
            many=True,
        ),
        Option(
            "log_level",
            "SHOAL_LOG_LEVEL",
            "log verbosity (" + ", ".join(LOG_LEVELS) + ")",
            "LEVEL",
            "info",
        ),
    )
}


@dataclass(frozen=True, slots=True)
class Config:
    """The effective configuration of one `shoal` invocation."""

    data_dir: Path = field(default_factory=lambda: Path(DEFAULT_DATA_DIR).expanduser())
    listen: tuple[Multiaddr, ...] = tuple(Multiaddr(a) for a in DEFAULT_LISTEN)
    announce: tuple[Multiaddr, ...] = ()
    bootstrap: tuple[Multiaddr, ...] = ()
    log_level: str = "info"
    # Where each value came from ("default", "--listen", "SHOAL_LISTEN", ...), for the
    # start-up log: env-over-flag precedence surprises people, so show it.
    sources: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)

    @property
    def identity_path(self) -> Path:
        return self.data_dir / IDENTITY_FILE

    @property
    def logging_level(self) -> int:
        return getattr(logging, self.log_level.upper())  # type: ignore[no-any-return]

    def host_config(self) -> HostConfig:
        return HostConfig(
            listen=tuple(str(a) for a in self.listen),
            announce=tuple(str(a) for a in self.announce),
        )

    def check_peer_id(self, peer_id: PeerID) -> None:
        """Refuse announce addresses that name another peer (the host would silently replace it)."""
        for addr in self.announce:
            named = addr.peer_id
            if named is not None and named != peer_id and not _ends_in_circuit(addr):
                raise ConfigError(
                    f"{self._origin('announce')}: {addr} names peer {named}, "
                    f"but this peer is {peer_id}; drop the /p2p/ part"
                )

    def _origin(self, name: str) -> str:
        """The flag or variable a value came from, for error messages."""
        return self.sources.get(name, OPTIONS[name].flag).split(",")[0]

    def describe(self, names: Iterable[str] = OPTIONS) -> list[str]:
        """One `name = value  [source]` line per option, for the start-up log."""
        lines = []
        for name in names:
            value = getattr(self, name)
            if isinstance(value, tuple):
                text = ", ".join(str(v) for v in value) or "(none)"
            else:
                text = str(value)
            lines.append(
                f"{OPTIONS[name].flag[2:]} = {text}  [{self.sources.get(name, 'default')}]"
            )
        return lines


def _ends_in_circuit(addr: Multiaddr) -> bool:
    # /.../p2p/RELAY/p2p-circuit: the last /p2p/ is the relay, which is not us; the
    # host appends our ID after /p2p-circuit.
    return addr.protocols()[-1] == "p2p-circuit"


def add_options(parser: argparse.ArgumentParser, names: Iterable[str]) -> None:
    """Add the flags of `names` to `parser`; unset flags stay None so precedence can be applied."""
    for name in names:
        opt = OPTIONS[name]
        parser.add_argument(
            opt.flag,
            dest=name,
            metavar=opt.metavar,
            action=("extend" if opt.many else "append") if opt.repeatable else "store",
            nargs="+" if opt.many else None,
            default=None,
            help=f"{opt.help} [env {opt.env}; default: {opt.default_text}]",
        )


def build_config(
    names: Iterable[str], flags: Mapping[str, object], environ: Mapping[str, str]
) -> Config:
    """The Config for options `names`: each from its env var, else its flag, else the default.

    An empty or blank environment variable counts as unset (compose files often
    declare `SHOAL_ANNOUNCE=` with nothing after it). Raises ConfigError.
    """
    values: dict[str, object] = {}
    sources: dict[str, str] = {}
    for name in names:
        opt = OPTIONS[name]
        env_value = environ.get(opt.env, "").strip()
        flag_value = flags.get(name)
        if env_value:
            raw: str | Sequence[str] = env_value
            origin = opt.env
            sources[name] = origin if flag_value is None else f"{origin}, overriding {opt.flag}"
        elif flag_value is not None:
            raw = flag_value  # type: ignore[assignment]
            origin = sources[name] = opt.flag
        else:
            continue
        values[name] = _PARSERS[name](raw, origin)
    return Config(**values, sources=sources)  # type: ignore[arg-type]


# --- per-option parsing and validation --------------------------------------------------------


def _items(raw: str | Sequence[str]) -> list[str]:
    # A flag may be repeated and each value may itself be comma-separated, like the env var.
    parts = [raw] if isinstance(raw, str) else list(raw)
    return [item.strip() for part in parts for item in part.split(",") if item.strip()]


def _multiaddrs(raw: str | Sequence[str], source: str) -> list[Multiaddr]:
    out = []
    for text in _items(raw):
        try:
            out.append(Multiaddr(text))
        except MultiaddrError as e:
            raise ConfigError(f"{source}: {e}") from None
    if not out:
        raise ConfigError(f"{source}: no address given")
    return list(dict.fromkeys(out))


def _parse_listen(raw: str | Sequence[str], source: str) -> tuple[Multiaddr, ...]:
    addrs = _multiaddrs(raw, source)
    for addr in addrs:
        if addr.tcp_endpoint() is None or addr.peer_id is not None:
            raise ConfigError(
                f"{source}: cannot listen on {addr}: give a local IP and TCP port, "
                "such as /ip4/0.0.0.0/tcp/31337 (no /p2p/ part)"
            )
    return tuple(addrs)


def _parse_announce(raw: str | Sequence[str], source: str) -> tuple[Multiaddr, ...]:
    addrs = _multiaddrs(raw, source)
    for addr in addrs:
        if not (addr.is_direct_tcp or addr.is_relayed):
            raise ConfigError(
                f"{source}: cannot announce {addr}: give an address to dial, "
                "such as /ip4/203.0.113.5/tcp/31337 or /dns/example.org/tcp/31337"
            )
    return tuple(addrs)


def _parse_bootstrap(raw: str | Sequence[str], source: str) -> tuple[Multiaddr, ...]:
    addrs = _multiaddrs(raw, source)
    for addr in addrs:
        # Without /p2p/ID the peer is whoever answers at that address: allowed
        # (a DNS name for a public swarm), but the daemon warns.
        if not (addr.is_direct_tcp or addr.is_relayed):
            raise ConfigError(
                f"{source}: cannot bootstrap from {addr}: give a peer's address, such as "
                "/ip4/203.0.113.5/tcp/31337/p2p/12D3KooW... (a running peer prints it at start)"
            )
    return tuple(addrs)


def _parse_data_dir(raw: str | Sequence[str], source: str) -> Path:
    assert isinstance(raw, str)
    text = raw.strip()
    if not text:
        raise ConfigError(f"{source}: empty directory name")
    # absolute(): the log and error messages then say exactly which directory is used.
    return Path(text).expanduser().absolute()


def _parse_log_level(raw: str | Sequence[str], source: str) -> str:
    assert isinstance(raw, str)
    level = raw.strip().lower()
    if level not in LOG_LEVELS:
        raise ConfigError(
            f"{source}: unknown log level {raw!r}; choose one of {', '.join(LOG_LEVELS)}"
        )
    return level


_PARSERS = {
    "data_dir": _parse_data_dir,
    "listen": _parse_listen,
    "announce": _parse_announce,
    "bootstrap": _parse_bootstrap,
    "log_level": _parse_log_level,
}
