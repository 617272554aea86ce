"""Protocol versions: what peers tell each other at connection, and who may talk to whom.

The *protocol version* (major, minor) names what goes over the wire; it is not the
package version (shoal 0.1.0 and 0.1.1 speak the same protocol). The rule:

- Peers whose major versions are equal are compatible. A minor version adds
  optional features only: a peer uses one only when the other's minor says it
  has it (`VersionGate.peer_version`).
- A major bump means an older peer cannot take part: the two refuse each other.
  A release may still speak older majors; it then says so in ``oldest`` (the
  oldest major it speaks), and peers are compatible when their ranges
  [oldest, major] overlap. Today ``oldest`` is the major itself.

Exchange, ``/shoal/hello/1.0.0``: right after the secure handshake each side opens
one stream, writes one msgpack map and half-closes; the other side reads it and
closes its end, which tells the writer it was read::

    {"protocol": [major, minor], "oldest": int, "software": "shoal 0.1.0"}

Unknown keys are ignored (later versions may add some). The hello is the first
stream either side opens, so the streams a peer opens after its hello wait until
the hello is read (a loop iteration; no round trip). A peer whose first stream
is something else, or that refuses the hello stream as an unknown protocol, runs
software from before this exchange: it is recorded as "unknown" and served.

An incompatible peer: both sides log one WARNING naming both versions and what
to do, refuse its streams with a reason that says the same, and close the
connection once their own hello was read by the other side (so the other side
learns why, and does not see a bare reset). `Host.connect` waits for the
remote's hello (one round trip after the handshake, the only cost of the check)
and raises `IncompatibleProtocol` for such a peer.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _package_version
from typing import TYPE_CHECKING, Any, Protocol

import msgpack

from .errors import (
    ClosedAtOnce,
    ConnectionLost,
    DialError,
    ProtocolNotSupported,
    TransportError,
)
from .identity import PeerID
from .ratelimit import KeyedBuckets

if TYPE_CHECKING:
    from .connection import Connection, Stream

__all__ = [
    "HELLO_PROTOCOL",
    "PROTOCOL_VERSION",
    "SOFTWARE_VERSION",
    "Hello",
    "IncompatibleProtocol",
    "Mismatch",
    "MismatchLog",
    "ProtocolVersion",
    "VersionGate",
    "agent",
    "compatible",
]

log = logging.getLogger("shoal.transport.version")

HELLO_PROTOCOL = "/shoal/hello/1.0.0"
UPGRADE_COMMAND = "pip install -U shoal"
MAX_HELLO_BYTES = 1024
MAX_SOFTWARE_LEN = 64
HELLO_TIMEOUT = 10.0  # a peer that opened the hello stream must finish it within this
CLOSE_GRACE = 5.0  # an incompatible connection closes once our hello was read, or after this
MAX_MISMATCHES = 64  # peers listed in /status (the total counts them all)
WARN_INTERVAL = 600.0  # one WARNING per peer per this many seconds

try:
    SOFTWARE_VERSION = _package_version("shoal")
except PackageNotFoundError:  # a source tree that was never installed
    SOFTWARE_VERSION = "0.0.0+unknown"


@dataclass(frozen=True, order=True, slots=True)
class ProtocolVersion:
    major: int
    minor: int

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}"


# Bump the major when an older peer can no longer take part (a message it cannot
# read, a step it does not do); the minor when something optional is added that
# older peers of the same major simply do not use. docs/reference/protocols.md.
PROTOCOL_VERSION = ProtocolVersion(2, 11)


def agent(software: str = SOFTWARE_VERSION, protocol: ProtocolVersion = PROTOCOL_VERSION) -> str:
    """The identify agent string, e.g. "shoal/0.1.0 protocol/1.0"."""
    return f"shoal/{software} protocol/{protocol}"


@dataclass(frozen=True, slots=True)
class Hello:
    """What a peer says of itself: its protocol version and its software."""

    protocol: ProtocolVersion = PROTOCOL_VERSION
    oldest: int = PROTOCOL_VERSION.major  # the oldest major it still speaks
    software: str = f"shoal {SOFTWARE_VERSION}"

    def to_wire(self) -> dict[str, object]:
        return {
            "protocol": [self.protocol.major, self.protocol.minor],
            "oldest": self.oldest,
            "software": self.software,
        }

    @classmethod
    def from_wire(cls, msg: object) -> Hello:
        """Validate an untrusted hello (ValueError when malformed)."""
        if not isinstance(msg, dict):
            raise ValueError(f"hello is {type(msg).__name__}, not a map")
        proto = msg.get("protocol")
        if not (isinstance(proto, list | tuple) and len(proto) == 2 and all(map(_small, proto))):
            raise ValueError(f"bad protocol version {proto!r:.40}")
        version = ProtocolVersion(proto[0], proto[1])
        oldest = msg.get("oldest", version.major)
        if not _small(oldest) or oldest > version.major:
            raise ValueError(f"bad oldest major {oldest!r:.40}")
        software = msg.get("software", "")
        if not isinstance(software, str):
            raise ValueError("software is not a string")
        return cls(version, oldest, _printable(software))


def _small(value: object) -> bool:
    return type(value) is int and 0 <= value <= 0xFFFF


def _printable(text: str) -> str:
    # Shown in logs and on the status page: no control characters, bounded.
    return "".join(c if c.isprintable() else "?" for c in text[:MAX_SOFTWARE_LEN]) or "?"


def compatible(a: Hello, b: Hello) -> bool:
    """Whether two peers can talk: some major version both speak (same major, today)."""
    return max(a.oldest, b.oldest) <= min(a.protocol.major, b.protocol.major)


def _describe(hello: Hello) -> str:
    return f"{hello.protocol} ({hello.software})"


def advice(ours: Hello, theirs: Hello) -> str:
    """What the user of the peer saying `ours` should do about a peer saying `theirs`."""
    if ours.protocol.major < theirs.protocol.major:
        return f"upgrade this peer: {UPGRADE_COMMAND}"
    return (
        "the other peer runs an older shoal and must upgrade "
        f"({UPGRADE_COMMAND} there); nothing to do here"
    )


def mismatch_message(peer: PeerID, ours: Hello, theirs: Hello) -> str:
    """The local account of an incompatible peer: both versions and what to do."""
    return (
        f"incompatible peer {peer.short()}: it speaks shoal protocol {_describe(theirs)}, "
        f"this peer speaks {_describe(ours)}; {advice(ours, theirs)}"
    )


def refusal_message(ours: Hello, theirs: Hello) -> str:
    """The reason sent to the incompatible peer (at most 256 bytes): written for it."""
    return (
        f"incompatible shoal protocol: this peer speaks {_describe(theirs)}, "
        f"the other speaks {_describe(ours)}; {advice(theirs, ours)}"
    )


class IncompatibleProtocol(DialError, ConnectionLost):
    """The peer speaks a protocol version this one cannot talk to; the message says
    both versions and which side must upgrade."""

    def __init__(self, message: str, theirs: Hello | None = None) -> None:
        super().__init__(message)
        self.theirs = theirs


# --- what was seen (sans I/O) ---------------------------------------------------------------


@dataclass(slots=True)
class Mismatch:
    peer: PeerID
    theirs: Hello
    ours: Hello
    first_seen: float  # UNIX time
    last_seen: float
    count: int = 1  # connections refused

    def to_json(self) -> dict[str, object]:
        return {
            "peer_id": str(self.peer),
            "theirs": str(self.theirs.protocol),
            "ours": str(self.ours.protocol),
            "software": self.theirs.software,
            "first_seen": self.first_seen,
            "last_seen": self.last_seen,
            "count": self.count,
            "action": advice(self.ours, self.theirs),
        }


class MismatchLog:
    """The incompatible peers seen, most recent last (bounded), and whether to warn.

    A peer that dials again and again is one entry with a count, and one WARNING per
    `warn_interval` (an incompatible swarm must not flood the log).
    """

    def __init__(
        self, max_entries: int = MAX_MISMATCHES, warn_interval: float = WARN_INTERVAL
    ) -> None:
        self.max_entries = max_entries
        self.total = 0  # connections refused, every peer (evicted ones too)
        self._entries: OrderedDict[PeerID, Mismatch] = OrderedDict()
        self._warnings = KeyedBuckets(1.0 / warn_interval, 1.0, max_keys=4 * max_entries)

    def record(self, peer: PeerID, ours: Hello, theirs: Hello, now: float, wall: float) -> bool:
        """Count one refused connection; True when it deserves a WARNING now."""
        self.total += 1
        entry = self._entries.pop(peer, None)
        if entry is None or entry.theirs != theirs:
            entry = Mismatch(
                peer, theirs, ours, wall, wall, 1 if entry is None else entry.count + 1
            )
        else:
            entry.count += 1
            entry.last_seen = wall
        self._entries[peer] = entry
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
        return self._warnings.take(("mismatch", peer), now)

    def may_note_old(self, peer: PeerID, now: float) -> bool:
        """Whether to log (at INFO) that `peer` runs software without versions."""
        return self._warnings.take(("old", peer), now)

    def entries(self) -> list[Mismatch]:
        """Most recent first."""
        return list(reversed(self._entries.values()))


# --- the driver -------------------------------------------------------------------------------


class _State(enum.Enum):
    PENDING = "pending"  # no stream from the peer yet
    READING = "reading"  # its hello stream is open: its other streams wait
    KNOWN = "known"  # compatible
    OLD = "unknown"  # software from before the exchange: no version
    REJECTED = "incompatible"
    PROBE = "probe"  # a hello-less probe's connection (AutoNAT's dial-back): no version


def _future() -> asyncio.Future[None]:
    return asyncio.get_running_loop().create_future()


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


@dataclass(slots=True)
class _Conn:
    state: _State = _State.PENDING
    remote: Hello | None = None
    held: list[Stream] = field(default_factory=list)
    # Futures rather than Events: a connection's entry is kept as long as it lives, and
    # an Event's deque of waiters alone is bigger than all the rest.
    verdict: asyncio.Future[None] = field(default_factory=_future)
    pushed: asyncio.Future[None] = field(default_factory=_future)  # our hello was read (or not)
    reason: str = ""  # REJECTED: the local account
    refusal: str = ""  # REJECTED: what the peer is told


class GatedHost(Protocol):
    """What the gate needs of the host whose connections it checks (`Host` is one)."""

    def add_connection_listener(
        self,
        opened: Callable[[Connection], None] | None = None,
        closed: Callable[[Connection], None] | None = None,
    ) -> Callable[[], None]:
        """Call `opened(conn)` after every handshake and `closed(conn)` after every close."""
        ...

    def connection(self, peer: PeerID) -> Connection | None:
        """The connection to `peer` that accepts streams, if any."""
        ...


class VersionGate:
    """Runs the hello on every connection of `host` and keeps incompatible peers out.

    The host calls `hold(stream)` for every stream the remote opens and `checked(conn)`
    before `connect` returns; the rest hangs on its connection listener.
    `local` may be replaced before connections are made (tests: another version).
    """

    def __init__(self, host: GatedHost, dispatch: Callable[[Stream], None]) -> None:
        self.host = host
        self.local = Hello()
        self.mismatches = MismatchLog()
        self._dispatch = dispatch
        self._conns: dict[Connection, _Conn] = {}
        self._heard: weakref.WeakSet[Connection] = weakref.WeakSet()  # (`heard_from`)
        # Protocols a connection may open without a hello: a probe's, made with a
        # throwaway identity by a raw connection (AutoNAT's dial-back), which is not
        # software from before versions.
        self.without_hello: set[str] = set()
        # The gate's listener must be the host's first: our hello is then the first
        # stream we open on every connection, before identify's and the application's.
        host.add_connection_listener(self._opened, self._closed)

    # --- what the rest of the host and the status page ask ----------------------------------

    def peer_version(self, peer: PeerID) -> Hello | None:
        """The hello of `peer` on its current connection (None: unknown or not yet)."""
        conn = self.host.connection(peer)
        entry = self._conns.get(conn) if conn is not None else None
        return entry.remote if entry is not None else None

    def describe(self, conn: Connection) -> str | None:
        """ "1.0", "unknown" (older software), "incompatible 2.0", or None (not yet)."""
        entry = self._conns.get(conn)
        if entry is None or entry.state in (_State.PENDING, _State.READING, _State.PROBE):
            return None
        if entry.state is _State.OLD:
            return "unknown"
        assert entry.remote is not None
        prefix = "incompatible " if entry.state is _State.REJECTED else ""
        return f"{prefix}{entry.remote.protocol}"

    def status(self) -> dict[str, Any]:
        """The /status fields (peer/status/server.py documents them)."""
        old = {c.remote_peer for c, e in self._conns.items() if e.state is _State.OLD}
        return {
            "protocol_version": str(self.local.protocol),
            "version_mismatches": [m.to_json() for m in self.mismatches.entries()],
            "version_mismatches_total": self.mismatches.total,
            "peers_without_version": len(old),
        }

    def hold(self, stream: Stream) -> bool:
        """Whether the gate takes `stream` (the remote opened it): the hello itself, a
        stream that waits for the hello, or one refused because the peer is incompatible."""
        conn = stream.connection
        entry = self._conns.get(conn)
        if entry is not None and entry.state is _State.KNOWN and stream.protocol != HELLO_PROTOCOL:
            return False  # (the usual case, first: this runs for every stream a peer opens)
        if entry is None and conn.handshake_done.done() and not conn.closed.done():
            # The remote's first frames came in the same read as the end of the
            # handshake: its streams arrive before the host's listeners ran.
            self._opened(conn)
            entry = self._conns.get(conn)
        if entry is None:
            return False
        if entry.state is _State.REJECTED:
            conn.refuse_stream(stream, entry.refusal, unknown_protocol=False)
            return True
        self._heard.add(conn)
        if stream.protocol == HELLO_PROTOCOL:
            if entry.state in (_State.PENDING, _State.OLD):
                entry.state = _State.READING
            conn.spawn(self._serve(conn, entry, stream), stream)
            return True
        if entry.state is _State.PENDING and stream.protocol in self.without_hello:
            entry.state = _State.PROBE
            _settle(entry.verdict)
            return False
        if entry.state is _State.PENDING:
            # Its first stream is not a hello: software from before the exchange.
            self._old(conn, entry)
        if entry.state is _State.READING:
            entry.held.append(stream)
            return True
        return False

    async def checked(self, conn: Connection, timeout: float) -> Connection:
        """`conn` once the remote's version is known to be compatible (or unknown).

        Raises IncompatibleProtocol for an incompatible peer and DialError when the
        connection closed first; after `timeout` without an answer, `conn` as it is
        (its streams stay held on the other side until the answer comes).
        """
        entry = self._conns.get(conn)
        if entry is not None and not entry.verdict.done():
            try:
                async with asyncio.timeout(max(timeout, 0.0)):
                    await asyncio.shield(entry.verdict)
            except TimeoutError:
                return conn
        if entry is not None and entry.state is _State.REJECTED:
            raise IncompatibleProtocol(entry.reason, entry.remote)
        if not conn.accepting_streams and conn.remote_peer is not None:
            # A duplicate (we dialed each other at once) closed meanwhile: the one kept.
            kept = self.host.connection(conn.remote_peer)
            if kept is not None and kept is not conn:
                return await self.checked(kept, timeout)
        if not conn.is_open:
            peer = conn.remote_peer.short() if conn.remote_peer else "peer"
            error = ClosedAtOnce if not self.heard_from(conn) else DialError
            raise error(f"connection to {peer} closed at once: {conn.close_reason}")
        return conn

    def heard_from(self, conn: Connection) -> bool:
        """Whether the remote opened a stream on `conn` (its hello, or any stream of
        software from before it): it took the connection, which was not closed on
        it before its handshake ended."""
        return conn in self._heard

    # --- connection events --------------------------------------------------------------------

    def _opened(self, conn: Connection) -> None:
        if conn in self._conns:
            return
        entry = self._conns[conn] = _Conn()
        # Opened here, not in the task: tasks woken by the same handshake (identify,
        # the caller's first request) could otherwise open their streams first, and
        # the remote would take us for software from before the exchange.
        try:
            stream = conn.open_stream_now(HELLO_PROTOCOL)
        except TransportError as e:
            log.debug("hello to %s: %s", conn.remote_peer.short(), e)
            _settle(entry.pushed)
            return
        conn.spawn(self._push(conn, entry, stream))

    def _closed(self, conn: Connection) -> None:
        entry = self._conns.pop(conn, None)
        if entry is not None:
            entry.held.clear()  # the connection failed them already
            _settle(entry.verdict)
            _settle(entry.pushed)

    async def _push(self, conn: Connection, entry: _Conn, stream: Stream) -> None:
        """Send our hello on `stream`; returns once the remote has read it (or cannot)."""
        try:
            async with asyncio.timeout(HELLO_TIMEOUT):
                await stream.write(msgpack.packb(self.local.to_wire()))
                await stream.close()
                await stream.read(1)  # EOF once the remote has read it (and decided)
        except ProtocolNotSupported:
            if entry.state is _State.PENDING:
                self._old(conn, entry)
        except (TransportError, TimeoutError) as e:
            log.debug("hello to %s: %s", conn.remote_peer.short(), e)
        finally:
            _settle(entry.pushed)

    async def _serve(self, conn: Connection, entry: _Conn, stream: Stream) -> None:
        """Read the remote's hello and decide."""
        try:
            async with asyncio.timeout(HELLO_TIMEOUT):
                data = await _read_all(stream, MAX_HELLO_BYTES)
            hello = Hello.from_wire(msgpack.unpackb(data, raw=False))
        except asyncio.CancelledError:
            stream.reset("cancelled")
            raise
        except (TransportError, TimeoutError) as e:
            stream.reset(type(e).__name__)
            conn.abort(f"no hello from {conn.remote_peer.short()}: {e or 'timeout'}")
            return
        except Exception as e:  # msgpack's zoo of decoding errors, and ours
            stream.reset("bad hello")
            log.info("closing connection to %s: bad hello (%s)", conn.remote_peer.short(), e)
            conn.abort(f"bad hello: {e}")
            return
        self._decide(conn, entry, hello)
        await stream.close(discard_input=True)  # the remote's EOF: we read it

    # --- decisions ----------------------------------------------------------------------------

    def _decide(self, conn: Connection, entry: _Conn, hello: Hello) -> None:
        entry.remote = hello
        held, entry.held = entry.held, []
        if compatible(self.local, hello):
            entry.state = _State.KNOWN
            _settle(entry.verdict)
            for stream in held:
                self._dispatch(stream)
            return
        peer = conn.remote_peer
        entry.state = _State.REJECTED
        entry.reason = mismatch_message(peer, self.local, hello)
        entry.refusal = refusal_message(self.local, hello)
        # Whatever ends the connection now, its streams fail with this reason.
        conn.close_reason = entry.reason
        _settle(entry.verdict)
        if self.mismatches.record(peer, self.local, hello, time.monotonic(), time.time()):
            log.warning("%s; closing the connection to %s", entry.reason, peer)
        for stream in held:
            conn.refuse_stream(stream, entry.refusal, unknown_protocol=False)
        conn.superseded = True  # the host hands it out no more (connect dials anew)
        conn.spawn(self._close_when_told(conn, entry))

    async def _close_when_told(self, conn: Connection, entry: _Conn) -> None:
        # Closed only once the remote has read our hello: closing at once could cut
        # its reader off before that, and it would see a bare reset. Meanwhile its new
        # streams are refused with the reason (hold), which a GOAWAY would not carry.
        try:
            async with asyncio.timeout(CLOSE_GRACE):
                await asyncio.shield(entry.pushed)
        except TimeoutError:
            pass
        await conn.aclose(1.0)

    def _old(self, conn: Connection, entry: _Conn) -> None:
        entry.state = _State.OLD
        _settle(entry.verdict)
        peer = conn.remote_peer
        if self.mismatches.may_note_old(peer, time.monotonic()):
            log.info(
                "peer %s runs shoal from before protocol versions (no hello): "
                "compatibility unknown; it should upgrade (%s)",
                peer,
                UPGRADE_COMMAND,
            )


async def _read_all(stream: Stream, limit: int) -> bytes:
    data = bytearray()
    while chunk := await stream.read(limit + 1 - len(data)):
        data += chunk
        if len(data) > limit:
            raise ValueError(f"hello longer than {limit} bytes")
    return bytes(data)
