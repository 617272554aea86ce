"""Stream multiplexer (shoal.transport.mux) as a specification, with no network and no sleeps.

Two `Multiplexer`s are wired back to back in memory (`Pair`); `pump()` moves every
outgoing message of each side into the other until both are quiet, and checks on the
way the rules every message must obey (size limit, control frames before data, a
stream's OPEN before its DATA). Time is a number the test advances by hand.
"""

from __future__ import annotations

import random
from collections import defaultdict
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.transport.errors import ProtocolViolation
from shoal.transport.mux import (
    CLOSE,
    DATA,
    FLAG_ACK,
    FLAG_REFUSED,
    GOAWAY,
    HEADER,
    HEADER_SIZE,
    MAX_MESSAGE_PLAINTEXT,
    MAX_PROTOCOL_TALLIES,
    OPEN,
    PING,
    RESET,
    WINDOW,
    DataReceived,
    Event,
    GoAwayReceived,
    Multiplexer,
    MuxLimits,
    PongReceived,
    StreamEnded,
    StreamOpened,
    StreamWasReset,
    describe_frame,
)

CONTROL_TYPES = {WINDOW, OPEN, RESET, PING, GOAWAY}
PAYLOAD_TYPES = {DATA, OPEN, RESET}


# --- wire helpers -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Frame:
    type: int
    flags: int
    sid: int
    length: int
    payload: bytes


def parse(message: bytes | bytearray) -> list[Frame]:
    """Split a well-formed plaintext message into frames (test-side decoder)."""
    frames = []
    pos = 0
    while pos < len(message):
        assert len(message) - pos >= HEADER_SIZE, "message ends inside a frame header"
        ftype, flags, sid, length = HEADER.unpack_from(message, pos)
        pos += HEADER_SIZE
        payload = b""
        if ftype in PAYLOAD_TYPES:
            payload = bytes(message[pos : pos + length])
            assert len(payload) == length, "frame spans the end of the message"
            pos += length
        frames.append(Frame(ftype, flags, sid, length, payload))
    return frames


def frame(
    ftype: int, sid: int = 0, payload: bytes = b"", *, flags: int = 0, value: int = -1
) -> bytes:
    """Forge one frame by hand; `value` is the length field of WINDOW/PING/GOAWAY."""
    length = len(payload) if value < 0 else value
    return HEADER.pack(ftype, flags, sid, length) + payload


def payload_bytes(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


# --- the in-memory pair -----------------------------------------------------------------------


class Side:
    """One end: its multiplexer plus what its application has seen."""

    def __init__(self, name: str, initiator: bool, limits: MuxLimits | None) -> None:
        self.name = name
        self.initiator = initiator
        self.mux = Multiplexer(initiator, limits, head_room=0, tail_room=0)
        self.events: list[Event] = []
        self.received: dict[int, bytearray] = defaultdict(bytearray)
        self.unconsumed: dict[int, int] = defaultdict(int)
        self.auto_consume = True
        self.wire_opened: set[int] = set()  # streams whose OPEN this side has sent
        self.sent: list[list[Frame]] = []  # every message this side sent, parsed

    def record(self, events: list[Event]) -> None:
        for ev in events:
            if isinstance(ev, DataReceived):
                self.received[ev.stream_id] += ev.data  # copy: the view is into the message
                self.unconsumed[ev.stream_id] += len(ev.data)
            elif isinstance(ev, StreamWasReset):
                self.unconsumed.pop(ev.stream_id, None)
        self.events.extend(events)

    def consume(self, sid: int, n: int, now: float) -> None:
        assert n <= self.unconsumed[sid]
        self.unconsumed[sid] -= n
        self.mux.consumed(sid, n, now)

    def consume_all(self, now: float) -> None:
        for sid, n in list(self.unconsumed.items()):
            if n:
                self.consume(sid, n, now)

    def of(self, cls: type) -> list:
        return [e for e in self.events if isinstance(e, cls)]

    def sent_frames(self) -> list[Frame]:
        return [f for message in self.sent for f in message]


class Pair:
    """An initiator and a responder connected back to back."""

    def __init__(
        self, limits: MuxLimits | None = None, *, responder_limits: MuxLimits | None = None
    ) -> None:
        self.now = 0.0
        self.a = Side("initiator", True, limits)
        self.b = Side("responder", False, responder_limits or limits)

    def other(self, side: Side) -> Side:
        return self.b if side is self.a else self.a

    def step(self, src: Side) -> bool:
        """Move one message from `src` to the other side; False if `src` had nothing."""
        message = src.mux.next_message()
        if message is None:
            return False
        self._check_outgoing(src, message)
        dst = self.other(src)
        dst.record(dst.mux.receive_message(message, self.now))
        if dst.auto_consume:
            dst.consume_all(self.now)
        return True

    def pump(self, limit: int = 100_000) -> int:
        """Deliver messages both ways until neither side has anything to send."""
        moved = 0
        while True:
            before = moved
            for src in (self.a, self.b):
                while self.step(src):
                    moved += 1
                    assert moved < limit, "pump does not converge"
            if moved == before:
                return moved

    @staticmethod
    def _check_outgoing(src: Side, message: bytearray) -> None:
        assert 0 < len(message) <= MAX_MESSAGE_PLAINTEXT
        frames = parse(message)
        src.sent.append(frames)
        seen_data = False
        local_parity = 1 if src.initiator else 0
        for f in frames:
            if f.type in CONTROL_TYPES:
                assert not seen_data, f"control frame after data: {describe_frame(message)}"
                if f.type == OPEN:
                    src.wire_opened.add(f.sid)
            else:
                assert f.type in (DATA, CLOSE)
                seen_data = True
                if f.sid & 1 == local_parity:
                    assert f.sid in src.wire_opened, f"{f} before the stream's OPEN"


def open_pair(
    protocol: str = "/test/1", limits: MuxLimits | None = None, **kw: MuxLimits
) -> tuple[Pair, int]:
    pair = Pair(limits, **kw)
    sid = pair.a.mux.open_stream(protocol)
    pair.pump()
    return pair, sid


# --- opening streams --------------------------------------------------------------------------


def test_open_stream_announces_protocol_with_parity_ids_from_both_sides_at_once() -> None:
    pair = Pair()
    a1 = pair.a.mux.open_stream("/shoal/dht/1.0.0")
    b1 = pair.b.mux.open_stream("/shoal/rpc/1.0.0")
    a2 = pair.a.mux.open_stream("/ünïcode/1")
    b2 = pair.b.mux.open_stream("")
    assert (a1, a2) == (1, 3)  # initiator: odd
    assert (b1, b2) == (2, 4)  # responder: even
    pair.pump()
    assert pair.b.of(StreamOpened) == [
        StreamOpened(1, "/shoal/dht/1.0.0"),
        StreamOpened(3, "/ünïcode/1"),
    ]
    assert pair.a.of(StreamOpened) == [StreamOpened(2, "/shoal/rpc/1.0.0"), StreamOpened(4, "")]
    for side in (pair.a, pair.b):
        assert side.mux.stream_count == 4
        assert side.mux.remote_stream_count == 2
        assert all(side.mux.is_open(s) for s in (1, 2, 3, 4))


def test_sent_payload_is_tallied_by_the_protocol_named_at_open_with_names_bounded() -> None:
    """The remote names the streams it opens: answering 40 differently named streams
    tallies at most MAX_PROTOCOL_TALLIES names, the rest as "other"."""
    pair = Pair()
    mine = pair.a.mux.open_stream("/shoal/dht/1.0.0")
    pair.a.mux.queue_data(mine, memoryview(b"q" * 10))
    theirs = [pair.b.mux.open_stream(f"/made-up/{i}") for i in range(40)]
    pair.pump()
    for sid in theirs:
        pair.a.mux.queue_data(sid, memoryview(b"answer"))
    tally = pair.a.mux.sent_by_protocol
    assert len(tally) == MAX_PROTOCOL_TALLIES + 1
    assert tally["/shoal/dht/1.0.0"] == 10
    assert sum(n for name, n in tally.items() if name.startswith("/made-up/")) == 6 * 31
    assert tally["other"] == 6 * 9
    assert pair.b.mux.sent_by_protocol == {}  # opening a stream sends no payload


def test_protocol_name_too_long_is_refused_locally() -> None:
    mux = Multiplexer(True, MuxLimits(max_protocol_len=8))
    with pytest.raises(ValueError):
        mux.open_stream("/123456789")
    assert mux.open_stream("/1234567") == 1


# --- data -------------------------------------------------------------------------------------

write_ops = st.lists(
    st.tuples(
        st.sampled_from(["a", "b"]),  # writer
        st.integers(0, 2),  # stream index
        st.integers(0, 150_000),  # chunk size
        st.integers(0, 3),  # messages to move before the next write
    ),
    max_size=12,
)


@settings(max_examples=40, deadline=None)
@given(ops=write_ops, seed=st.integers(0, 2**32))
def test_data_arrives_intact_and_in_order_both_ways(
    ops: list[tuple[str, int, int, int]], seed: int
) -> None:
    pair = Pair()
    # Streams 1 and 3 opened by the initiator, 2 by the responder; all carry data both ways.
    sids = [
        pair.a.mux.open_stream("/x"),
        pair.b.mux.open_stream("/y"),
        pair.a.mux.open_stream("/z"),
    ]
    pair.pump()
    sent: dict[tuple[str, int], bytearray] = defaultdict(bytearray)
    for n, (who, index, size, steps) in enumerate(ops):
        side = pair.a if who == "a" else pair.b
        chunk = payload_bytes(size, seed + n)
        side.mux.queue_data(sids[index], memoryview(chunk))
        sent[who, sids[index]] += chunk
        for _ in range(steps):
            pair.step(side)
    pair.pump()
    for sid in sids:
        assert pair.b.received[sid] == sent["a", sid]
        assert pair.a.received[sid] == sent["b", sid]
        assert pair.a.mux.queued_bytes(sid) == pair.b.mux.queued_bytes(sid) == 0


def test_large_write_is_split_into_messages_within_the_limit_with_head_and_tail_room() -> None:
    tx = Multiplexer(True, MuxLimits(initial_window=4 << 20), head_room=2, tail_room=16)
    rx = Multiplexer(False, MuxLimits(initial_window=4 << 20))
    sid = tx.open_stream("/bulk")
    data = payload_bytes(1_000_000, 7)
    tx.queue_data(sid, memoryview(data))
    got = bytearray()
    messages = 0
    while (message := tx.next_message()) is not None:
        messages += 1
        assert len(message) <= 2 + MAX_MESSAGE_PLAINTEXT + 16
        assert message[:2] == b"\0\0"
        assert message[-16:] == bytes(16)
        for ev in rx.receive_message(message[2:-16], 0.0):
            if isinstance(ev, DataReceived):
                got += ev.data
    assert got == data
    assert messages == -(-(len(data) + 20) // (MAX_MESSAGE_PLAINTEXT - HEADER_SIZE))
    assert tx.take_drained() == [sid]


def test_drained_lists_a_stream_once_its_queue_is_sent() -> None:
    pair, sid = open_pair()
    pair.a.mux.queue_data(sid, memoryview(b"x" * 1000))
    assert pair.a.mux.queued_bytes(sid) == 1000
    assert pair.a.mux.take_drained() == []
    pair.pump()
    assert pair.a.mux.take_drained() == [sid]
    assert pair.a.mux.take_drained() == []


# --- flow control -----------------------------------------------------------------------------


def test_sender_stops_at_the_window_until_the_receiver_consumes() -> None:
    pair, sid = open_pair(limits=MuxLimits(initial_window=10_000))
    pair.b.auto_consume = False
    data = payload_bytes(100_000, 1)
    pair.a.mux.queue_data(sid, memoryview(data))
    pair.pump()
    assert len(pair.b.received[sid]) == 10_000
    assert pair.a.mux.queued_bytes(sid) == 90_000
    assert not pair.a.mux.has_output()

    # Consuming less than half the window is not worth a WINDOW frame yet.
    pair.b.consume(sid, 4_999, pair.now)
    assert pair.pump() == 0
    pair.b.consume(sid, 1, pair.now)
    pair.pump()
    assert len(pair.b.received[sid]) == 15_000

    pair.b.auto_consume = True
    pair.b.consume_all(pair.now)
    pair.pump()
    assert pair.b.received[sid] == data


@settings(max_examples=30, deadline=None)
@given(consumes=st.lists(st.integers(0, 5000), min_size=1, max_size=40))
def test_receiver_never_holds_more_than_its_window(consumes: list[int]) -> None:
    window = 4096
    pair, sid = open_pair(limits=MuxLimits(initial_window=window, max_window=1 << 20))
    pair.b.auto_consume = False
    data = payload_bytes(60_000, 2)
    pair.a.mux.queue_data(sid, memoryview(data))
    for n in consumes:
        pair.now += 1.0  # slow reader: the window never grows
        pair.pump()
        assert pair.b.unconsumed[sid] <= window
        pair.b.consume(sid, min(n, pair.b.unconsumed[sid]), pair.now)
    for message in pair.a.sent:
        for f in message:
            assert f.type != DATA or f.length <= window
    assert data.startswith(pair.b.received[sid])


def test_data_beyond_the_window_is_a_violation() -> None:
    pair, sid = open_pair(limits=MuxLimits(initial_window=1000))
    with pytest.raises(ProtocolViolation, match="flow-control"):
        pair.b.mux.receive_message(frame(DATA, sid, bytes(1001)), pair.now)

    pair, sid = open_pair(limits=MuxLimits(initial_window=1000))
    assert len(pair.b.mux.receive_message(frame(DATA, sid, bytes(600)), pair.now)) == 1
    assert len(pair.b.mux.receive_message(frame(DATA, sid, bytes(400)), pair.now)) == 1
    with pytest.raises(ProtocolViolation, match="flow-control"):
        pair.b.mux.receive_message(frame(DATA, sid, b"!"), pair.now)


def test_consumed_credit_lets_the_peer_send_again() -> None:
    pair, sid = open_pair(limits=MuxLimits(initial_window=1000))
    mux = pair.b.mux
    mux.receive_message(frame(DATA, sid, bytes(1000)), pair.now)
    mux.consumed(sid, 1000, pair.now)
    wire = parse(mux.next_message() or b"")
    assert wire == [Frame(WINDOW, 0, sid, 1000, b"")]
    assert len(mux.receive_message(frame(DATA, sid, bytes(1000)), pair.now)) == 1


def window_rounds(pair: Pair, sid: int, rounds: int, dt: float) -> list[int]:
    """Bytes delivered per round trip when the reader consumes everything every `dt`."""
    got = []
    for _ in range(rounds):
        before = len(pair.b.received[sid])
        pair.pump()
        got.append(len(pair.b.received[sid]) - before)
        pair.now += dt
        pair.b.consume_all(pair.now)
    return got


def test_window_grows_for_a_fast_reader_up_to_max_window() -> None:
    pair, sid = open_pair(limits=MuxLimits(initial_window=4096, max_window=20_000))
    pair.b.auto_consume = False
    pair.a.mux.queue_data(sid, memoryview(bytes(1 << 20)))
    # The first update has nothing to compare with; then each fast update doubles,
    # capped at max_window.
    assert window_rounds(pair, sid, 8, dt=0.001) == [4096, 4096, 8192, 16384] + [20_000] * 4


def test_window_does_not_grow_for_a_slow_reader() -> None:
    pair, sid = open_pair(limits=MuxLimits(initial_window=4096, max_window=20_000))
    pair.b.auto_consume = False
    pair.a.mux.queue_data(sid, memoryview(bytes(1 << 20)))
    assert window_rounds(pair, sid, 6, dt=0.5) == [4096] * 6


def test_window_growth_threshold_follows_the_rtt() -> None:
    pair, sid = open_pair(limits=MuxLimits(initial_window=4096, max_window=8192))
    pair.b.auto_consume = False
    pair.b.mux.rtt = 0.5  # updates less than 4 RTT apart count as fast
    pair.a.mux.queue_data(sid, memoryview(bytes(1 << 20)))
    assert window_rounds(pair, sid, 4, dt=1.0) == [4096, 4096, 8192, 8192]


# --- half-close -------------------------------------------------------------------------------


def test_half_close_then_reply_then_stream_is_forgotten() -> None:
    pair, sid = open_pair()
    pair.a.auto_consume = pair.b.auto_consume = False
    pair.a.mux.queue_data(sid, memoryview(b"hello"))
    pair.a.mux.queue_close(sid)
    with pytest.raises(ProtocolViolation):
        pair.a.mux.queue_data(sid, memoryview(b"more"))  # closed for writing
    pair.pump()
    assert pair.b.events == [
        StreamOpened(sid, "/test/1"),
        DataReceived(sid, b"hello"),
        StreamEnded(sid),
    ]

    # The other direction is still open.
    pair.b.mux.queue_data(sid, memoryview(b"world"))
    pair.b.mux.queue_close(sid)
    pair.pump()
    assert pair.a.events == [DataReceived(sid, b"world"), StreamEnded(sid)]

    # Both closed, but unread data keeps each side's stream alive.
    assert pair.a.mux.stream_count == pair.b.mux.stream_count == 1
    assert pair.a.mux.take_finished() == pair.b.mux.take_finished() == []
    pair.a.consume_all(pair.now)
    assert pair.a.mux.stream_count == 0
    assert pair.a.mux.take_finished() == [sid]
    pair.b.consume_all(pair.now)
    assert pair.b.mux.stream_count == 0
    assert pair.b.mux.remote_stream_count == 0
    assert pair.b.mux.take_finished() == [sid]
    assert pair.pump() == 0  # nothing left to say (no WINDOW for a finished stream)


def test_stream_ended_comes_after_all_the_data() -> None:
    pair, sid = open_pair(limits=MuxLimits(initial_window=5000))
    data = payload_bytes(200_000, 3)
    pair.a.mux.queue_data(sid, memoryview(data))
    pair.a.mux.queue_close(sid)
    pair.pump()
    assert isinstance(pair.b.events[-1], StreamEnded)
    assert pair.b.of(StreamEnded) == [StreamEnded(sid)]
    assert pair.b.received[sid] == data
    closes = [f for f in pair.a.sent_frames() if f.type == CLOSE]
    assert closes == [Frame(CLOSE, 0, sid, 0, b"")]


def test_close_without_data_and_close_twice() -> None:
    pair, sid = open_pair()
    pair.b.mux.queue_close(sid)
    pair.b.mux.queue_close(sid)
    pair.a.mux.queue_close(sid)
    pair.pump()
    assert pair.a.of(StreamEnded) == pair.b.of(StreamEnded) == [StreamEnded(sid)]
    assert pair.a.mux.stream_count == pair.b.mux.stream_count == 0
    pair.a.mux.queue_close(sid)  # unknown stream: a no-op
    assert pair.pump() == 0


def test_data_after_close_is_a_violation() -> None:
    pair, sid = open_pair()
    pair.b.mux.receive_message(frame(CLOSE, sid), pair.now)
    with pytest.raises(ProtocolViolation, match="after it was closed"):
        pair.b.mux.receive_message(frame(DATA, sid, b"late"), pair.now)


def test_discard_input_releases_the_stream_once_close_is_out() -> None:
    # A handler that returns: it answers, closes and gives up reading, whatever the
    # remote still does; the stream (and its slot under max_streams) is released.
    pair, sid = open_pair(responder_limits=MuxLimits(max_streams=1))
    pair.b.auto_consume = False
    pair.a.mux.queue_data(sid, memoryview(b"request"))
    pair.pump()
    pair.b.mux.queue_data(sid, memoryview(b"response"))
    pair.b.mux.queue_close(sid, discard_input=True)
    pair.pump()
    # The remote had not closed its side: after our CLOSE it learns that nobody reads.
    assert pair.a.events == [
        DataReceived(sid, b"response"),
        StreamEnded(sid),
        StreamWasReset(sid, "stream finished", False),
    ]
    assert pair.b.mux.stream_count == pair.b.mux.remote_stream_count == 0
    assert pair.b.mux.take_finished() == [sid]

    # The remote's side is gone too: writing more is refused locally.
    assert pair.a.mux.stream_count == 0
    with pytest.raises(ProtocolViolation, match="closed for writing"):
        pair.a.mux.queue_data(sid, memoryview(b"more"))

    # The slot is free again.
    again = pair.a.mux.open_stream("/again")
    pair.pump()
    assert pair.b.of(StreamOpened)[-1] == StreamOpened(again, "/again")


def test_discard_input_after_close_forgets_at_once() -> None:
    pair, sid = open_pair()
    pair.b.auto_consume = False
    pair.a.mux.queue_data(sid, memoryview(b"unread"))
    pair.b.mux.queue_close(sid)
    pair.pump()
    assert pair.b.mux.is_open(sid)  # the remote has not closed, and data is unread
    pair.b.mux.queue_close(sid, discard_input=True)
    assert not pair.b.mux.is_open(sid)
    assert pair.b.mux.take_finished() == [sid]


def test_abandoned_stream_drops_data_but_still_enforces_the_window() -> None:
    pair, sid = open_pair(limits=MuxLimits(initial_window=1000))
    pair.a.auto_consume = False
    pair.b.mux.queue_data(sid, memoryview(bytes(5000)))
    pair.b.mux.queue_close(sid, discard_input=True)
    pair.pump()
    assert pair.b.mux.is_open(sid)  # its CLOSE waits behind data the remote does not read
    assert pair.b.mux.receive_message(frame(DATA, sid, bytes(1000)), pair.now) == []
    violates(pair.b.mux, frame(DATA, sid, bytes(1001)), "flow-control")


def test_writer_is_not_stalled_forever_when_the_reader_discards_input() -> None:
    pair, sid = open_pair(limits=MuxLimits(initial_window=4096))
    pair.b.auto_consume = False
    pair.a.mux.queue_data(sid, memoryview(bytes(100_000)))
    pair.a.mux.queue_close(sid)
    pair.pump()
    pair.b.mux.queue_close(sid, discard_input=True)
    pair.pump()
    assert pair.b.mux.stream_count == 0
    # The writer should learn that nobody reads (a reset), or be allowed to finish.
    assert pair.a.mux.queued_bytes(sid) == 0
    assert pair.a.mux.stream_count == 0


# --- reset ------------------------------------------------------------------------------------


@pytest.mark.parametrize("resetter", ["a", "b"])
def test_reset_from_either_side_reaches_the_other_with_its_reason(resetter: str) -> None:
    pair, sid = open_pair()
    side = pair.a if resetter == "a" else pair.b
    other = pair.other(side)
    side.mux.reset_stream(sid, "changed my mind")
    assert not side.mux.is_open(sid)
    assert side.mux.take_finished() == [sid]
    pair.pump()
    assert other.of(StreamWasReset) == [StreamWasReset(sid, "changed my mind", False)]
    assert other.mux.take_finished() == [sid]
    assert pair.a.mux.stream_count == pair.b.mux.stream_count == 0
    assert pair.b.mux.remote_stream_count == 0
    side.mux.reset_stream(sid, "again")  # unknown stream: a no-op
    assert pair.pump() == 0


def test_refused_reset_and_default_reason() -> None:
    pair = Pair()
    s1 = pair.a.mux.open_stream("/unknown/1")
    s2 = pair.a.mux.open_stream("/other/1")
    pair.pump()
    pair.b.mux.reset_stream(s1, "no handler", refused=True)
    pair.b.mux.reset_stream(s2)
    pair.pump()
    assert pair.a.of(StreamWasReset) == [
        StreamWasReset(s1, "no handler", True),
        StreamWasReset(s2, "reset by peer", False),
    ]
    resets = [f for f in pair.b.sent_frames() if f.type == RESET]
    assert [f.flags for f in resets] == [FLAG_REFUSED, 0]


def test_reset_reason_is_truncated_to_the_limit() -> None:
    pair, sid = open_pair(limits=MuxLimits(max_reason_len=10))
    pair.a.mux.reset_stream(sid, "x" * 100)
    pair.pump()
    assert pair.b.of(StreamWasReset) == [StreamWasReset(sid, "x" * 10, False)]


@pytest.mark.parametrize("opener", ["a", "b"])
def test_frames_that_cross_a_reset_are_dropped_silently(opener: str) -> None:
    pair = Pair()
    side = pair.a if opener == "a" else pair.b
    sid = side.mux.open_stream("/x")
    pair.pump()
    other = pair.other(side)
    # `side` writes, consumes and closes while `other` resets: the frames cross.
    side.mux.queue_data(sid, memoryview(b"in flight"))
    side.mux.queue_close(sid)
    in_flight = side.mux.next_message()
    other.mux.reset_stream(sid, "bye")
    assert in_flight is not None
    assert other.mux.receive_message(in_flight, pair.now) == []
    assert other.mux.receive_message(frame(WINDOW, sid, value=100), pair.now) == []
    assert other.mux.receive_message(frame(RESET, sid, b"crossed"), pair.now) == []
    pair.pump()
    assert side.of(StreamWasReset) == [StreamWasReset(sid, "bye", False)]
    assert pair.a.mux.stream_count == pair.b.mux.stream_count == 0


def test_local_reset_discards_queued_data() -> None:
    pair, sid = open_pair(limits=MuxLimits(initial_window=1000))
    pair.b.auto_consume = False
    pair.a.mux.queue_data(sid, memoryview(bytes(50_000)))
    pair.pump()
    assert pair.a.mux.queued_bytes(sid) == 49_000
    assert pair.a.mux.take_drained() == []
    pair.a.mux.reset_stream(sid, "abort")
    assert pair.a.mux.queued_bytes(sid) == 0
    assert pair.a.mux.take_drained() == [sid]
    sent_before = len(pair.a.sent)
    pair.b.consume_all(pair.now)
    pair.pump()
    after = [f for message in pair.a.sent[sent_before:] for f in message]
    assert [f.type for f in after] == [RESET]
    assert len(pair.b.received[sid]) == 1000


def test_remote_reset_discards_queued_data() -> None:
    pair, sid = open_pair(limits=MuxLimits(initial_window=1000))
    pair.b.auto_consume = False
    pair.a.mux.queue_data(sid, memoryview(bytes(50_000)))
    pair.a.mux.queue_close(sid)
    pair.pump()
    pair.b.mux.reset_stream(sid, "enough")
    pair.pump()
    assert pair.a.mux.queued_bytes(sid) == 0
    assert pair.a.mux.take_drained() == [sid]
    assert pair.a.mux.take_finished() == [sid]
    assert not pair.a.mux.has_output()


# --- scheduling -------------------------------------------------------------------------------


def test_small_write_is_not_starved_by_a_bulk_transfer() -> None:
    pair = Pair()
    bulk = pair.a.mux.open_stream("/bulk")
    small = pair.a.mux.open_stream("/small")
    pair.pump()
    pair.a.mux.queue_data(bulk, memoryview(bytes(10 << 20)))
    assert pair.step(pair.a)
    pair.a.mux.queue_data(small, memoryview(b"s" * 100))
    assert pair.step(pair.a)
    assert pair.step(pair.a)
    assert pair.b.received[small] == b"s" * 100
    # And the bulk stream goes on afterwards.
    pair.pump()
    assert len(pair.b.received[bulk]) == 10 << 20


def test_streams_share_messages_round_robin() -> None:
    pair = Pair()
    sids = [pair.a.mux.open_stream(f"/s{i}") for i in range(3)]
    pair.pump()
    for sid in sids:
        pair.a.mux.queue_data(sid, memoryview(bytes(300_000)))
    pair.b.auto_consume = False
    pair.pump()
    # Each stream got its full window: no stream was left waiting behind another.
    assert [len(pair.b.received[s]) for s in sids] == [MuxLimits().initial_window] * 3
    order = [f.sid for f in pair.a.sent_frames() if f.type == DATA]
    assert order[:3] == sids


def test_control_frames_go_first_and_open_precedes_data() -> None:
    pair = Pair(MuxLimits(max_pending_control=20_000))
    pair.b.auto_consume = False
    for i in range(10_000):  # 100 kB of pings: more than one message
        pair.a.mux.ping(i)
    sids = []
    for i in range(300):
        sid = pair.a.mux.open_stream(f"/stream/{i}")
        pair.a.mux.queue_data(sid, memoryview(b"d" * 50))
        pair.a.mux.queue_close(sid)
        sids.append(sid)
    pair.a.mux.ping(99_999)
    pair.pump()  # checks every message: control frames first, OPEN before DATA
    frames = pair.a.sent_frames()
    kinds = [f.type for f in frames]
    assert kinds[:10_000] == [PING] * 10_000
    first_data = kinds.index(DATA)
    assert all(k in CONTROL_TYPES for k in kinds[:first_data])
    assert all(f.type == PING for f in pair.a.sent[0])
    for sid in sids:
        assert pair.b.received[sid] == b"d" * 50
    assert [e.opaque for e in pair.a.of(PongReceived)] == [*range(10_000), 99_999]


def test_control_queued_later_still_goes_before_pending_data() -> None:
    pair, sid = open_pair()
    pair.a.mux.queue_data(sid, memoryview(bytes(1000)))
    pair.a.mux.ping(1)
    other = pair.a.mux.open_stream("/later")
    message = pair.a.mux.next_message()
    assert message is not None
    assert [(f.type, f.sid) for f in parse(message)] == [(PING, 0), (OPEN, other), (DATA, sid)]


# --- limits -----------------------------------------------------------------------------------


def test_streams_beyond_max_streams_are_reset_not_fatal() -> None:
    pair = Pair(responder_limits=MuxLimits(max_streams=3))
    sids = [pair.a.mux.open_stream(f"/s{i}") for i in range(5)]
    for sid in sids:
        pair.a.mux.queue_data(sid, memoryview(b"payload"))
    pair.pump()
    assert [e.stream_id for e in pair.b.of(StreamOpened)] == sids[:3]
    assert pair.b.mux.remote_stream_count == 3
    assert pair.a.of(StreamWasReset) == [
        StreamWasReset(s, "too many streams", False) for s in sids[3:]
    ]
    assert pair.a.mux.stream_count == 3
    assert set(pair.b.received) == set(sids[:3])

    # Once one finishes there is room again.
    pair.a.mux.reset_stream(sids[0])
    pair.pump()
    assert pair.b.mux.remote_stream_count == 2
    new = pair.a.mux.open_stream("/again")
    pair.pump()
    assert pair.b.of(StreamOpened)[-1] == StreamOpened(new, "/again")
    assert pair.b.mux.remote_stream_count == 3


def test_after_goaway_received_no_new_streams_but_old_ones_work() -> None:
    pair, sid = open_pair()
    pair.b.mux.go_away(7)
    pair.b.mux.go_away(8)  # only the first one is sent
    pair.pump()
    assert pair.a.of(GoAwayReceived) == [GoAwayReceived(7)]
    assert pair.a.mux.remote_goaway
    with pytest.raises(ProtocolViolation):
        pair.a.mux.open_stream("/new")
    with pytest.raises(ProtocolViolation):
        pair.b.mux.open_stream("/new")
    pair.a.mux.queue_data(sid, memoryview(b"still"))
    pair.b.mux.queue_data(sid, memoryview(b"works"))
    pair.pump()
    assert pair.b.received[sid] == b"still"
    assert pair.a.received[sid] == b"works"


def test_after_local_goaway_remote_opens_are_refused() -> None:
    pair = Pair()
    crossing = pair.a.mux.open_stream("/racing")  # crosses the GOAWAY on the wire
    pair.b.mux.go_away()
    pair.pump()
    assert pair.b.of(StreamOpened) == []
    assert pair.a.of(StreamWasReset) == [
        StreamWasReset(crossing, "connection is going away", False)
    ]
    assert pair.a.of(GoAwayReceived) == [GoAwayReceived(0)]
    assert pair.a.mux.stream_count == pair.b.mux.stream_count == 0


def test_ping_is_answered_with_the_same_opaque_value() -> None:
    pair = Pair()
    pair.a.mux.ping(0xDEADBEEF)
    pair.a.mux.ping((1 << 32) + 5)  # the opaque value is 32 bits
    pair.b.mux.ping(0)
    pair.pump()
    assert pair.a.events == [PongReceived(0xDEADBEEF), PongReceived(5)]
    assert pair.b.events == [PongReceived(0)]
    pongs = [f for f in pair.b.sent_frames() if f.type == PING and f.flags & FLAG_ACK]
    assert [f.length for f in pongs] == [0xDEADBEEF, 5]


# --- malformed input --------------------------------------------------------------------------


def violates(mux: Multiplexer, message: bytes, match: str = "") -> None:
    with pytest.raises(ProtocolViolation, match=match):
        mux.receive_message(message, 0.0)


def test_truncated_header_and_overrunning_payloads() -> None:
    pair, sid = open_pair()
    b = pair.b.mux
    violates(b, b"\x00" * 5, "truncated")
    violates(b, frame(PING, value=1) + b"\x05\x00\x00", "truncated")
    violates(b, frame(DATA, sid, b"x" * 50)[:-1], "overruns")
    violates(b, HEADER.pack(DATA, 0, sid, 0xFFFFFFFF) + b"x", "overruns")
    violates(b, HEADER.pack(OPEN, 0, 3, 20) + b"/short", "OPEN")
    violates(b, HEADER.pack(RESET, 0, sid, 20) + b"why", "RESET")


@pytest.mark.parametrize("ftype", [7, 8, 100, 255])
def test_unknown_frame_type(ftype: int) -> None:
    violates(Multiplexer(False), HEADER.pack(ftype, 0, 0, 0), "unknown frame type")


def test_open_with_bad_stream_ids() -> None:
    responder = Multiplexer(False)
    violates(responder, frame(OPEN, 2, b"/p"), "invalid stream id")  # responder's own parity
    violates(responder, frame(OPEN, 0, b"/p"), "invalid stream id")
    initiator = Multiplexer(True)
    violates(initiator, frame(OPEN, 1, b"/p"), "invalid stream id")
    violates(initiator, frame(OPEN, 0, b"/p"), "invalid stream id")

    responder = Multiplexer(False)
    assert responder.receive_message(frame(OPEN, 5, b"/p"), 0.0) == [StreamOpened(5, "/p")]
    violates(responder, frame(OPEN, 5, b"/p"), "invalid stream id")  # reused
    violates(responder, frame(OPEN, 3, b"/p"), "invalid stream id")  # lower than one already seen
    responder.reset_stream(5)
    violates(responder, frame(OPEN, 5, b"/p"), "invalid stream id")  # reused after reset


@pytest.mark.parametrize("ftype", [DATA, WINDOW, CLOSE, RESET])
def test_frames_for_streams_never_opened(ftype: int) -> None:
    responder = Multiplexer(False)
    assert responder.receive_message(frame(OPEN, 3, b"/p"), 0.0)
    violates(responder, frame(ftype, 5), "never opened")  # the remote's, not opened yet
    violates(responder, frame(ftype, 2), "never opened")  # ours, not opened yet
    violates(responder, frame(ftype, 0), "never opened")
    assert responder.open_stream("/mine") == 2
    responder.receive_message(frame(ftype, 2), 0.0)  # fine now
    responder.receive_message(frame(ftype, 1), 0.0)  # skipped by the remote: not an error


def test_open_protocol_name_limits() -> None:
    limits = MuxLimits(max_protocol_len=16)
    responder = Multiplexer(False, limits)
    assert responder.receive_message(frame(OPEN, 1, b"p" * 16), 0.0) == [StreamOpened(1, "p" * 16)]
    violates(Multiplexer(False, limits), frame(OPEN, 1, b"p" * 17), "protocol length")
    violates(Multiplexer(False), frame(OPEN, 1, b"/bad\xff\xfe"), "UTF-8")


def test_reset_reason_limits() -> None:
    limits = MuxLimits(max_reason_len=16)
    pair, sid = open_pair(limits=limits)
    violates(pair.b.mux, frame(RESET, sid, b"r" * 17), "reason length")
    events = pair.b.mux.receive_message(frame(RESET, sid, b"r" * 16), 0.0)
    assert events == [StreamWasReset(sid, "r" * 16, False)]
    pair, sid = open_pair(limits=limits)
    events = pair.b.mux.receive_message(frame(RESET, sid, b"\xff\xfe"), 0.0)
    assert events == [StreamWasReset(sid, "\ufffd\ufffd", False)]  # a reason is only text


def test_window_overflow() -> None:
    pair, sid = open_pair()
    mux = pair.a.mux
    limit = 1 << 31
    mux.receive_message(frame(WINDOW, sid, value=limit - MuxLimits().initial_window), 0.0)
    violates(mux, frame(WINDOW, sid, value=1), "window overflow")
    pair, sid = open_pair()
    violates(pair.a.mux, frame(WINDOW, sid, value=0xFFFFFFFF), "window overflow")


def test_control_frame_flood() -> None:
    limits = MuxLimits(max_pending_control=16)
    mux = Multiplexer(False, limits)
    pings = b"".join(frame(PING, value=i) for i in range(16))
    mux.receive_message(pings, 0.0)  # 16 pongs pending: at the limit, still fine
    violates(mux, frame(PING, value=16), "flood")

    mux = Multiplexer(False, limits)
    mux.receive_message(pings, 0.0)
    assert mux.next_message() is not None  # our pongs went out: room again
    mux.receive_message(pings, 0.0)

    # Excess OPENs are answered with RESETs, and those count as well.
    mux = Multiplexer(False, MuxLimits(max_streams=1, max_pending_control=4))
    opens = b"".join(frame(OPEN, sid, b"/p") for sid in range(1, 13, 2))
    violates(mux, opens, "flood")


def test_local_ping_and_goaway_are_not_a_flood() -> None:
    # The flood limit bounds what the peer makes us queue; our own keepalive pings
    # and shutdown must go out even when many of our own frames are waiting.
    mux = Multiplexer(True, MuxLimits(max_pending_control=4))
    for _ in range(4):
        mux.open_stream("/p")
    mux.ping(1)
    mux.go_away(3)
    kinds = [(f.type, f.length) for f in parse(mux.next_message() or b"")]
    assert kinds[-2:] == [(PING, 1), (GOAWAY, 3)]


def check_random_input(mux: Multiplexer, messages: list[bytes]) -> None:
    for message in messages:
        try:
            mux.receive_message(message, 0.0)
        except ProtocolViolation:
            return  # the connection is dead: nothing more is read
        while (out := mux.next_message()) is not None:
            assert len(out) <= MAX_MESSAGE_PLAINTEXT
            parse(out)


def with_some_streams() -> Multiplexer:
    pair = Pair(MuxLimits(max_streams=4, max_pending_control=64))
    for _ in range(2):
        pair.a.mux.open_stream("/a")
        sid = pair.b.mux.open_stream("/b")
        pair.b.mux.queue_data(sid, memoryview(bytes(100)))
    pair.pump()
    return pair.b.mux


@settings(max_examples=300, deadline=None)
@given(messages=st.lists(st.binary(max_size=300), max_size=5))
def test_random_bytes_raise_only_protocol_violation(messages: list[bytes]) -> None:
    check_random_input(Multiplexer(False), messages)
    check_random_input(with_some_streams(), messages)


u32 = st.integers(0, 0xFFFFFFFF)
random_frame = st.builds(
    lambda ftype, flags, sid, length, payload: HEADER.pack(ftype, flags, sid, length) + payload,
    st.integers(0, 7),
    st.integers(0, 3),
    st.integers(0, 8) | u32,
    st.integers(0, 40) | u32,
    st.binary(max_size=40),
)
random_message = st.tuples(st.lists(random_frame, max_size=6), st.integers(0, 10)).map(
    lambda t: b"".join(t[0])[: max(0, len(b"".join(t[0])) - t[1])]
)


@settings(max_examples=300, deadline=None)
@given(messages=st.lists(random_message, max_size=6))
def test_random_frames_raise_only_protocol_violation(messages: list[bytes]) -> None:
    check_random_input(
        Multiplexer(False, MuxLimits(max_streams=4, max_pending_control=64)), messages
    )
    check_random_input(with_some_streams(), messages)


# --- random operations on both sides ----------------------------------------------------------

side_index = st.integers(0, 1)
pick = st.integers(0, 7)


OPERATION_ARGS = {
    "pump": st.tuples(),
    "step": st.tuples(side_index, st.integers(1, 3)),
    "open": st.tuples(side_index),
    "write": st.tuples(side_index, pick, st.integers(0, 20_000)),
    "consume": st.tuples(side_index, pick, st.integers(0, 30_000)),
    "close": st.tuples(side_index, pick),
    "reset": st.tuples(side_index, pick, st.booleans()),
    "ping": st.tuples(side_index, u32),
    "tick": st.tuples(st.sampled_from([0.0005, 0.01, 1.0])),
    "go_away": st.tuples(side_index, st.integers(0, 9)),  # acts on 0 only: rare
}
# Weighted towards what moves data.
OPERATION_KINDS = [*["step", "open", "consume"] * 3, *["write"] * 4, *OPERATION_ARGS]
operation = st.sampled_from(OPERATION_KINDS).flatmap(
    lambda kind: OPERATION_ARGS[kind].map(lambda args: (kind, *args))
)


class World:
    """Both applications, driving a Pair at random and checking invariants."""

    def __init__(self) -> None:
        self.limits = MuxLimits(initial_window=2048, max_window=8192, max_streams=3)
        self.pair = Pair(self.limits)
        self.sides = (self.pair.a, self.pair.b)
        for side in self.sides:
            side.auto_consume = False
        self.known: dict[str, set[int]] = {"initiator": set(), "responder": set()}
        self.closed: set[tuple[str, int]] = set()
        self.sent: dict[tuple[str, int], bytearray] = defaultdict(bytearray)
        self.reset: set[int] = set()
        self.pings: dict[str, list[int]] = {"initiator": [], "responder": []}
        self.finished: dict[str, list[int]] = {"initiator": [], "responder": []}
        self.rng = random.Random(0)
        for side in self.sides:  # one stream each way to start with
            self.apply(("open", self.sides.index(side)))
        self.apply(("pump",))

    def streams(self, side: Side) -> list[int]:
        return sorted(s for s in self.known[side.name] if side.mux.is_open(s))

    def choose(self, side: Side, index: int) -> int | None:
        live = self.streams(side)
        return live[index % len(live)] if live else None

    def apply(self, op: tuple) -> None:
        kind = op[0]
        pair = self.pair
        if kind == "pump":
            pair.pump()
        elif kind == "tick":
            pair.now += op[1]
        else:
            side = self.sides[op[1]]
            mux = side.mux
            if kind == "open":
                if mux.local_goaway or mux.remote_goaway:
                    with pytest.raises(ProtocolViolation):
                        mux.open_stream("/p")
                else:
                    sid = mux.open_stream("/p")
                    assert sid & 1 == (side is pair.a)
                    self.known[side.name].add(sid)
            elif kind == "ping":
                mux.ping(op[2])
                self.pings[side.name].append(op[2])
            elif kind == "step":
                for _ in range(op[2]):
                    pair.step(side)
            elif kind == "go_away":
                if op[2] == 0:
                    mux.go_away()
            elif (sid := self.choose(side, op[2])) is not None:
                self.stream_op(side, sid, kind, op[3:])
        for side in self.sides:
            self.known[side.name].update(e.stream_id for e in side.of(StreamOpened))
            self.reset.update(e.stream_id for e in side.of(StreamWasReset))
            self.finished[side.name] += side.mux.take_finished()
        self.check()

    def stream_op(self, side: Side, sid: int, kind: str, args: tuple) -> None:
        mux = side.mux
        if kind == "write":
            data = self.rng.randbytes(args[0])
            if (side.name, sid) in self.closed:
                with pytest.raises(ProtocolViolation):
                    mux.queue_data(sid, memoryview(data))
            else:
                mux.queue_data(sid, memoryview(data))
                self.sent[side.name, sid] += data
        elif kind == "close":
            mux.queue_close(sid)
            self.closed.add((side.name, sid))
        elif kind == "reset":
            mux.reset_stream(sid, "random", refused=args[0])
            self.reset.add(sid)
        elif kind == "consume":
            side.consume(sid, min(args[0], side.unconsumed[sid]), self.pair.now)

    def check(self) -> None:
        for side in self.sides:
            other = self.pair.other(side)
            for sid, got in side.received.items():
                assert self.sent[other.name, sid].startswith(got)
            for ended in side.of(StreamEnded):  # the end comes after all the data
                assert side.received[ended.stream_id] == self.sent[other.name, ended.stream_id]
            for n in side.unconsumed.values():
                assert n <= self.limits.max_window
            assert side.mux.remote_stream_count <= self.limits.max_streams

    def finish(self) -> None:
        """Close everything, read everything: both sides must forget every stream."""
        pair = self.pair
        for side in self.sides:
            side.auto_consume = True
            side.consume_all(pair.now)
        self.apply(("pump",))  # deliver OPENs still in flight: each side knows every stream
        for side in self.sides:
            for sid in self.streams(side):
                side.mux.queue_close(sid)
        self.apply(("pump",))
        for side in self.sides:
            other = pair.other(side)
            assert side.mux.stream_count == 0
            assert side.mux.remote_stream_count == 0
            assert not side.mux.has_output()
            assert len(self.finished[side.name]) == len(set(self.finished[side.name]))
            assert set(self.finished[side.name]) == self.known[side.name]
            for sid in self.known[side.name]:
                if sid not in self.reset:
                    assert side.received[sid] == self.sent[other.name, sid]
            assert [e.opaque for e in side.of(PongReceived)] == self.pings[side.name]


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(operation, max_size=60))
def test_random_operations_keep_the_invariants(ops: list[tuple]) -> None:
    world = World()
    for op in ops:
        world.apply(op)
    world.finish()
