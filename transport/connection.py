"""The asyncio driver of one secure, multiplexed connection, and its streams.

`Connection` is an `asyncio.BufferedProtocol`: the kernel writes straight into
our receive buffer, each Noise record is decrypted once into a fresh plaintext
buffer, and stream data stays a slice of that buffer until the application
copies it where it wants it. Outgoing messages are built with room for the
length prefix and AEAD tag and encrypted in place.

Large writes travel as bulk bodies (see `mux`): each body is encrypted straight
from the application's buffer into a pooled send buffer, and decrypted as one
piece, up to 256 KiB at a time. On the wire a body is the bare AEAD ciphertext
(its length was announced by the BULK frame before it), so ordinary records keep
libp2p-noise framing (a 2-byte length, at most 65535 bytes). A body is longer
than Noise's 65535-byte message limit, which exists for that framing: AES-GCM and
ChaCha20-Poly1305 are specified for far longer messages.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import socket
import struct
import time
from collections import deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field

from .access import AccessControl
from .errors import (
    AccessRefused,
    ConnectionLost,
    HandshakeError,
    ProtocolNotSupported,
    ProtocolViolation,
    StreamClosed,
    StreamReset,
    StreamTruncated,
    TransportError,
)
from .identity import Identity, PeerID
from .mux import (
    MAX_BULK_BODY,
    MAX_MESSAGE_PLAINTEXT,
    BulkIncoming,
    DataReceived,
    GoAwayReceived,
    Multiplexer,
    MuxLimits,
    PongReceived,
    StreamEnded,
    StreamOpened,
    StreamWasReset,
)
from .remote_log import RemoteEvents
from .secure import SecureHandshake
from .tasks import TaskSet

log = logging.getLogger("shoal.transport")
# Refusals, handshake timeouts and violations: a remote peer decides how many.
# (The default for connections made outside a Host; each Host has its own.)
_remote_events = RemoteEvents(log)

# uvloop's loop.time() has millisecond resolution (cached per iteration): too coarse
# for loopback RTTs and window tuning, so measurements use the monotonic clock.
_now = time.monotonic

_LEN = struct.Struct(">H")
_TAG = 16
_MIN_FREE = max(65535 + 2, MAX_BULK_BODY + 16)  # always room for one whole record
# A connection receives into a small buffer (so thousands of peers stay cheap: a DHT
# node talks to many); it grows when the kernel fills it in one read, i.e. when a
# large record or a stream is arriving, and a quiet connection gives it back (none
# until its next bytes). Growing on a full read also guarantees that a record larger
# than the buffer always gets room.
_RECV_BUFFER_IDLE = 4096
_RELEASE_AFTER_S = 1.0  # quiet this long: a connection gives its buffers back
# After an idle close's GOAWAY, streams the remote opened before it arrived are served
# for this many round trips (within these bounds, in seconds) before the socket closes.
_IN_FLIGHT_RTTS = 4
_IN_FLIGHT_MIN_S = 0.5
_IN_FLIGHT_MAX_S = 5.0
_IN_FLIGHT_CLOSE_S = 120.0  # ... and those streams have this long to finish
# A busy connection is pinged only to keep its RTT fresh (deadlines follow it), this often.
_RTT_REFRESH_S = 60.0
_IDLE_PING_INTERVALS = 4  # ... and one with no open stream after 4 quiet ping intervals
# Records this small are decrypted into their own exact-size buffer instead of a
# pooled 64 KiB one: RPC traffic is mostly small records, and a pooled buffer stays
# with its connection until it goes quiet (a peer of a large swarm receives
# messages of a few KB on hundreds of connections at once).
_SMALL_RECORD = 16384
_RECV_BUFFER_BUSY = 1024 * 1024
# `Stream.readexactly` of more than this takes the bytes as they arrive (below any
# flow-control window, so that a read of n bytes never waits for credit it holds).
_READ_WHOLE = 64 * 1024
_PLAINTEXT_POOL = 64  # reusable record buffers per connection (4 MiB while busy)
# Reusable bulk body buffers per connection. Received bodies that no reader posted a
# buffer for wait in the stream until it is read, so up to a full window of them
# (the mux's max_window / MAX_BULK_BODY: 64 by default) can be out at once: a smaller
# pool would run dry and allocate (and zero) a fresh buffer per body, which took a
# quarter of the receiver's CPU in bench/transport.py. The pool keeps at most a
# window's worth (16 MiB by default; `body_pool_capacity`) and is emptied when the
# connection goes quiet. Sent bodies are out only until the kernel takes them.
_BODY_POOL_OUT = 8
# Queued pieces this large go as bulk bodies: below it, the extra AEAD call and BULK
# frame cost more than copying into a message.
_BULK_MIN = 16 * 1024
_WRITE_BATCH = 256 * 1024
# Encrypted and written per turn of the event loop at most: a bulk transfer then
# yields to heartbeats, timers and requests between turns instead of holding the
# loop for a whole stream window (up to 16 MiB). The write costs more than the
# AES-GCM (over loopback the kernel delivers to the receiver inside the send).
# 512 KiB rather than 2 MiB: the same stream throughput, small RPCs during a bulk
# transfer 2.5x faster (p50 0.75 against 1.9 ms, bench/transport.py) and the
# daemons' event-loop lag p99 during 50M rounds 11-12 ms instead of 21-25 ms
# (bench/allreduce.py).
_FLUSH_BUDGET = 512 * 1024
# After abort(), how long connection_lost may take to be reported before aclose finishes.
_LOST_REPORT_TIMEOUT = 1.0
_COPY_SMALL_WRITES = 64 * 1024  # writes up to this size are copied and return at once
_STREAM_HIGH_WATER = 256 * 1024  # ... while the stream has less than this queued
# Bytes the kernel may hold of ours not yet sent (TCP_NOTSENT_LOWAT). By default it
# takes up to the send buffer, 4 MiB: on a slow uplink shared by several connections
# (10 Mbit/s among 3 all-reduce peers: 0.4 MB/s each) a heartbeat then waited
# behind 10 s of bulk data in the kernel, where the mux's control-first round robin
# cannot reach it, and rounds aborted for a "stalled" member that was only queued
# behind (bench/wan.py, 25M parameters). Capped, what is unsent stays in the mux,
# which sends control frames first; in-flight data is not capped (the window still
# grows to the path's bandwidth-delay product).
_NOTSENT_LOWAT = 128 * 1024


def _limit_unsent(sock: socket.socket) -> None:
    """Cap the unsent bytes the kernel holds (`_NOTSENT_LOWAT`), where the OS can."""
    option = getattr(socket, "TCP_NOTSENT_LOWAT", None)
    if option is None:  # (not every platform has it: there, as before)
        return
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, option, _NOTSENT_LOWAT)


@dataclass(frozen=True, slots=True)
class ConnectionConfig:
    handshake_timeout: float = 10.0
    ping_interval: float = 15.0  # keepalive ping period when the connection is quiet
    ping_timeout: float = 20.0  # no pong for this long: the peer is dead
    idle_timeout: float = 300.0  # no open stream for this long: close (0 disables)
    mux: MuxLimits = field(default_factory=MuxLimits)


class Stream:
    """One bidirectional byte stream inside a connection.

    Reads return data as it arrives; `write` returns once the bytes are either
    copied or encrypted onto the connection, so the caller may reuse its buffer.
    `close` half-closes (the remote reads EOF); `reset` aborts both directions.
    """

    __slots__ = (
        "_buffered",
        "_chunks",
        "_conn",
        "_eof",
        "_error",
        "_posted",
        "_posted_pos",
        "_posts",
        "_read_waiter",
        "_reader_woken",
        "_write_lost",
        "_write_waiter",
        "handler_task",
        "id",
        "initiated_locally",
        "protocol",
    )

    def __init__(self, conn: Connection, stream_id: int, protocol: str, local: bool) -> None:
        self._conn = conn
        self.id = stream_id
        self.protocol = protocol
        self.initiated_locally = local
        self._chunks: deque[memoryview] = deque()
        self._buffered = 0
        self._eof = False
        self._error: TransportError | None = None
        self._read_waiter: asyncio.Future[None] | None = None
        self._reader_woken = False  # woken, and has not run since
        # The buffer a reader waits to fill, and how much of it is filled: bulk bodies
        # are decrypted straight into it (see readexactly_into).
        self._posted: memoryview | None = None
        self._posted_pos = 0
        self._posts = False  # its reader waits with buffers of its own
        self._write_waiter: asyncio.Future[None] | None = None
        self._write_lost = False  # a reset discarded bytes we had queued
        self.handler_task: asyncio.Task[None] | None = None

    @property
    def connection(self) -> Connection:
        return self._conn

    @property
    def remote_peer(self) -> PeerID:
        return self._conn.remote_peer

    # --- fed by the connection ----------------------------------------------------------------

    def _feed(self, data: memoryview) -> None:
        self._chunks.append(data)
        self._buffered += len(data)
        self._wake_reader()

    def _feed_eof(self) -> None:
        self._eof = True
        self._wake_reader()

    def _fail(self, error: TransportError) -> None:
        if self._error is None:
            self._error = error
        self._wake_reader()
        self._wake_writer()

    def _wake_reader(self) -> None:
        w = self._read_waiter
        if w is not None and not w.done():
            w.set_result(None)
            self._reader_woken = True

    def _bulk_target(self, n: int) -> memoryview | None:
        """Where a bulk body of `n` bytes can be decrypted straight to: the unfilled
        part of the buffer a reader waits on, if nothing is queued before the body."""
        posted = self._posted
        if posted is None or self._buffered:
            return None
        pos = self._posted_pos
        if len(posted) - pos < n:
            return None
        return posted[pos : pos + n]

    def _filled(self, n: int) -> None:
        """A body of `n` bytes was decrypted into the posted buffer."""
        assert self._posted is not None
        self._posted_pos += n
        if self._posted_pos == len(self._posted):
            self._wake_reader()

    def _wake_writer(self) -> None:
        w = self._write_waiter
        if w is not None and not w.done():
            w.set_result(None)

    # --- reading ------------------------------------------------------------------------------

    async def _wait_readable(self) -> None:
        if self._error is not None:
            raise self._error
        waiter = self._conn._loop.create_future()
        self._read_waiter = waiter
        try:
            await waiter
        finally:
            self._read_waiter = None
            self._reader_woken = False

    def _take(self, n: int) -> list[memoryview]:
        """Remove exactly n buffered bytes (n <= buffered) as a list of slices."""
        out = []
        chunks = self._chunks
        left = n
        while left:
            head = chunks[0]
            if len(head) <= left:
                out.append(chunks.popleft())
                left -= len(head)
            else:
                out.append(head[:left])
                chunks[0] = head[left:]
                left = 0
        self._buffered -= n
        self._conn._consumed(self.id, n)
        return out

    def _check_error(self) -> None:
        if self._error is not None:
            raise self._error

    async def read(self, max_bytes: int = 65536) -> bytes:
        """Up to `max_bytes` bytes; b"" once the remote side has closed."""
        while not self._buffered:
            if self._eof:
                return b""
            self._check_error()
            await self._wait_readable()
        head = self._chunks[0]
        n = min(max_bytes, len(head))
        return bytes(self._take(n)[0])

    async def readexactly(self, n: int) -> bytes:
        """Exactly n bytes; raises StreamTruncated if the stream ends first."""
        if n > _READ_WHOLE and n > self._buffered:
            # Taken as it arrives: waiting for all n bytes to be buffered first would
            # wait forever past the flow-control window (256 KiB at first), as the
            # remote sends no more until we read (an RPC message of 300 KB hung so).
            out = bytearray(n)
            await self.readexactly_into(out)
            return bytes(out)
        while self._buffered < n:
            if self._eof:
                raise StreamTruncated(
                    f"stream {self.protocol} ended after {self._buffered} of {n} bytes"
                )
            self._check_error()
            await self._wait_readable()
        if n == 0:
            return b""
        parts = self._take(n)
        return bytes(parts[0]) if len(parts) == 1 else b"".join(parts)

    async def readinto(self, buffer: memoryview | bytearray) -> int:
        """Fill as much of `buffer` as is available (at least 1 byte); 0 at EOF."""
        out = memoryview(buffer).cast("B")
        while not self._buffered:
            if self._eof or not len(out):
                return 0
            self._check_error()
            await self._wait_readable()
        n = min(len(out), self._buffered)
        pos = 0
        for part in self._take(n):
            out[pos : pos + len(part)] = part
            pos += len(part)
        return n

    async def readexactly_into(self, buffer: memoryview | bytearray) -> None:
        """Fill all of `buffer` (e.g. a preallocated tensor) from the stream.

        While it waits, bulk data is decrypted straight into `buffer` (no copy). If
        the read fails, the content of `buffer` is unspecified.
        """
        out = memoryview(buffer).cast("B")
        pos = 0
        total = len(out)
        while pos < total:
            if self._buffered:
                pos += self.readinto_nowait(out[pos:])
                continue
            if self._eof:
                raise StreamTruncated(f"stream {self.protocol} ended after {pos} of {total} bytes")
            self._check_error()
            self._posted = out
            self._posted_pos = pos
            self._posts = True
            try:
                await self._wait_readable()
            finally:
                pos = self._posted_pos
                self._posted = None

    def at_eof(self) -> bool:
        return self._eof and not self._buffered

    def peek(self, n: int) -> bytes:
        """The first `n` buffered bytes (fewer if fewer are buffered), left unread."""
        if self._chunks and len(self._chunks[0]) >= n:
            return bytes(self._chunks[0][:n])
        out = bytearray()
        for chunk in self._chunks:
            if len(out) >= n:
                break
            out += chunk[: n - len(out)]
        return bytes(out)

    @property
    def buffered(self) -> int:
        """Bytes received and not read yet."""
        return self._buffered

    async def wait_readable(self) -> None:
        """Return once a read would not block: data buffered, end of stream, or an error."""
        while not self._buffered and not self._eof:
            self._check_error()
            await self._wait_readable()

    def readinto_nowait(self, buffer: memoryview | bytearray) -> int:
        """Copy what is already buffered (up to len(buffer)) without waiting; 0 if none.

        With `wait_readable` this lets a caller pick its destination buffer only
        once data is there (the relayed-connection adapter reads straight into a
        connection's receive buffer, which may be replaced while it waits).
        """
        out = memoryview(buffer).cast("B")
        n = min(len(out), self._buffered)
        if not n:
            self._check_error()
            return 0
        pos = 0
        for part in self._take(n):
            out[pos : pos + len(part)] = part
            pos += len(part)
        return n

    # --- writing ------------------------------------------------------------------------------

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        """Send `data`; returns once it no longer references the caller's buffer."""
        self._check_error()
        mv = memoryview(data)
        if mv.format != "B" or mv.ndim != 1:
            mv = mv.cast("B")
        n = len(mv)
        if not n:
            return
        conn = self._conn
        mux = conn._mux
        queued = mux.queued_bytes(self.id)
        small = n <= _COPY_SMALL_WRITES and queued < _STREAM_HIGH_WATER
        try:
            mux.queue_data(self.id, memoryview(bytes(mv)) if small else mv)
        except ProtocolViolation:
            raise StreamClosed(f"stream {self.protocol} is closed for writing") from None
        conn._schedule_flush()
        if small:
            return
        # Zero-copy path: the queue references the caller's buffer until encrypted.
        await self.drain()

    async def drain(self) -> None:
        """Wait until everything written so far has been handed to the socket.

        A reset that comes after our bytes went out does not fail the write (the
        remote may reset once it has read all it wanted); one that discarded
        queued bytes does.
        """
        mux = self._conn._mux
        while mux.queued_bytes(self.id):
            self._check_error()
            waiter = self._conn._loop.create_future()
            self._write_waiter = waiter
            try:
                await waiter
            finally:
                self._write_waiter = None
        if self._write_lost:
            self._check_error()

    def reserve(self, nbytes: int) -> None:
        """Let the remote send up to `nbytes` (capped by the connection's max window)
        ahead of our reads, from now on: for a reader about to take a large transfer
        into buffers it already holds, so that the flow-control window does not have to
        grow round trip by round trip first."""
        if self._error is None:
            self._conn._mux.reserve(self.id, nbytes)
            self._conn._schedule_flush()

    async def close(self, *, discard_input: bool = False) -> None:
        """Half-close: the remote reads EOF after all data written so far.

        `discard_input=True` also gives up reading: the stream is released as soon
        as the close is sent, whatever the remote side still does.
        """
        if self._error is None:
            self._conn._mux.queue_close(self.id, discard_input=discard_input)
            self._conn._schedule_flush()

    def reset(self, reason: str = "reset") -> None:
        """Abort both directions at once; pending reads and writes fail."""
        if self._error is None:
            self._write_lost = self._conn._mux.queued_bytes(self.id) > 0
            self._conn._reset_stream(self, reason)
            self._fail(StreamReset(f"stream reset locally: {reason}"))

    async def __aenter__(self) -> Stream:
        return self

    async def __aexit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc is not None:
            self.reset(f"{type(exc).__name__}")
        else:
            await self.close()

    def __repr__(self) -> str:
        return f"<Stream {self.id} {self.protocol} to {self._conn.remote_peer.short()}>"


class Connection(asyncio.BufferedProtocol):
    """One TCP connection: Noise XX handshake, then the stream multiplexer."""

    # Slots, not a dict per instance: a peer of a large swarm holds hundreds of these.
    # (`__weakref__`: layers above keep notes per connection in weak maps, e.g. the
    # DHT's addresses said once per connection.)
    __slots__ = (
        "__weakref__",
        "_admit",
        "_bodies_out",
        "_buf",
        "_drain_waiters",
        "_end",
        "_failure",
        "_flush_scheduled",
        "_handshake",
        "_handshake_args",
        "_handshake_started",
        "_idle_since",
        "_keep_open",
        "_life",
        "_loop",
        "_lost_error",
        "_mux",
        "_mv",
        "_no_streams",
        "_on_closed",
        "_on_stream",
        "_paused",
        "_ping_ids",
        "_pings",
        "_recv_cipher",
        "_rtt_at",
        "_rx",
        "_send_cipher",
        "_start",
        "_tasks",
        "_timer",
        "_transport",
        "_tx",
        "access",
        "bulk_bytes_buffered",
        "bulk_bytes_direct",
        "bytes_received",
        "bytes_sent",
        "close_reason",
        "closed",
        "config",
        "created_at",
        "handshake_done",
        "initiator",
        "keepalives_sent",
        "kind",
        "last_activity",
        "local_address",
        "outbound",
        "relay",
        "remote_address",
        "remote_events",
        "remote_peer",
        "rtt",
        "serial",
        "streams",
        "superseded",
    )

    _ids = itertools.count(1)

    def __init__(
        self,
        identity: Identity,
        *,
        initiator: bool,
        expected_peer: PeerID | None = None,
        config: ConnectionConfig | None = None,
        on_stream: Callable[[Stream], None] | None = None,
        on_closed: Callable[[Connection], None] | None = None,
        admit: Callable[[Connection], str | None] | None = None,
        outbound: bool | None = None,
        kind: str = "direct",
        remote_events: RemoteEvents | None = None,
        access: AccessControl | None = None,
        keep_open: Callable[[Connection], bool] | None = None,
    ) -> None:
        self.config = config or ConnectionConfig()
        # Whether the connection stays open past `idle_timeout` even with no stream
        # (the host's protected peers: `Host.protecting`).
        self._keep_open = keep_open
        # Private swarms (transport/access.py): the swarm key and allow list the
        # handshake enforces, and where its refusals are counted. None: open.
        self.access = access
        # Where the log lines a remote end causes go (rate-limited; the host's own).
        self.remote_events = remote_events or _remote_events
        # `initiator` is the Noise and multiplexer role; `outbound` says who opened the
        # underlying transport. They differ only for hole punching, where the role is
        # agreed beforehand (a TCP simultaneous open has no dialer).
        self.initiator = initiator
        self.outbound = initiator if outbound is None else outbound
        self.serial = next(Connection._ids)
        self._loop = asyncio.get_running_loop()
        # The handshake (its ephemeral key: most of what a Connection costs to make) is
        # made once the connection is admitted, so a refused flood costs less.
        self._handshake_args = (identity, initiator, expected_peer)
        self._handshake: SecureHandshake | None = None
        self._on_stream = on_stream
        self._on_closed = on_closed
        self._admit = admit
        # Stream handlers and the connection's own helpers: cancelled when it closes.
        self._tasks = TaskSet(log, "connection")
        self._mux = _multiplexer(initiator, self.config)
        self._send_cipher = None
        self._recv_cipher = None
        self._buf = bytearray(_RECV_BUFFER_IDLE)
        # A reusable buffer to encrypt bodies into.
        self._bodies_out = _BufferPool(MAX_BULK_BODY + _TAG, _BODY_POOL_OUT)
        # Bulk body bytes decrypted straight into a reader's buffer, and into a spare
        # buffer (then copied when read): how well the zero-copy path works.
        self.bulk_bytes_direct = 0
        self.bulk_bytes_buffered = 0
        self._mv = memoryview(self._buf)
        self._start = 0
        self._end = 0
        self._transport: asyncio.Transport | None = None
        self._paused = False
        self._flush_scheduled = False
        self._drain_waiters: list[asyncio.Future[None]] = []
        self.streams: dict[int, Stream] = {}
        self.handshake_done: asyncio.Future[PeerID] = self._loop.create_future()
        self.closed: asyncio.Future[None] = self._loop.create_future()
        self.close_reason: str | None = None
        self._failure: TransportError | None = None
        self.remote_peer: PeerID = None  # type: ignore[assignment]  # set by the handshake
        self.remote_address: tuple[str, int] | None = None
        self.local_address: tuple[str, int] | None = None
        self.bytes_sent = 0
        self.bytes_received = 0
        self.created_at = _now()
        self.last_activity = self.created_at
        self.rtt: float | None = None
        self._rtt_at = -math.inf  # when `rtt` was last sampled
        self.keepalives_sent = 0  # pings of the keepalive timer
        self._pings: dict[int, tuple[float, asyncio.Future[float]]] = {}
        self._ping_ids = itertools.count(1)
        self._timer: asyncio.TimerHandle | None = None
        self._idle_since: float | None = self.created_at
        # Set once no stream is open, for a graceful close waiting on them (made only
        # then: an asyncio.Event per connection is a deque of its own).
        self._no_streams: asyncio.Future[None] | None = None
        self.superseded = False  # a duplicate connection kept only until its streams end
        self.kind = kind  # "direct" | "relayed" | "hole-punched"
        self.relay: PeerID | None = None  # for a relayed connection: the relay's peer ID
        self._lost_error: ConnectionLost | None = None
        self._handshake_started = False
        self._rx, self._tx, self._life = _Receiver(self), _Sender(self), _Lifecycle(self)

    # --- public API ---------------------------------------------------------------------------

    def set_role(self, initiator: bool, expected_peer: PeerID | None = None) -> None:
        """Take the Noise/multiplexer role `initiator` (before the handshake starts).

        For a hole-punched connection that was accepted by our listener although
        we are the agreed handshake initiator.
        """
        if self._handshake_started:
            raise RuntimeError("the handshake role is fixed once the handshake has started")
        self.initiator = initiator
        self._handshake_args = (self._handshake_args[0], initiator, expected_peer)
        self._mux = _multiplexer(initiator, self.config)

    @property
    def is_open(self) -> bool:
        return self.handshake_done.done() and not self.closed.done()

    @property
    def went_away(self) -> bool:
        """Either end sent a GOAWAY: the connection ends (or ended) in order, an idle
        close, a trim, a retired duplicate or a host closing, and not a lost peer; a
        stream still open on it fails or ends by itself."""
        return self._mux.local_goaway or self._mux.remote_goaway

    @property
    def accepting_streams(self) -> bool:
        return (
            self.is_open
            and not self.superseded
            and not self._mux.remote_goaway
            and not self._mux.local_goaway
        )

    async def open_stream(self, protocol: str) -> Stream:
        if not self.handshake_done.done():
            await asyncio.shield(self.handshake_done)
        return self.open_stream_now(protocol)

    def open_stream_now(self, protocol: str) -> Stream:
        """`open_stream` once the handshake is done, without yielding to the loop: a
        stream opened here goes out before any stream a task opens afterwards (the
        protocol-version hello must be a connection's first stream)."""
        if not self.handshake_done.done():
            raise ConnectionLost(f"connection to {self._peer_name()} is not established yet")
        if self.closed.done():
            raise ConnectionLost(f"connection to {self._peer_name()} is closed")
        try:
            sid = self._mux.open_stream(protocol)
        except ProtocolViolation as e:
            raise ConnectionLost(f"{self._peer_name()}: {e}") from None
        stream = Stream(self, sid, protocol, True)
        self.streams[sid] = stream
        if self._idle_since is not None:
            self._idle_since = None
            self._life.stream_opened()
        self._schedule_flush()
        return stream

    async def ping(self, timeout: float = 10.0) -> float:
        """Round-trip time in seconds, measured with a multiplexer PING."""
        if not self.is_open:
            raise ConnectionLost(f"connection to {self._peer_name()} is closed")
        opaque = next(self._ping_ids) & 0xFFFFFFFF
        fut: asyncio.Future[float] = self._loop.create_future()
        self._pings[opaque] = (_now(), fut)
        self._mux.ping(opaque)
        self._schedule_flush()
        try:
            async with asyncio.timeout(timeout):
                return await fut
        finally:
            self._pings.pop(opaque, None)

    def spawn(self, coro: Coroutine[object, object, None], stream: Stream | None = None) -> None:
        """Run a stream handler owned by this connection (cancelled when it closes)."""
        task = self._tasks.spawn(coro)
        if stream is not None:
            stream.handler_task = task

    def retire(self, grace: float) -> None:
        """A duplicate of a better connection to the same peer: refuse new streams and
        close once the streams already open are done (at most `grace` seconds). The
        remote may not know of the other connection yet (its handshake ends later on
        its side) and open a stream on this one as we retire it: as for an idle close,
        streams it opened before our GOAWAY reached it are served (reset, one aborted
        an all-reduce round in CI)."""
        self.superseded = True
        self._mux.go_away(serve_in_flight=True)
        self._schedule_flush()
        self.spawn(self._retire_after_in_flight(grace))  # owned (cancelled on close)

    async def _retire_after_in_flight(self, grace: float) -> None:
        await self._in_flight_window()
        self._mux.stop_serving_in_flight()
        await self.aclose(grace)

    def refuse_stream(self, stream: Stream, reason: str, *, unknown_protocol: bool) -> None:
        """Reset a stream the remote opened that nobody will serve; `unknown_protocol`
        tells the opener the protocol is not spoken here (vs. a passing refusal)."""
        self._mux.reset_stream(stream.id, reason, refused=unknown_protocol)
        self.streams.pop(stream.id, None)
        self._schedule_flush()

    @property
    def idle_for(self) -> float | None:
        """Seconds since its last stream ended, none open now (or since the handshake,
        when none ever opened); None while a stream is open or before the handshake."""
        if self.streams or self._idle_since is None or not self.handshake_done.done():
            return None
        return _now() - self._idle_since

    def close_idle(self, reason: str) -> None:
        """Close a connection with no stream open, gracefully (`reason`: "idle" past
        `idle_timeout`, "trimmed" by the host's bound). The remote may be opening a
        stream at this moment: a GOAWAY first, then streams it opened before the
        GOAWAY reached it are still served for a few round trips, and the socket
        closes once they are done (a closed socket would fail them: a round aborts)."""
        if self.close_reason is not None or self.closed.done():
            return
        log.debug("closing %s connection to %s", reason, self._peer_name())
        self.close_reason = reason
        self._mux.go_away(serve_in_flight=True)
        self._tx.flush()
        self.spawn(self._close_after_in_flight())

    async def _close_after_in_flight(self) -> None:
        await self._in_flight_window()
        self._mux.stop_serving_in_flight()
        await self._life.aclose(_IN_FLIGHT_CLOSE_S)

    async def _in_flight_window(self) -> None:
        """Until streams the remote opened before our GOAWAY reached it have arrived."""
        rtt = self.rtt if self.rtt is not None else 0.25
        await asyncio.sleep(min(_IN_FLIGHT_MAX_S, max(_IN_FLIGHT_MIN_S, _IN_FLIGHT_RTTS * rtt)))

    def abort(self, reason: str) -> None:
        """Close at once, failing every stream with ConnectionLost(reason)."""
        if self.close_reason is None:
            self.close_reason = reason
        if self._transport is not None:
            self._transport.abort()
        else:
            self._life.finish(reason)

    async def aclose(self, timeout: float = 5.0) -> None:
        """Graceful close: refuse new streams, let open ones finish, then close."""
        await self._life.aclose(timeout)

    @property
    def sent_by_protocol(self) -> dict[str, int]:
        """Stream payload sent, by protocol (`Multiplexer.sent_by_protocol`); live."""
        return self._mux.sent_by_protocol

    def stats(self) -> dict[str, object]:
        return {
            "peer_id": str(self.remote_peer) if self.remote_peer else None,
            "kind": self.kind,
            "relay": str(self.relay) if self.relay else None,
            "initiator": self.initiator,
            "outbound": self.outbound,
            "remote_address": self.remote_address,
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "streams": len(self.streams),
            "rtt_ms": None if self.rtt is None else round(self.rtt * 1000, 3),
            "age_s": round(_now() - self.created_at, 3),
        }

    # --- asyncio protocol callbacks ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # uvloop's is not a subclass
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
            _limit_unsent(sock)
        peer = transport.get_extra_info("peername")
        local = transport.get_extra_info("sockname")
        self.remote_address = (peer[0], peer[1]) if peer else None
        self.local_address = (local[0], local[1]) if local else None
        if self._admit is not None:
            refusal = self._admit(self)
            if refusal is not None:
                self.remote_events.info(
                    "connection refused",
                    self.remote_key(),
                    "refusing connection from %s: %s",
                    self._peer_name(),
                    refusal,
                )
                self.abort(refusal)
                return
        transport.set_write_buffer_limits(high=_WRITE_BATCH, low=_WRITE_BATCH // 4)
        self._timer = self._loop.call_later(self.config.handshake_timeout, self._life.on_timer)
        access = self.access
        if access is None:
            self._handshake = SecureHandshake(*self._handshake_args)
        else:
            self._handshake = SecureHandshake(
                *self._handshake_args, psk=access.swarm_key, authorize=access.authorize
            )
        self._handshake_started = True
        first = self._handshake.start()
        if first:
            self._write_raw(first)

    def get_buffer(self, sizehint: int) -> memoryview:
        if not self._buf:  # (a quiet connection holds none: `release_buffers`)
            self._resize_buffer(_RECV_BUFFER_IDLE)
        if len(self._buf) - self._end < min(_MIN_FREE, len(self._buf) // 2):
            # Move the partial record to the front; at most one record is ever moved.
            pending = self._end - self._start
            self._buf[:pending] = self._mv[self._start : self._end]
            self._start, self._end = 0, pending
        return self._mv[self._end :]

    def _resize_buffer(self, size: int) -> None:
        pending = bytes(self._mv[self._start : self._end])
        self._buf = bytearray(size)
        self._buf[: len(pending)] = pending
        self._mv = memoryview(self._buf)
        self._start, self._end = 0, len(pending)

    def buffer_updated(self, nbytes: int) -> None:
        self._end += nbytes
        filled = self._end == len(self._buf)
        self.bytes_received += nbytes
        self.last_activity = _now()
        try:
            if self._handshake is not None:
                self._rx.advance_handshake()
            if self._handshake is None:
                if not self._rx.resume_pending:
                    self._rx.process_records()
                elif len(self._buf) - self._end < _MIN_FREE:
                    # Paused for a reader, but the buffer is filling up: go on now.
                    self._rx.process_records()
        except TransportError as e:
            self._life.violation(e)
            return
        if filled and len(self._buf) < _RECV_BUFFER_BUSY and not self.closed.done():
            # One read filled it: a big record or a stream is arriving. Grow to hold the
            # record in progress whole, and double towards the streaming size. (Not at
            # once to the largest record's size: a peer of a large swarm receives 5-KB
            # messages on hundreds of connections at once; up to 256 KiB each was most
            # of a simulated 128-peer burst's memory.)
            needed = self._rx.pending_record_size()
            self._resize_buffer(min(_RECV_BUFFER_BUSY, max(needed, 2 * len(self._buf))))
        if len(self._buf) > _RECV_BUFFER_IDLE or self._rx.plaintexts.holding:
            self._life.watch_buffers()

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        self._tx.flush()

    def eof_received(self) -> bool:
        return False  # close the transport; streams learn through connection_lost

    def connection_lost(self, exc: Exception | None) -> None:
        if isinstance(exc, ConnectionLost):
            # A typed cause from the transport (e.g. a relay that cut the circuit) is what
            # every stream of this connection fails with.
            self._lost_error = exc
        if self.close_reason is None:
            self.close_reason = f"connection lost: {exc}" if exc else "closed by peer"
        self._life.finish(self.close_reason)

    # --- internals: handshake -----------------------------------------------------------------

    # --- internals: receiving -----------------------------------------------------------------

    def _deliver(self, stream_id: int, data: memoryview) -> None:
        stream = self.streams.get(stream_id)
        if stream is not None:
            stream._feed(data)
        else:  # the application already dropped it: keep the window moving
            self._mux.reset_stream(stream_id, "stream abandoned")

    # --- internals: sending -------------------------------------------------------------------

    def _schedule_flush(self) -> None:
        # Coalesce every write of this loop iteration into as few records as possible.
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._tx.flush)

    def _write_raw(self, data: bytes) -> None:
        assert self._transport is not None
        self.bytes_sent += len(data)
        self._transport.write(data)

    def _consumed(self, sid: int, n: int) -> None:
        mux = self._mux
        mux.consumed(sid, n, _now())
        if mux.has_output():
            self._schedule_flush()
        self._drop_finished()

    def _reset_stream(self, stream: Stream, reason: str) -> None:
        self._mux.reset_stream(stream.id, reason)
        self.streams.pop(stream.id, None)
        self._schedule_flush()
        self._note_idle()

    def _drop_finished(self) -> None:
        # The multiplexer forgets a stream once both directions are closed and all of
        # its data was read (or it was reset); the Stream object goes with it.
        finished = self._mux.take_finished()
        if finished:
            for sid in finished:
                self.streams.pop(sid, None)
            self._note_idle()

    def _streams_gone(self) -> None:
        waiter = self._no_streams
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _note_idle(self) -> None:
        if not self.streams:
            self._streams_gone()
            if self._idle_since is None:
                self._idle_since = _now()

    # --- internals: timers, errors, teardown -----------------------------------------------------

    def _arm_timer(self) -> None:
        self._timer = self._loop.call_later(self.config.ping_interval, self._life.on_timer)

    def remote_key(self) -> str | None:
        """Who to blame in a log summary: the remote IP, else the relay or peer."""
        if self.remote_address:
            return str(self.remote_address[0])
        if self.relay is not None:
            return f"relay {self.relay.short()}"
        return None if self.remote_peer is None else self.remote_peer.short()

    def _peer_name(self) -> str:
        if self.remote_address:
            addr = f"{self.remote_address[0]}:{self.remote_address[1]}"
        else:
            addr = f"relay {self.relay.short()}" if self.relay is not None else "?"
        if self.remote_peer is not None:
            return f"{self.remote_peer.short()}@{addr}"
        return addr


class _Receiver:
    """The receiving side of a connection: its handshake messages, then records
    decrypted and their frames dispatched to streams (bulk bodies straight into a
    reader's buffer where one waits)."""

    # Slots, not a dict per instance: a peer of a large swarm holds hundreds of these.
    __slots__ = (
        "bodies_in",
        "body",
        "conn",
        "paused_for",
        "plaintexts",
        "reading_paused",
        "resume_pending",
    )

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        # Reusable buffers to decrypt records and bodies into.
        self.plaintexts = _BufferPool(MAX_MESSAGE_PLAINTEXT, _PLAINTEXT_POOL)
        self.bodies_in = _BufferPool(MAX_BULK_BODY, body_pool_capacity(conn.config.mux))
        self.body: BulkIncoming | None = None  # announced, and next on the wire
        # Record processing paused for one loop iteration (see process_records), and
        # the body it paused for (it pauses once per body).
        self.resume_pending = False
        self.paused_for: BulkIncoming | None = None
        self.reading_paused = False  # the socket waits while a reader gets ready

    def advance_handshake(self) -> None:
        c = self.conn
        hs = c._handshake
        assert hs is not None
        data = bytes(c._mv[c._start : c._end])
        c._start = c._end = 0
        reply = hs.receive(data)
        if reply:
            c._write_raw(reply)
        if not hs.complete:
            return
        c._handshake = None
        c._send_cipher = hs.send_cipher
        c._recv_cipher = hs.recv_cipher
        assert hs.remote_peer is not None
        c.remote_peer = hs.remote_peer
        leftover = hs.leftover
        if leftover:
            c._buf[: len(leftover)] = leftover
            c._end = len(leftover)
        if c._timer is not None:
            c._timer.cancel()
        c._arm_timer()
        # A first RTT at once (keepalive pings start only when the connection is quiet):
        # the deadlines of requests on it follow the RTT (the DHT's, for one).
        opaque = next(c._ping_ids) & 0xFFFFFFFF
        c._pings[opaque] = (_now(), c._loop.create_future())
        c._mux.ping(opaque)
        c.handshake_done.set_result(c.remote_peer)
        c._tx.flush()

    def pending_record_size(self) -> int:
        """The bytes the record at the buffer's start takes in all (0: not known yet)."""
        c = self.conn
        if self.body is not None:
            return self.body.length + _TAG
        if c._handshake is None and c._end - c._start >= 2:
            return 2 + ((c._buf[c._start] << 8) | c._buf[c._start + 1])
        return 0

    def process_records(self) -> None:
        c = self.conn
        buf = c._buf
        mv = c._mv
        pos = c._start
        end = c._end
        recv = c._recv_cipher
        mux = c._mux
        now = _now()
        while True:
            body = self.body
            if body is not None:
                size = body.length + _TAG  # no length prefix: BULK announced it
                if end - pos < size:
                    break
                stream = c.streams.get(body.stream_id) if body.deliver else None
                target = None
                if stream is not None:
                    target = stream._bulk_target(body.length)
                    if target is None and self._wait_for_reader(stream, body, len(buf) - end):
                        break
                if target is not None:
                    c.bulk_bytes_direct += body.length
                    out = target
                else:
                    c.bulk_bytes_buffered += body.length
                    out = self.bodies_in.take()
                try:
                    recv.decrypt_into(mv[pos : pos + size], out)
                except HandshakeError:
                    raise ProtocolViolation("record failed authentication") from None
                pos += size
                c._start = pos
                self.body = None
                if target is not None:
                    assert stream is not None
                    stream._filled(body.length)
                    c._consumed(body.stream_id, body.length)
                elif body.deliver:
                    c._deliver(body.stream_id, memoryview(out)[: body.length])
                continue
            if end - pos < 2:
                break
            n = (buf[pos] << 8) | buf[pos + 1]
            if end - pos - 2 < n:
                break
            if n < _TAG:
                raise ProtocolViolation(f"record of {n} bytes is shorter than its tag")
            buf_out = bytearray(n - _TAG) if n - _TAG <= _SMALL_RECORD else self.plaintexts.take()
            try:
                size = recv.decrypt_into(mv[pos + 2 : pos + 2 + n], buf_out)
            except HandshakeError:
                raise ProtocolViolation("record failed authentication") from None
            plaintext = memoryview(buf_out)[:size]
            pos += 2 + n
            c._start = pos
            for event in mux.receive_message(plaintext, now):
                if type(event) is BulkIncoming:
                    self.body = event  # the mux made sure it is the message's last frame
                else:
                    self.dispatch(event)
            if c.closed.done():
                return
        if pos == end:
            c._start = c._end = 0
        else:
            c._start = pos
        c._drop_finished()
        if mux.has_output():
            c._schedule_flush()

    def _wait_for_reader(self, stream: Stream, body: BulkIncoming, room: int) -> bool:
        """Whether to stop before `body` for one loop iteration (resumed then)."""
        if not (stream._posts and stream._reader_woken and self.paused_for is not body):
            return False
        # Its reader was just handed the data before this body (say, a chunk header)
        # and may now wait for the body with a buffer of its own: let it run first,
        # then decrypt straight into that. Once per body, for one loop iteration.
        # Without room for another record, the socket waits too (in the kernel's
        # buffer): decrypting into a spare buffer instead would cost a copy of every
        # later body of the stream (they queue behind this one), which is most bodies
        # at full speed.
        c = self.conn
        self.paused_for = body
        self.resume_pending = True
        if room < _MIN_FREE and c._transport is not None:
            c._transport.pause_reading()
            self.reading_paused = True
        c._loop.call_soon(self.resume_records)
        return True

    def resume_records(self) -> None:
        c = self.conn
        self.resume_pending = False
        if c.closed.done():
            return
        try:
            self.process_records()
        except TransportError as e:
            c._life.violation(e)
            return
        if self.reading_paused and not self.resume_pending and not c.closed.done():
            self.reading_paused = False
            if c._transport is not None:
                c._transport.resume_reading()

    def dispatch(self, event: object) -> None:
        c = self.conn
        if type(event) is DataReceived:
            c._deliver(event.stream_id, event.data)
        elif type(event) is StreamOpened:
            stream = Stream(c, event.stream_id, event.protocol, False)
            c.streams[event.stream_id] = stream
            if c._idle_since is not None:
                c._idle_since = None
                c._life.stream_opened()
            if c._on_stream is None:
                c._mux.reset_stream(event.stream_id, "no handlers", refused=True)
                del c.streams[event.stream_id]
            else:
                c._on_stream(stream)
        elif type(event) is StreamEnded:
            stream = c.streams.get(event.stream_id)
            if stream is not None:
                stream._feed_eof()
        elif type(event) is StreamWasReset:
            stream = c.streams.pop(event.stream_id, None)
            if stream is not None:
                err: StreamReset
                if event.refused:
                    err = ProtocolNotSupported(
                        f"{c._peer_name()} does not support {stream.protocol}: {event.reason}"
                    )
                else:
                    err = StreamReset(f"stream reset by {c._peer_name()}: {event.reason}")
                stream._write_lost = event.unsent > 0
                stream._fail(err)
                if stream.handler_task is not None:
                    stream.handler_task.cancel()  # propagate cancellation to the handler
                c._note_idle()
        elif type(event) is PongReceived:
            entry = c._pings.pop(event.opaque, None)
            if entry is not None:
                rtt = _now() - entry[0]
                c.rtt = rtt if c.rtt is None else 0.8 * c.rtt + 0.2 * rtt
                c._rtt_at = _now()
                c._mux.rtt = c.rtt
                if not entry[1].done():
                    entry[1].set_result(rtt)
        elif type(event) is GoAwayReceived:
            log.debug("%s is going away (code %d)", c._peer_name(), event.code)


class _Sender:
    """The sending side of a connection: the multiplexer's output framed, sealed and
    written in batches."""

    # Slots, not a dict per instance: a peer of a large swarm holds hundreds of these.
    __slots__ = ("conn",)

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def flush(self) -> None:
        c = self.conn
        c._flush_scheduled = False
        transport = c._transport
        if transport is None or c._send_cipher is None or c.closed.done():
            return
        if transport.is_closing():  # (lost, not yet told: uvloop raises on a write)
            return
        mux = c._mux
        cipher = c._send_cipher
        encrypt_into, seal_in_place = cipher.encrypt_into, cipher.seal_in_place
        batch: list[bytearray | memoryview] = []
        size = flushed = 0
        while not c._paused:
            out = mux.next_output()
            if out is None:
                break
            msg, body = out
            n = len(msg) - _LEN.size - _TAG
            _LEN.pack_into(msg, 0, n + _TAG)
            mv = memoryview(msg)
            seal_in_place(mv[2:], n)
            batch.append(msg)
            size += len(msg)
            if body is not None:
                # Sealed before the stream's writer learns that it drained: the
                # application may reuse its buffer as soon as it does.
                record = memoryview(c._bodies_out.take())[: len(body) + _TAG]
                encrypt_into(body, record)
                batch.append(record)
                size += len(record)
            if size >= _WRITE_BATCH:
                c.bytes_sent += size
                if not _write(c, transport, batch):
                    return
                flushed += size
                batch = []
                size = 0
                if transport.is_closing():
                    # That write failed (a reset): uvloop closed the transport and
                    # raises on the next one; connection_lost follows.
                    return
                if flushed >= _FLUSH_BUDGET and mux.has_output():
                    c._schedule_flush()  # the rest at the next turn
                    break
        if batch:
            c.bytes_sent += size
            if not _write(c, transport, batch):
                return
        for sid in mux.take_drained():
            stream = c.streams.get(sid)
            if stream is not None:
                stream._wake_writer()
        c._drop_finished()


def _write(
    c: Connection, transport: asyncio.Transport, batch: list[bytearray | memoryview]
) -> bool:
    """Write `batch`; False when the transport turned out closed. uvloop can close a
    stream's handle while `is_closing()` still says no (MagicStack/uvloop#506), and
    raises on every write after; a soak's peer then logged that error every second
    for 23 s, its connection never told it was lost. It ends here instead."""
    try:
        transport.writelines(batch)
    except RuntimeError as e:  # ("unable to perform operation on ...: the handler is closed")
        c.connection_lost(ConnectionResetError(f"the transport closed under us: {e}"))
        with contextlib.suppress(Exception):
            transport.abort()
        return False
    return True


class _Lifecycle:
    """The life of a connection after it is made: its keepalive timer (handshake
    deadline, pings, idle close), its violations, its graceful close and its end."""

    # Slots, not a dict per instance: a peer of a large swarm holds hundreds of these.
    __slots__ = (
        "_release",
        "conn",
    )

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._release: asyncio.TimerHandle | None = None

    def watch_buffers(self) -> None:
        """The connection holds more than an idle one (a grown receive buffer, pooled
        record buffers): give it back once quiet, checked every `_RELEASE_AFTER_S`,
        not only at the next keepalive timer (15 s). A DHT node answering hundreds of
        peers grows many buffers for one large message each."""
        if self._release is None:
            self._release = self.conn._loop.call_later(_RELEASE_AFTER_S, self._release_if_quiet)

    def _release_if_quiet(self) -> None:
        self._release = None
        if not self.conn.closed.done() and not self.release_buffers():
            self.watch_buffers()  # (still busy: look again later)

    def release_buffers(self) -> bool:
        """Shrink the receive buffer and drop the pooled ones when the connection is
        quiet (nothing buffered, nothing received for `_RELEASE_AFTER_S`); whether it was."""
        c = self.conn
        if c._start != c._end or _now() - c.last_activity <= _RELEASE_AFTER_S:
            return False
        if c._buf:
            # Give the memory back, all of it: a peer of a large swarm holds hundreds of
            # quiet connections (4 KiB each was 0.8 GB of a simulated 1,000-peer swarm).
            c._resize_buffer(0)
        c._rx.plaintexts.clear()
        c._rx.bodies_in.clear()
        c._bodies_out.clear()
        return True

    def on_timer(self) -> None:
        c = self.conn
        if c.closed.done():
            return
        now = _now()
        self.release_buffers()
        if not c.handshake_done.done():
            c.remote_events.info(
                "handshake not finished",
                c.remote_key(),
                "closing connection from %s: handshake not finished in %.1fs",
                c._peer_name(),
                c.config.handshake_timeout,
            )
            c.abort("handshake timeout")
            return
        cfg = c.config
        oldest = min((t for t, _ in c._pings.values()), default=None)
        if oldest is not None and now - oldest > cfg.ping_timeout:
            log.info("closing connection to %s: no pong for %.0fs", c._peer_name(), now - oldest)
            c.abort(f"peer unresponsive (no pong for {now - oldest:.0f}s)")
            return
        idle = c._idle_since is not None and not c.streams
        timed_out = idle and now - c._idle_since >= cfg.idle_timeout  # type: ignore[operator]
        # Not a protected peer's: a round's member opens its next stream at any moment,
        # and one opened as our GOAWAY went out aborted the round (sim: connections idle
        # since the swarm's join reached `idle_timeout` as the rounds of a 1,000-peer
        # burst began; both ends were left out of the retry).
        if cfg.idle_timeout and timed_out and (c._keep_open is None or not c._keep_open(c)):
            c.close_idle("idle")
            return
        # A keepalive only for a connection quiet for a whole interval (or one whose RTT
        # is stale), one ping at a time: pinging every connection at every tick, busy or
        # not, was most of an idle swarm's traffic (4 records per connection per 10 s,
        # on hundreds of connections a peer). The other side's pings and our pongs keep
        # a quiet connection's two ends from both pinging. One with no open stream
        # waits for its idle close: no caller waits on it, and a ping a minute still
        # keeps a NAT's mapping and finds a dead peer before the close.
        quiet_after = cfg.ping_interval if c.streams else cfg.ping_interval * _IDLE_PING_INTERVALS
        quiet = now - c.last_activity >= quiet_after
        if oldest is None and (quiet or now - c._rtt_at >= _RTT_REFRESH_S):
            opaque = next(c._ping_ids) & 0xFFFFFFFF
            c._pings[opaque] = (now, c._loop.create_future())
            c._mux.ping(opaque)
            c.keepalives_sent += 1
            c._schedule_flush()
        c._timer = c._loop.call_later(self._next_tick(now), c._life.on_timer)

    def _next_tick(self, now: float) -> float:
        """Seconds to the next timer: a tick while anything could go wrong unseen (an
        open stream, a ping out); an idle connection sleeps till its ping or its idle
        close (ticks of hundreds of idle connections were 8% of a simulated swarm's
        time). `stream_opened` wakes it sooner."""
        c = self.conn
        cfg = c.config
        tick = min(cfg.ping_interval, cfg.ping_timeout / 2)
        if c.streams or c._pings:
            return tick
        due = c.last_activity + cfg.ping_interval * _IDLE_PING_INTERVALS
        if cfg.idle_timeout and c._idle_since is not None:
            due = min(due, c._idle_since + cfg.idle_timeout)
        return max(tick, due - now)

    def stream_opened(self) -> None:
        """A stream opened on a connection that may sleep till its idle ping: back to
        ticking, so that a peer gone dead under the stream is found in time."""
        c = self.conn
        timer = c._timer
        if timer is None or timer.cancelled():
            return
        tick = min(c.config.ping_interval, c.config.ping_timeout / 2)
        if timer.when() > c._loop.time() + tick:
            timer.cancel()
            c._timer = c._loop.call_later(tick, self.on_timer)

    def violation(self, error: TransportError) -> None:
        c = self.conn
        if isinstance(error, AccessRefused):
            # Our access rules at work, not a broken peer: counted, one line per remote.
            if c.access is not None:
                c.access.refused(error.reason)
            c.remote_events.warning(
                "access refused",
                c.remote_key(),
                "refusing connection with %s: %s",
                c._peer_name(),
                error,
            )
            if c._failure is None:
                c._failure = error
            c.abort(str(error))
            return
        c.remote_events.warning(
            "protocol violation",
            c.remote_key(),
            "closing connection to %s: %s",
            c._peer_name(),
            error,
        )
        if c._failure is None:
            c._failure = error
        c.abort(str(error))

    def finish(self, reason: str) -> None:
        c = self.conn
        if c.closed.done():
            return
        if c._timer is not None:
            c._timer.cancel()
        err = c._lost_error or ConnectionLost(f"connection to {c._peer_name()} lost: {reason}")
        for stream in c.streams.values():
            stream._write_lost = c._mux.queued_bytes(stream.id) > 0
        if not c.handshake_done.done():
            failure = c._failure
            if failure is None and c._life.unanswered_with_key():
                failure = c._life.unanswered_failure(reason)
            if not isinstance(failure, HandshakeError):  # keep PeerIDMismatch & co. as they are
                failure = HandshakeError(f"handshake with {c._peer_name()} failed: {reason}")
            c.handshake_done.set_exception(failure)
            c.handshake_done.exception()  # mark retrieved: the dialer reports it
        for stream in list(c.streams.values()):
            stream._fail(err)
            if stream.handler_task is not None:
                stream.handler_task.cancel()
        c.streams.clear()
        c._streams_gone()
        c._tasks.cancel()
        for _, fut in c._pings.values():
            if not fut.done():
                fut.set_exception(err)
                fut.exception()
        c._pings.clear()
        c.closed.set_result(None)
        if c._on_closed is not None:
            c._on_closed(c)

    def unanswered_with_key(self) -> bool:
        """We dialed with a swarm key and the remote closed without a word: what a peer
        with another key (or none) does, since it cannot read our first message."""
        c = self.conn
        hs, why = c._handshake, c.close_reason or ""
        closed_by_remote = why == "closed by peer" or why.startswith("connection lost")
        return (
            closed_by_remote
            and hs is not None
            and hs.unanswered
            and c.access is not None
            and c.access.swarm_key is not None
        )

    def unanswered_failure(self, reason: str) -> HandshakeError:
        c = self.conn
        assert c.access is not None
        c.access.unanswered += 1
        return HandshakeError(
            f"handshake with {c._peer_name()} failed: {reason} before answering our first "
            "message: its swarm key probably differs from ours (or it has none)"
        )

    async def aclose(self, timeout: float = 5.0) -> None:
        """Graceful close: refuse new streams, let open ones finish, then close."""
        c = self.conn
        if c.closed.done():
            return
        if c.is_open:
            c._mux.go_away()
            c._schedule_flush()
            if c.streams:
                waiter = c._no_streams
                if waiter is None or waiter.done():  # (two closes wait on one)
                    c._no_streams = waiter = c._loop.create_future()
                try:
                    async with asyncio.timeout(timeout):
                        await asyncio.shield(waiter)  # also set when the connection dies
                except TimeoutError:
                    log.debug("closing %s with %d streams open", c._peer_name(), len(c.streams))
        if c.close_reason is None:
            c.close_reason = "closed locally"
        if c._transport is not None and not c.closed.done():
            c._transport.close()  # flushes what is buffered, then closes
            try:
                async with asyncio.timeout(timeout):
                    await asyncio.shield(c.closed)
            except TimeoutError:
                c._transport.abort()
        if not c.closed.done():
            # abort() reports connection_lost on a later loop iteration; should the
            # event loop never report it (seen with uvloop on a transport that was
            # closing with unsent data), finish by hand rather than wait forever.
            try:
                async with asyncio.timeout(_LOST_REPORT_TIMEOUT):
                    await asyncio.shield(c.closed)
            except TimeoutError:
                log.debug("%s: no connection_lost after abort; finishing", c._peer_name())
                c._life.finish(c.close_reason)


def _multiplexer(initiator: bool, config: ConnectionConfig) -> Multiplexer:
    return Multiplexer(
        initiator, config.mux, head_room=_LEN.size, tail_room=_TAG, bulk_min=_BULK_MIN
    )


def bulk_buffer_bytes(limits: MuxLimits, streams: int) -> int:
    """The most a connection's buffers hold for `streams` streams of bulk data at
    once: what waits on each for its reader (a receive window: the pool's received
    bodies) and the pool of bodies sent that the kernel has not taken yet."""
    return streams * limits.max_window + _BODY_POOL_OUT * (MAX_BULK_BODY + _TAG)


def body_pool_capacity(limits: MuxLimits) -> int:
    """Received bulk bodies a connection keeps for reuse: as many as its streams'
    windows let the remote have in flight to one stream (`MuxLimits.max_window`)."""
    return max(1, -(-limits.max_window // MAX_BULK_BODY))


class _BufferPool:
    """Fixed-size byte buffers, reused once nothing references them any more.

    A buffer is free again when it has no exported views left: a bytearray with
    live views refuses to change size. Received stream data stays a view of its
    record's plaintext until the application reads it, and the event loop's
    transport holds a view of a sent buffer until the kernel took it. Reuse spares
    an allocation per buffer, and with it the page faults of the allocator handing
    the memory back and forth to the kernel.
    """

    __slots__ = ("_capacity", "_free", "size")

    def __init__(self, size: int, capacity: int) -> None:
        self.size = size
        self._capacity = capacity
        # Made at the first take: an empty deque is about 600 bytes, and most of the
        # connections of a DHT node (three pools each) never send a bulk body.
        self._free: deque[bytearray] | None = None

    def take(self) -> bytearray:
        pool = self._free
        if pool is None:
            pool = self._free = deque()
        for _ in range(min(2, len(pool))):
            buf = pool[0]
            pool.rotate(-1)  # round-robin, so one long-held buffer does not block the rest
            try:
                buf.append(0)
                buf.pop()
            except BufferError:  # still referenced
                continue
            return buf
        buf = bytearray(self.size)
        if len(pool) < self._capacity:
            pool.append(buf)
        return buf

    @property
    def holding(self) -> bool:
        """Whether it keeps any buffer."""
        return bool(self._free)

    def clear(self) -> None:
        self._free = None
