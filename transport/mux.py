"""Stream multiplexer: many flow-controlled streams over one secure connection (sans-IO).

No sockets and no clock here: `Multiplexer` takes decrypted messages in and
gives events out, and builds outgoing plaintext messages on demand, with time
passed in as an argument (the h11/aioquic pattern). The asyncio driver lives in
`connection.py`.

Wire format. Every secure-channel message (at most 65519 bytes of plaintext,
the Noise limit) carries one or more whole frames; a frame never spans two
messages, so a message is decoded on its own. A frame is a 10-byte header
``type:u8 flags:u8 stream:u32 length:u32`` followed, for OPEN, DATA and RESET,
by `length` payload bytes (for WINDOW and PING, `length` is the value itself).

Bulk data. A BULK frame (a header only, always the last frame of its message)
says that the connection's next secure-channel message is `length` bytes
(1..MAX_BULK_BODY) of the stream's data and nothing else: the *body*. The record
layer encrypts a body straight from the application's buffer and decrypts it as
one piece, so a large write costs one body per 256 KiB instead of a message per
64 KiB, and no copy into a message. Only the sender decides to use BULK
(`bulk_min`); every receiver accepts it.

Flow control is per stream, credit based (as in yamux and HTTP/2): a sender may
have at most the receiver's window in flight; the receiver grants more as its
application consumes data, and doubles a stream's window (up to a limit) when
credit is being requested faster than once per round trip, so long fat links
fill without giving every idle stream a large buffer.

Fairness: outgoing data is scheduled one frame per stream in round-robin, with
control frames first, so a bulk transfer cannot starve small calls.
"""

from __future__ import annotations

import struct
from collections import deque
from dataclasses import dataclass, field

from .errors import ProtocolViolation

HEADER = struct.Struct(">BBII")
HEADER_SIZE = HEADER.size
MAX_MESSAGE_PLAINTEXT = 65535 - 16  # Noise message limit minus the AEAD tag

DATA, WINDOW, OPEN, CLOSE, RESET, PING, GOAWAY = range(7)
BULK = 16  # extension frames are numbered from 16
FLAG_ACK = 0x1  # PING: this is the pong
FLAG_REFUSED = 0x2  # RESET: the receiver has no handler for the stream's protocol
_FRAME_NAMES = {
    DATA: "DATA", WINDOW: "WINDOW", OPEN: "OPEN", CLOSE: "CLOSE", RESET: "RESET",
    PING: "PING", GOAWAY: "GOAWAY", BULK: "BULK",
}  # fmt: skip
# Largest bulk body. Part of the wire protocol (a receiver refuses larger ones), and
# what a receiver must be able to buffer whole, since a body authenticates as one.
MAX_BULK_BODY = 256 * 1024
# The largest receive window of a peer held to a memory budget (`shoal run
# --max-memory`): what the remote may have in flight to one of its streams, and so what
# may wait there for a slow reader. 16 MiB (the default) fills links of 1 Gbit/s at
# 130 ms; 2 MiB still fills 160 Mbit/s at 100 ms, and a stage peer of a 64 M-parameter
# model held up to 20 MiB less at its peaks (tests/test_pipeline_memory_swarm.py).
LEAN_MAX_WINDOW = 2 * 1024 * 1024
DEFAULT_MAX_WINDOW = 16 * 1024 * 1024  # (`MuxLimits.max_window`)


# Distinct protocol names one connection tallies its sent bytes under (`sent_by_protocol`).
MAX_PROTOCOL_TALLIES = 32


@dataclass(frozen=True, slots=True)
class MuxLimits:
    """Per-connection multiplexer limits (all enforced on untrusted input)."""

    max_streams: int = 2048  # concurrently open streams opened by the remote side
    # Both sides assume this much credit on a new stream before any WINDOW frame, so
    # it is part of the wire protocol: it must be equal on both ends (it is set only
    # by tests). Larger windows come from auto-tuning, up to max_window.
    initial_window: int = 256 * 1024
    max_window: int = DEFAULT_MAX_WINDOW
    max_protocol_len: int = 256
    max_reason_len: int = 256
    max_pending_control: int = 4096  # queued control frames (e.g. pongs) before we call it a flood


# --- events -------------------------------------------------------------------------------


@dataclass(slots=True)
class StreamOpened:
    stream_id: int
    protocol: str


@dataclass(slots=True)
class DataReceived:
    stream_id: int
    data: memoryview


@dataclass(slots=True)
class StreamEnded:
    """The remote side half-closed: no more data will arrive on this stream."""

    stream_id: int


@dataclass(slots=True)
class StreamWasReset:
    stream_id: int
    reason: str
    refused: bool  # the remote refused the protocol named at open
    unsent: int = field(default=0, compare=False)  # our queued bytes that were discarded


@dataclass(slots=True)
class BulkIncoming:
    """The next secure-channel message is a body of `length` bytes for this stream.

    `deliver` is False when nobody will read it (the stream is gone or abandoned):
    the body is still decrypted, to keep the channel in step, then dropped. Its
    bytes are already counted against the stream's window.
    """

    stream_id: int
    length: int
    deliver: bool


@dataclass(slots=True)
class PongReceived:
    opaque: int


@dataclass(slots=True)
class GoAwayReceived:
    code: int


Event = (
    StreamOpened
    | DataReceived
    | BulkIncoming
    | StreamEnded
    | StreamWasReset
    | PongReceived
    | GoAwayReceived
)


class _Stream:
    __slots__ = (
        "abandoned",
        "consumed_since_update",
        "fin_queued",
        "fin_sent",
        "id",
        "last_update_at",
        "protocol",
        "queued",
        "recv_buffered",
        "recv_window",
        "remote_closed",
        "send_queue",
        "send_window",
        "window_max",
    )

    def __init__(self, stream_id: int, initial_window: int, protocol: str = "") -> None:
        self.id = stream_id
        self.protocol = protocol  # named at OPEN: what the stream's bytes are tallied under
        self.send_window = initial_window  # credit the remote granted us
        self.recv_window = initial_window  # credit we granted and that is still unused
        self.window_max = initial_window  # the receive window we currently aim for
        self.recv_buffered = 0  # received and not yet consumed by the application
        self.consumed_since_update = 0
        self.last_update_at = -1.0
        self.send_queue: deque[memoryview] = deque()
        self.queued = 0  # bytes in send_queue
        self.fin_queued = False
        self.fin_sent = False
        self.remote_closed = False
        self.abandoned = False  # the application will read no more: forget after our FIN

    @property
    def done(self) -> bool:
        """Both directions closed and everything read: its state (and window) may go."""
        return (
            self.fin_sent
            and not self.queued
            and (self.abandoned or (self.remote_closed and self.recv_buffered <= 0))
        )

    def data_before_bulk(self, limit: int, bulk_min: int) -> int:
        """How much of at most `limit` bytes to send as DATA so that it stops short of
        the next queued piece big enough to go as a BULK body (the head is not)."""
        total = 0
        for piece in self.send_queue:
            if len(piece) >= bulk_min or total >= limit:
                break
            total += len(piece)
        return min(total, limit)

    # --- flow control: the windows of this stream (sans-I/O; the multiplexer sends
    # the WINDOW frames these return the increments of)

    def take_data(self, n: int) -> bool:
        """Check and count `n` received bytes against our window; False if they are to
        be dropped (nobody will read them)."""
        sid = self.id
        if self.abandoned:  # nobody will read it: drop (still within the window we granted)
            if n > self.recv_window:
                raise ProtocolViolation(f"flow-control violation on stream {sid}")
            return False
        if self.remote_closed:
            raise ProtocolViolation(f"DATA on stream {sid} after it was closed")
        if n > self.recv_window:
            raise ProtocolViolation(
                f"flow-control violation on stream {sid}: {n} bytes > window {self.recv_window}"
            )
        self.recv_window -= n
        self.recv_buffered += n
        return True

    def add_send_credit(self, increment: int) -> bool:
        """The remote granted `increment` more bytes; whether we now have something to send."""
        self.send_window += increment
        if self.send_window > 1 << 31:
            raise ProtocolViolation(f"window overflow on stream {self.id}")
        return self.send_window > 0 and bool(self.queued or (self.fin_queued and not self.fin_sent))

    def credit_due(self, now: float, rtt: float, max_window: int) -> int:
        """After the application consumed data: the credit to grant now (0: none yet)."""
        if self.consumed_since_update * 2 < self.window_max:
            return 0
        # Credit is being used up within a couple of round trips: the window is
        # what limits throughput, so grow it (bounded by max_window).
        if (
            self.last_update_at >= 0
            and now - self.last_update_at < max(4 * rtt, 0.002)
            and self.window_max < max_window
        ):
            grow = min(self.window_max, max_window - self.window_max)
            self.window_max += grow
            self.consumed_since_update += grow
        self.last_update_at = now
        inc = self.consumed_since_update
        self.consumed_since_update = 0
        self.recv_window += inc
        return inc

    def grow_window(self, n: int, max_window: int) -> int:
        """Aim the receive window at `n` bytes (at most max_window); the credit added."""
        grow = min(n, max_window) - self.window_max
        if grow <= 0:
            return 0
        self.window_max += grow
        self.recv_window += grow
        return grow


class Multiplexer:
    """The multiplexer state machine for one connection.

    `initiator` is True on the side that dialed; it opens odd stream IDs, the
    other side even ones, so both can open streams without coordination.
    `head_room`/`tail_room` reserve space around each outgoing message so the
    driver can add the length prefix and encrypt in place without a copy.
    With `bulk_min` > 0, `next_output` sends a queued piece of at least that many
    bytes (window permitting) as a BULK body instead of inside messages.
    """

    # Slots, not a dict per instance: a peer of a large swarm holds hundreds of these.
    __slots__ = (
        "_bulk_min",
        "_control",
        "_drained",
        "_finished",
        "_head",
        "_in_ready",
        "_last_remote_id",
        "_next_local_id",
        "_ready",
        "_remote_open",
        "_remote_parity",
        "_room",
        "_streams",
        "_tail",
        "limits",
        "local_goaway",
        "remote_goaway",
        "rtt",
        "sent_by_protocol",
        "serving_in_flight",
    )

    def __init__(
        self,
        initiator: bool,
        limits: MuxLimits | None = None,
        *,
        head_room: int = 0,
        tail_room: int = 0,
        bulk_min: int = 0,
    ) -> None:
        self.limits = limits or MuxLimits()
        self._next_local_id = 1 if initiator else 2
        self._remote_parity = 0 if initiator else 1
        self._last_remote_id = 0
        self._streams: dict[int, _Stream] = {}
        self._remote_open = 0  # streams opened by the remote side and still open
        self._control: deque[bytes] = deque()
        self._ready: deque[int] = deque()  # streams with sendable data, round-robin
        self._in_ready: set[int] = set()
        self._drained: list[int] = []
        self._finished: list[int] = []
        self._head = head_room
        self._tail = tail_room
        self._room = MAX_MESSAGE_PLAINTEXT
        self._bulk_min = bulk_min
        self.local_goaway = False
        self.remote_goaway = False
        # After our GOAWAY, streams the remote opened before it reached them are still
        # served while this holds (`go_away(serve_in_flight=True)`), not reset.
        self.serving_in_flight = False
        self.rtt = 0.0  # smoothed RTT estimate, fed by the driver; drives window growth
        # Stream payload queued to send, by the protocol named at the stream's OPEN (what
        # an uplink carries for what; frame headers and encryption not included). Names
        # come from streams this side opened or answers, and the remote names the
        # latter: past MAX_PROTOCOL_TALLIES names the rest count as "other".
        self.sent_by_protocol: dict[str, int] = {}

    # --- inbound ----------------------------------------------------------------------------

    def receive_message(self, message: bytes | memoryview, now: float) -> list[Event]:
        """Decode one decrypted message; raises ProtocolViolation on malformed input."""
        mv = memoryview(message)
        end = len(mv)
        pos = 0
        events: list[Event] = []
        unpack = HEADER.unpack_from
        while pos < end:
            if end - pos < HEADER_SIZE:
                raise ProtocolViolation(f"truncated frame header ({end - pos} bytes)")
            ftype, flags, sid, length = unpack(mv, pos)
            pos += HEADER_SIZE
            if ftype == DATA:
                if length > end - pos:
                    raise ProtocolViolation(f"DATA frame of {length} bytes overruns message")
                self._on_data(sid, mv[pos : pos + length], events)
                pos += length
            elif ftype == WINDOW:
                self._on_window(sid, length)
            elif ftype == OPEN:
                if length > self.limits.max_protocol_len or length > end - pos:
                    raise ProtocolViolation(f"OPEN frame with bad protocol length {length}")
                self._on_open(sid, bytes(mv[pos : pos + length]), events)
                pos += length
            elif ftype == CLOSE:
                st = self._streams.get(sid)
                if st is None:
                    self._check_known(sid)
                elif not st.remote_closed:
                    st.remote_closed = True
                    events.append(StreamEnded(sid))
                    self._maybe_forget(st)
            elif ftype == RESET:
                if length > self.limits.max_reason_len or length > end - pos:
                    raise ProtocolViolation(f"RESET frame with bad reason length {length}")
                reason = bytes(mv[pos : pos + length]).decode("utf-8", "replace")
                pos += length
                st = self._streams.pop(sid, None)
                if st is None:
                    self._check_known(sid)
                else:
                    unsent = st.queued
                    self._forget_counts(st)
                    refused = bool(flags & FLAG_REFUSED)
                    events.append(StreamWasReset(sid, reason or "reset by peer", refused, unsent))
            elif ftype == PING:
                if flags & FLAG_ACK:
                    events.append(PongReceived(length))
                else:
                    self._queue_control(HEADER.pack(PING, FLAG_ACK, 0, length))
            elif ftype == GOAWAY:
                self.remote_goaway = True
                events.append(GoAwayReceived(length))
            elif ftype == BULK:
                if pos != end:
                    raise ProtocolViolation("BULK frame is not the last frame of its message")
                if not 0 < length <= MAX_BULK_BODY:
                    raise ProtocolViolation(f"BULK body of {length} bytes")
                events.append(BulkIncoming(sid, length, self._on_data_length(sid, length)))
            else:
                raise ProtocolViolation(f"unknown frame type {ftype}")
        return events

    def _check_known(self, sid: int) -> None:
        # Frames for a stream we already closed or reset are normal (they crossed on
        # the wire); frames for a stream the remote never opened are not.
        if sid == 0 or ((sid & 1) == self._remote_parity and sid > self._last_remote_id):
            raise ProtocolViolation(f"frame for stream {sid} that was never opened")
        if (sid & 1) != self._remote_parity and sid >= self._next_local_id:
            raise ProtocolViolation(f"frame for local stream {sid} that was never opened")

    def _on_open(self, sid: int, proto: bytes, events: list[Event]) -> None:
        if (sid & 1) != self._remote_parity or sid <= self._last_remote_id:
            raise ProtocolViolation(f"OPEN with invalid stream id {sid}")
        self._last_remote_id = sid
        try:
            protocol = proto.decode("utf-8")
        except UnicodeDecodeError:
            raise ProtocolViolation("OPEN with a protocol name that is not UTF-8") from None
        if self.local_goaway and not self.serving_in_flight:
            self._queue_reset_frame(sid, "connection is going away")
            return
        if self._remote_open >= self.limits.max_streams:
            self._queue_reset_frame(sid, "too many streams")
            return
        self._streams[sid] = _Stream(sid, self.limits.initial_window, protocol)
        self._remote_open += 1
        events.append(StreamOpened(sid, protocol))

    def _on_data(self, sid: int, data: memoryview, events: list[Event]) -> None:
        if self._on_data_length(sid, len(data)) and len(data):
            events.append(DataReceived(sid, data))

    def _on_data_length(self, sid: int, n: int) -> bool:
        """Check and count `n` bytes of data for `sid`; False if they are to be dropped."""
        st = self._streams.get(sid)
        if st is None:
            self._check_known(sid)
            return False  # late data for a stream that is gone: drop it
        return st.take_data(n)

    def _on_window(self, sid: int, increment: int) -> None:
        st = self._streams.get(sid)
        if st is None:
            self._check_known(sid)
            return
        if st.add_send_credit(increment):
            self._mark_ready(st)

    # --- application actions ----------------------------------------------------------------

    def open_stream(self, protocol: str) -> int:
        """Allocate a stream and queue its OPEN frame (data may follow at once)."""
        if self.remote_goaway or self.local_goaway:
            raise ProtocolViolation("connection is going away: no new streams")
        name = protocol.encode("utf-8")
        if len(name) > self.limits.max_protocol_len:
            raise ValueError(f"protocol name too long: {protocol[:64]!r}...")
        sid = self._next_local_id
        if sid >= 1 << 32:
            raise ProtocolViolation("stream IDs exhausted on this connection")
        self._next_local_id += 2
        self._streams[sid] = _Stream(sid, self.limits.initial_window, protocol)
        # OPEN goes through the control queue, which is always emptied before any
        # DATA is scheduled, so it can never be overtaken by this stream's data.
        self._control.append(HEADER.pack(OPEN, 0, sid, len(name)) + name)
        return sid

    def queue_data(self, sid: int, data: memoryview) -> None:
        """Queue bytes to send; `data` must stay unchanged until the stream drains."""
        st = self._streams.get(sid)
        if st is None or st.fin_queued:
            raise ProtocolViolation(f"stream {sid} is closed for writing")
        if len(data):
            st.send_queue.append(data)
            st.queued += len(data)
            tally = self.sent_by_protocol
            name = st.protocol
            if name not in tally and len(tally) >= MAX_PROTOCOL_TALLIES:
                name = "other"
            tally[name] = tally.get(name, 0) + len(data)
            if st.send_window > 0:
                self._mark_ready(st)

    def queue_close(self, sid: int, *, discard_input: bool = False) -> None:
        """Half-close: send CLOSE after all queued data.

        With `discard_input` the application is done with the stream altogether (a
        handler that returned): once CLOSE is out the stream is forgotten, and what
        the remote still sends is dropped, so a peer that never closes its side
        cannot pin the stream (and its slot under max_streams).
        """
        st = self._streams.get(sid)
        if st is None:
            return
        if discard_input:
            st.abandoned = True
            st.recv_buffered = 0
        if st.fin_queued:
            self._maybe_forget(st)
            return
        st.fin_queued = True
        self._mark_ready(st)

    def reset_stream(self, sid: int, reason: str = "", *, refused: bool = False) -> None:
        st = self._streams.pop(sid, None)
        if st is None:
            return
        self._forget_counts(st)
        self._queue_reset_frame(sid, reason, FLAG_REFUSED if refused else 0)

    def consumed(self, sid: int, n: int, now: float) -> None:
        """The application consumed `n` received bytes: grant credit when worthwhile."""
        st = self._streams.get(sid)
        if st is None:
            return
        st.recv_buffered -= n
        st.consumed_since_update += n
        if st.remote_closed:
            self._maybe_forget(st)
            return
        inc = st.credit_due(now, self.rtt, self.limits.max_window)
        if inc:
            self._control.append(HEADER.pack(WINDOW, 0, sid, inc))

    def reserve(self, sid: int, n: int) -> None:
        """Let the remote have `n` bytes in flight on this stream (at most max_window):
        the application has room for them. Grants the extra credit at once, and keeps
        the window at that size, so a large transfer skips the window's slow start."""
        st = self._streams.get(sid)
        if st is None or st.remote_closed:
            return
        grow = st.grow_window(n, self.limits.max_window)
        if grow:
            self._control.append(HEADER.pack(WINDOW, 0, sid, grow))

    # Local PING and GOAWAY bypass the flood limit: it bounds what the peer makes us
    # queue, and our own keepalive or shutdown must not fail with a violation.
    def ping(self, opaque: int) -> None:
        self._control.append(HEADER.pack(PING, 0, 0, opaque & 0xFFFFFFFF))

    def go_away(self, code: int = 0, *, serve_in_flight: bool = False) -> None:
        """No new streams from us, and none from the remote once it reads this; with
        `serve_in_flight`, streams it opened meanwhile are served until the driver
        calls `stop_serving_in_flight` (an idle close the remote could not foresee)."""
        if not self.local_goaway:
            self.local_goaway = True
            self.serving_in_flight = serve_in_flight
            self._control.append(HEADER.pack(GOAWAY, 0, 0, code))

    def stop_serving_in_flight(self) -> None:
        self.serving_in_flight = False

    # --- outbound -----------------------------------------------------------------------------

    def has_output(self) -> bool:
        return bool(self._control or self._ready)

    def next_message(self) -> bytearray | None:
        """The next plaintext message (with head/tail room), or None when idle.

        Control frames go first, then one frame per ready stream in round-robin.
        Never BULK: for a multiplexer without `bulk_min`.
        """
        out = self._next_output(False)
        return None if out is None else out[0]

    def next_output(self) -> tuple[bytearray, memoryview | None] | None:
        """The next plaintext message and, when it ends with BULK, the body to send
        right after it as its own message (a view of the application's buffer, to
        be encrypted before the application reuses it); None when idle."""
        return self._next_output(self._bulk_min > 0)

    def _next_output(self, bulk: bool) -> tuple[bytearray, memoryview | None] | None:
        if not self._control and not self._ready:
            return None
        body: memoryview | None = None
        parts: list[bytes | memoryview] = [bytes(self._head)]
        room = self._room
        control = self._control
        while control and len(control[0]) <= room:
            frame = control.popleft()
            parts.append(frame)
            room -= len(frame)
        ready = self._ready
        in_ready = self._in_ready
        # Data only once all control frames are out: an OPEN must precede its DATA.
        while ready and room > HEADER_SIZE and not control:
            sid = ready.popleft()
            in_ready.discard(sid)
            st = self._streams.get(sid)
            if st is None:
                continue
            bulk_here = bulk and st.queued and st.send_window >= self._bulk_min
            if bulk_here and len(st.send_queue[0]) >= self._bulk_min:
                # The last frame of this message: the body follows as its own message.
                head = st.send_queue[0]
                n = min(len(head), st.send_window, MAX_BULK_BODY)
                parts.append(HEADER.pack(BULK, 0, sid, n))
                st.send_window -= n
                st.queued -= n
                if n == len(head):
                    body = st.send_queue.popleft()
                else:
                    body = head[:n]
                    st.send_queue[0] = head[n:]
                if not st.queued:
                    self._drained.append(sid)
                    if st.fin_queued:
                        self._mark_ready(st)  # CLOSE goes in a later message
                elif st.send_window > 0:
                    self._mark_ready(st)
                break
            n = min(room - HEADER_SIZE, st.send_window, st.queued)
            if bulk_here:
                n = st.data_before_bulk(n, self._bulk_min)
            if n > 0:
                parts.append(HEADER.pack(DATA, 0, sid, n))
                room -= HEADER_SIZE + n
                st.send_window -= n
                st.queued -= n
                queue = st.send_queue
                while n:
                    head = queue[0]
                    if len(head) <= n:
                        parts.append(queue.popleft())
                        n -= len(head)
                    else:
                        parts.append(head[:n])
                        queue[0] = head[n:]
                        n = 0
                if not st.queued:
                    self._drained.append(sid)
            if not st.queued and st.fin_queued and not st.fin_sent:
                if room < HEADER_SIZE:
                    self._mark_ready(st)
                    break
                parts.append(HEADER.pack(CLOSE, 0, sid, 0))
                room -= HEADER_SIZE
                st.fin_sent = True
                self._maybe_forget(st)
            elif st.queued and st.send_window > 0:
                self._mark_ready(st)
        if len(parts) == 1:
            return None
        if self._tail:
            parts.append(bytes(self._tail))
        return bytearray().join(parts), body

    def take_drained(self) -> list[int]:
        """Streams whose send queue emptied since the last call (their writers may go on)."""
        drained, self._drained = self._drained, []
        return drained

    def take_finished(self) -> list[int]:
        """Streams that ended (both sides closed and read, or reset) since the last call."""
        finished, self._finished = self._finished, []
        return finished

    # --- introspection --------------------------------------------------------------------------

    def queued_bytes(self, sid: int) -> int:
        st = self._streams.get(sid)
        return st.queued if st else 0

    def is_open(self, sid: int) -> bool:
        return sid in self._streams

    @property
    def stream_count(self) -> int:
        return len(self._streams)

    @property
    def remote_stream_count(self) -> int:
        return self._remote_open

    # --- internals ------------------------------------------------------------------------------

    def _mark_ready(self, st: _Stream) -> None:
        if st.id not in self._in_ready:
            self._in_ready.add(st.id)
            self._ready.append(st.id)

    def _queue_control(self, frame: bytes) -> None:
        if len(self._control) >= self.limits.max_pending_control:
            raise ProtocolViolation("control frame flood (peer does not read its pongs/resets)")
        self._control.append(frame)

    def _queue_reset_frame(self, sid: int, reason: str, flags: int = 0) -> None:
        data = reason.encode("utf-8")[: self.limits.max_reason_len]
        self._queue_control(HEADER.pack(RESET, flags, sid, len(data)) + data)

    def _forget_counts(self, st: _Stream) -> None:
        self._finished.append(st.id)
        if (st.id & 1) == self._remote_parity:
            self._remote_open -= 1
        if st.queued or st.id in self._in_ready:
            st.send_queue.clear()
            st.queued = 0
            self._drained.append(st.id)

    def _maybe_forget(self, st: _Stream) -> None:
        # (`st.done`, spelled out: this runs on every read and write of every stream)
        done = (
            st.fin_sent
            and not st.queued
            and (st.abandoned or (st.remote_closed and st.recv_buffered <= 0))
        )
        if done and self._streams.pop(st.id, None) is not None:
            if st.abandoned and not st.remote_closed:
                # Tell a remote that is still writing that nobody reads any more (as an
                # HTTP/2 RST_STREAM after the response); our CLOSE went out before it,
                # so the remote still reads everything we sent.
                self._control.append(HEADER.pack(RESET, 0, st.id, 15) + b"stream finished")
            self._forget_counts(st)


def describe_frame(message: bytes) -> str:
    """Human-readable frame list of a plaintext message (for debugging and logs)."""
    out = []
    pos = 0
    while pos + HEADER_SIZE <= len(message):
        ftype, flags, sid, length = HEADER.unpack_from(message, pos)
        name = _FRAME_NAMES.get(ftype, f"?{ftype}")
        out.append(f"{name}(sid={sid}, flags={flags}, len={length})")
        pos += HEADER_SIZE + (length if ftype in (DATA, OPEN, RESET) else 0)
    return " ".join(out)
