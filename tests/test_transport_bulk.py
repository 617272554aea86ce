"""Bulk data on a connection: BULK frames and bodies, posted reads, reserved windows.

A large write travels as BULK frames, each announcing a body: the connection's next
secure-channel message, `length` bytes of the stream's data, encrypted straight from
the writer's buffer and, when the reader waits with a buffer of its own
(`readexactly_into`), decrypted straight into it. The multiplexer rules are checked
sans-IO; the record layer on two `Connection`s wired back to back in memory; the
rest on real hosts over 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import struct
from collections import deque

import pytest
from waiting import eventually

import shoal.transport.connection as connection_module
from shoal.transport.connection import Connection, Stream
from shoal.transport.errors import ProtocolViolation, TransportError
from shoal.transport.identity import Identity
from shoal.transport.mux import (
    BULK,
    DATA,
    HEADER,
    HEADER_SIZE,
    MAX_BULK_BODY,
    OPEN,
    WINDOW,
    BulkIncoming,
    Multiplexer,
    MuxLimits,
)

SINK = "/shoal/test-bulk/1.0.0"


def frames(message: bytes | bytearray) -> list[tuple[int, int, int]]:
    """(type, stream, length) of every frame of a plaintext message."""
    out = []
    pos = 0
    while pos < len(message):
        ftype, _, sid, length = HEADER.unpack_from(message, pos)
        out.append((ftype, sid, length))
        pos += HEADER_SIZE + (length if ftype in (DATA, OPEN) else 0)
    return out


def opened_pair(
    bulk_min: int = 1024, window: int = 4 << 20
) -> tuple[Multiplexer, Multiplexer, int]:
    limits = MuxLimits(initial_window=window)
    tx = Multiplexer(True, limits, bulk_min=bulk_min)
    rx = Multiplexer(False, limits)
    sid = tx.open_stream("/p")
    message = tx.next_message()
    assert message is not None
    rx.receive_message(message, 0.0)
    return tx, rx, sid


# --- the multiplexer, sans-IO ------------------------------------------------------------------


def test_a_large_write_goes_out_as_bulk_bodies_that_are_views_of_the_writers_buffer() -> None:
    tx, _, sid = opened_pair()
    data = bytearray(os.urandom(MAX_BULK_BODY * 2 + 5000))
    tx.queue_data(sid, memoryview(data))
    bodies = []
    while (out := tx.next_output()) is not None:
        message, body = out
        kinds = frames(message)
        if body is not None:
            assert kinds[-1] == (BULK, sid, len(body))  # announced by the message's last frame
            assert body.obj is data  # no copy: a view of the writer's own buffer
            bodies.append(bytes(body))
    assert [len(b) for b in bodies] == [MAX_BULK_BODY, MAX_BULK_BODY, 5000]
    assert b"".join(bodies) == bytes(data)


def test_small_writes_and_a_multiplexer_without_bulk_min_use_data_frames() -> None:
    tx, _, sid = opened_pair(bulk_min=4096)
    tx.queue_data(sid, memoryview(b"x" * 4095))
    message, body = tx.next_output() or (bytearray(), None)
    assert body is None and frames(message) == [(DATA, sid, 4095)]
    plain, _, sid2 = opened_pair(bulk_min=0)
    plain.queue_data(sid2, memoryview(bytes(1 << 20)))
    while (out := plain.next_output()) is not None:
        assert out[1] is None and all(kind == DATA for kind, _, _ in frames(out[0]))


def test_data_stops_short_of_a_queued_piece_that_can_go_as_a_body() -> None:
    tx, _, sid = opened_pair(bulk_min=1024)
    header, payload = b"h" * 13, bytes(100_000)
    tx.queue_data(sid, memoryview(header))
    tx.queue_data(sid, memoryview(payload))
    message, body = tx.next_output() or (bytearray(), None)
    assert frames(message) == [(DATA, sid, 13), (BULK, sid, 100_000)]
    assert body is not None and len(body) == 100_000


def test_bodies_respect_the_send_window() -> None:
    tx, _, sid = opened_pair(bulk_min=1024, window=300_000)
    tx.queue_data(sid, memoryview(bytes(1 << 20)))
    sizes = []
    while (out := tx.next_output()) is not None:
        if out[1] is not None:
            sizes.append(len(out[1]))
    assert sum(sizes) == 300_000 and max(sizes) <= MAX_BULK_BODY


def test_a_received_bulk_frame_is_counted_against_the_window_and_announces_its_body() -> None:
    tx, rx, sid = opened_pair(window=100_000)
    tx.queue_data(sid, memoryview(bytes(50_000)))
    message, body = tx.next_output() or (bytearray(), None)
    assert body is not None
    assert rx.receive_message(message, 0.0) == [BulkIncoming(sid, 50_000, True)]
    rx.consumed(sid, 50_000, 0.0)  # the application read it: credit goes back
    assert any(kind == WINDOW for kind, _, _ in frames(rx.next_message() or b""))


@pytest.mark.parametrize(
    "message, error",
    [
        (HEADER.pack(BULK, 0, 1, 100) + HEADER.pack(DATA, 0, 1, 0), "last frame"),
        (HEADER.pack(BULK, 0, 1, 0), "BULK body of 0"),
        (HEADER.pack(BULK, 0, 1, MAX_BULK_BODY + 1), "BULK body of"),
        (HEADER.pack(BULK, 0, 1, 5_000_000), "BULK body of"),
    ],
    ids=["not-last", "empty", "too-large", "far-too-large"],
)
def test_malformed_bulk_frames_are_protocol_violations(message: bytes, error: str) -> None:
    _, rx, _ = opened_pair()
    with pytest.raises(ProtocolViolation, match=error):
        rx.receive_message(message, 0.0)


def test_a_bulk_body_beyond_the_window_is_a_flow_control_violation() -> None:
    _, rx, sid = opened_pair(window=100_000)
    with pytest.raises(ProtocolViolation, match="flow-control"):
        rx.receive_message(HEADER.pack(BULK, 0, sid, 100_001), 0.0)


def test_a_body_for_a_stream_nobody_reads_is_announced_for_dropping() -> None:
    _, rx, sid = opened_pair()
    rx.queue_close(sid, discard_input=True)  # the handler returned
    assert rx.receive_message(HEADER.pack(BULK, 0, sid, 1000), 0.0) == [
        BulkIncoming(sid, 1000, False)
    ]


def test_reserve_grants_the_credit_at_once_and_only_ever_grows_the_window() -> None:
    limits = MuxLimits(initial_window=1000, max_window=50_000)
    tx, rx = Multiplexer(True, limits, bulk_min=100), Multiplexer(False, limits)
    sid = tx.open_stream("/p")
    rx.receive_message(tx.next_message() or b"", 0.0)
    rx.reserve(sid, 30_000)
    first = rx.next_message() or b""
    assert frames(first) == [(WINDOW, sid, 29_000)]
    rx.reserve(sid, 10_000)  # less than it has: nothing
    assert rx.next_message() is None
    rx.reserve(sid, 10**9)  # capped by max_window
    second = rx.next_message() or b""
    assert frames(second) == [(WINDOW, sid, 20_000)]
    tx.receive_message(first, 0.0)
    tx.receive_message(second, 0.0)
    tx.queue_data(sid, memoryview(bytes(100_000)))
    sent = 0
    while (out := tx.next_output()) is not None:
        message, _ = out
        for event in rx.receive_message(message, 0.0):  # never a flow-control violation
            sent += event.length if isinstance(event, BulkIncoming) else len(event.data)
    assert sent == 50_000  # the whole reserved window, without a single read


# --- the record layer: two connections back to back in memory -----------------------------------


class Wire:
    """One connection's transport: delivers its writes to the other connection on the
    next loop iteration (in large bursts, as a fast kernel does), honours
    pause_reading / resume_reading, and lets a test tamper with the bytes on the way."""

    def __init__(self) -> None:
        self.protocol: Connection | None = None  # the connection this transport serves
        self.other: Wire | None = None  # the other side's transport
        self.closed = False
        self.tamper: bool = False
        self.sent = 0
        self.paused = False
        self.pauses = 0
        self._inbound: deque[memoryview] = deque()

    def get_extra_info(self, name: str, default: object = None) -> object:
        return {"peername": ("127.0.0.1", 9), "sockname": ("127.0.0.1", 10)}.get(name, default)

    def set_write_buffer_limits(self, high: int, low: int) -> None:
        pass

    def write(self, data: bytes) -> None:
        self.writelines([data])

    def writelines(self, parts: list[bytes | bytearray | memoryview]) -> None:
        data = b"".join(bytes(p) for p in parts)  # the sender may reuse its buffers now
        self.sent += len(data)
        if self.tamper and len(data) > 100_000:
            flipped = bytearray(data)
            flipped[len(flipped) // 2] ^= 1  # inside a body
            data = bytes(flipped)
        assert self.other is not None
        self.other._inbound.append(memoryview(data))
        asyncio.get_running_loop().call_soon(self.other._pump)

    def _pump(self) -> None:
        conn = self.protocol
        assert conn is not None
        while self._inbound and not self.paused and not conn.closed.done():
            view = self._inbound[0]
            buf = conn.get_buffer(len(view))
            n = min(len(buf), len(view))
            buf[:n] = view[:n]
            if n == len(view):
                self._inbound.popleft()
            else:
                self._inbound[0] = view[n:]
            conn.buffer_updated(n)

    def abort(self) -> None:
        if not self.closed and self.protocol is not None:
            self.closed = True
            self.protocol.connection_lost(None)

    close = abort

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        self.paused = True
        self.pauses += 1

    def resume_reading(self) -> None:
        self.paused = False
        asyncio.get_running_loop().call_soon(self._pump)


async def wired() -> tuple[Connection, Connection, Wire, asyncio.Queue[Stream]]:
    accepted: asyncio.Queue[Stream] = asyncio.Queue()
    a = Connection(Identity.generate(), initiator=True)
    b = Connection(Identity.generate(), initiator=False, on_stream=accepted.put_nowait)
    wa, wb = Wire(), Wire()
    wa.protocol, wa.other, wb.protocol, wb.other = a, wb, b, wa
    a.connection_made(wa)
    b.connection_made(wb)
    async with asyncio.timeout(5):
        await asyncio.gather(a.handshake_done, b.handshake_done)
    return a, b, wa, accepted


async def test_bulk_transfers_arrive_intact_whether_or_not_the_reader_brings_a_buffer() -> None:
    a, b, _, accepted = await wired()
    payload = os.urandom(3 * MAX_BULK_BODY + 12345)
    s = await a.open_stream(SINK)

    async def write() -> None:
        for _ in range(3):
            await s.write(struct.pack(">I", len(payload)))
            await s.write(payload)
        await s.write(payload)
        await s.close()

    async def read() -> None:
        r = await accepted.get()
        # Posted reads: a chunk header, then the chunk straight into the reader's buffer.
        for _ in range(3):
            (n,) = struct.unpack(">I", await r.readexactly(4))
            into = bytearray(n)
            await r.readexactly_into(into)
            assert into == payload
        rest = bytearray()  # then plain reads, which take the bodies from a pool
        while chunk := await r.read(1 << 20):
            rest += chunk
        assert rest == payload

    async with asyncio.timeout(10):
        await asyncio.gather(write(), read())
    a.abort("done")
    b.abort("done")


async def test_bodies_behind_a_chunk_header_go_straight_into_the_readers_buffer() -> None:
    """The all-reduce pattern at full speed: per chunk a small header, then many
    bodies, arriving in bursts that fill the receive buffer. The reader gets one
    loop iteration to take the header and post its buffer (the socket waits
    meanwhile), so bodies are decrypted into that buffer, not into a spare one
    that must then be copied."""
    a, b, _, accepted = await wired()
    chunk = os.urandom(4 << 20)  # 16 bodies
    chunks = 6
    s = await a.open_stream(SINK)

    async def write() -> None:
        for i in range(chunks):
            await s.write(struct.pack(">I", i))
            await s.write(chunk)
        await s.close()

    async def read() -> None:
        r = await accepted.get()
        r.reserve(chunks * (len(chunk) + 4))  # the writer may run ahead: big bursts
        into = bytearray(len(chunk))
        for i in range(chunks):
            assert struct.unpack(">I", await r.readexactly(4)) == (i,)
            await r.readexactly_into(into)
            assert into == chunk

    async with asyncio.timeout(20):
        await asyncio.gather(write(), read())
    total = b.bulk_bytes_direct + b.bulk_bytes_buffered
    assert total > 0.99 * chunks * len(chunk)  # (a few bytes may ride along as DATA)
    # At most the first body, which comes before the reader ever posted a buffer.
    assert b.bulk_bytes_buffered <= MAX_BULK_BODY, (b.bulk_bytes_direct, b.bulk_bytes_buffered)
    a.abort("done")
    b.abort("done")


async def test_a_tampered_body_fails_authentication_and_only_costs_the_connection() -> None:
    a, b, wire, accepted = await wired()
    s = await a.open_stream(SINK)
    await s.write(b"hello")
    r = await accepted.get()
    assert await r.readexactly(5) == b"hello"
    wire.tamper = True
    into = bytearray(200_000)
    reading = asyncio.ensure_future(r.readexactly_into(into))
    await s.write(os.urandom(200_000))  # one body, within the window
    async with asyncio.timeout(5):
        with pytest.raises(TransportError):
            await reading
        await b.closed
    assert "authentication" in (b.close_reason or "")
    a.abort("done")


# --- real hosts -------------------------------------------------------------------------------


async def test_a_reserved_window_lets_the_writer_run_ahead_of_the_reader(pair) -> None:
    a, b = pair
    streams: asyncio.Queue[Stream] = asyncio.Queue()
    release = asyncio.Event()

    async def handler(stream: Stream) -> None:
        stream.reserve(8 << 20)
        await streams.put(stream)
        await release.wait()
        await stream.readexactly_into(bytearray(6 << 20))
        await stream.write(b"ok")

    b.set_handler(SINK, handler)
    s = await a.open_stream(b.addresses()[0], SINK)
    await s.write(b"x")  # opens the stream on the other side
    await streams.get()
    async with asyncio.timeout(10):
        # 6 MiB out while the reader reads nothing: only the reserved window allows it
        # (the default window is 256 KiB).
        await s.write(bytes((6 << 20) - 1))
        release.set()
        assert await s.readexactly(2) == b"ok"


async def test_chunked_transfers_with_headers_arrive_intact_over_loopback(pair) -> None:
    """The all-reduce pattern: per chunk, a small header then a large payload read into
    a preallocated buffer (straight from the record layer when possible)."""
    a, b = pair
    chunks = [os.urandom(size) for size in (1 << 20, 3 << 20, 70_000, 17, (1 << 20) + 5)]
    rounds = 3
    digests: asyncio.Queue[bytes] = asyncio.Queue()

    async def handler(stream: Stream) -> None:
        for _ in range(rounds * len(chunks)):
            (n,) = struct.unpack(">Q", await stream.readexactly(8))
            into = memoryview(bytearray(n))
            await stream.readexactly_into(into)
            await digests.put(hashlib.sha256(into).digest())

    b.set_handler(SINK, handler)
    s = await a.open_stream(b.addresses()[0], SINK)
    async with asyncio.timeout(20):
        for _ in range(rounds):
            for c in chunks:
                await s.write(struct.pack(">Q", len(c)))
                await s.write(c)
        for _ in range(rounds):
            for c in chunks:
                assert await digests.get() == hashlib.sha256(c).digest()
    await s.close()


async def test_a_write_that_resets_the_connection_ends_the_flush_without_an_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """uvloop closes a transport whose write failed (a reset) and raises on any later
    write, before `connection_lost` arrives: a flush of several batches stops at
    the failed one instead of raising in a loop callback (an ERROR in the soak)."""
    monkeypatch.setattr(connection_module, "_WRITE_BATCH", 4096)  # several writes per flush
    a, _b, wa, _accepted = await wired()
    send = Wire.writelines

    def resetting(self: Wire, parts: list[bytes | bytearray | memoryview]) -> None:
        if self.closed:
            raise RuntimeError("unable to perform operation: the handler is closed")
        if self is wa and sum(len(p) for p in parts) >= 4096:  # the first batch of data
            self.closed = True  # (as uvloop does on ECONNRESET; connection_lost comes later)
        else:
            send(self, parts)

    errors: list[dict[str, object]] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _loop, ctx: errors.append(ctx))
    Wire.writelines = resetting  # type: ignore[method-assign]
    try:
        streams = [await a.open_stream(SINK) for _ in range(3)]
        # Written in one loop turn: one flush, a batch per stream.
        writing = [asyncio.ensure_future(s.write(os.urandom(100_000))) for s in streams]
        await eventually(lambda: wa.closed, "the write that resets the connection", 5)
        for w in writing:
            w.cancel()
        await asyncio.gather(*writing, return_exceptions=True)
    finally:
        Wire.writelines = send  # type: ignore[method-assign]
        loop.set_exception_handler(None)
    assert not errors, errors[0].get("exception")
    a.abort("done")


async def test_a_connection_gives_its_buffers_back_about_a_second_after_a_large_message() -> None:
    """One large message grows the receiver's buffer (and fills its pools); once the
    connection is quiet for `_RELEASE_AFTER_S` it holds none (until its next bytes), not
    only at the next keepalive timer (15 s): a DHT node answering hundreds of peers
    would otherwise hold a grown buffer on each of them."""
    a, b, _, accepted = await wired()
    s = await a.open_stream(SINK)
    payload = os.urandom(200_000)
    await s.write(payload)
    r = await accepted.get()
    got = bytearray()
    async with asyncio.timeout(5):
        while len(got) < len(payload):
            got += await r.read(1 << 20)
    assert got == payload
    assert len(b._buf) > connection_module._RECV_BUFFER_IDLE  # it grew for the message
    started = asyncio.get_running_loop().time()

    def idle_sized() -> bool:
        return len(b._buf) == 0 and not b._rx.plaintexts.holding

    await eventually(idle_sized, "the receive buffer given back", timeout=5.0)
    assert asyncio.get_running_loop().time() - started < b.config.ping_interval / 2
    # The next message gets a buffer again.
    await s.write(b"after the quiet")
    async with asyncio.timeout(5):
        assert await r.readexactly(15) == b"after the quiet"
    a.abort("done")
    b.abort("done")


async def test_a_message_of_a_few_kb_grows_the_receive_buffer_to_its_size_not_the_largest() -> None:
    """A peer of a large swarm receives messages of a few KB (an averaging part, a DHT
    answer) on hundreds of connections at once: each grows its buffer to about the
    message, not to the 256-KB largest record. A large record still gets room whole,
    and a stream still doubles the buffer towards the streaming size."""
    a, b, _, accepted = await wired()
    s = await a.open_stream(SINK)
    r = await accepted.get() if not accepted.empty() else None
    for size in (5_000, 6_000):  # two messages, each one record
        payload = os.urandom(size)
        await s.write(payload)
        r = r or await accepted.get()
        async with asyncio.timeout(5):
            assert await r.readexactly(size) == payload
    idle = connection_module._RECV_BUFFER_IDLE
    assert idle < len(b._buf) <= 4 * idle  # grew, to about the record
    stream = os.urandom(3 * MAX_BULK_BODY)
    async with asyncio.timeout(5):
        _, got = await asyncio.gather(s.write(stream), r.readexactly(len(stream)))
    assert got == stream
    assert len(b._buf) >= MAX_BULK_BODY  # a body arrives whole
    a.abort("done")
    b.abort("done")


class ClosedUnderUs(Wire):
    """A transport whose handle closed while `is_closing()` still says no, as uvloop's can
    (MagicStack/uvloop#506): every write raises, and connection_lost never comes."""

    def __init__(self) -> None:
        super().__init__()
        self.handle_closed = False

    def writelines(self, parts: list[bytes | bytearray | memoryview]) -> None:
        if self.handle_closed:
            raise RuntimeError("unable to perform operation on <TCPTransport closed=True>")
        super().writelines(parts)

    def abort(self) -> None:
        if self.handle_closed:
            raise RuntimeError("unable to perform operation on <TCPTransport closed=True>")
        super().abort()


async def test_a_transport_closed_under_the_connection_ends_it_at_the_next_write() -> None:
    """The write's error reaches no event loop handler (a soak's peer logged it every
    second for 23 s): the connection ends, its streams fail, and it writes no more."""
    accepted: asyncio.Queue[Stream] = asyncio.Queue()
    a = Connection(Identity.generate(), initiator=True)
    b = Connection(Identity.generate(), initiator=False, on_stream=accepted.put_nowait)
    wa, wb = ClosedUnderUs(), Wire()
    wa.protocol, wa.other, wb.protocol, wb.other = a, wb, b, wa
    a.connection_made(wa)
    b.connection_made(wb)
    async with asyncio.timeout(5):
        await asyncio.gather(a.handshake_done, b.handshake_done)
    s = await a.open_stream(SINK)
    errors: list[dict[str, object]] = []
    asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: errors.append(ctx))
    wa.handle_closed = True
    await s.write(b"x" * 1000)
    async with asyncio.timeout(5):
        await a.closed
    assert "the transport closed under us" in str(a.close_reason)
    assert errors == []
    with pytest.raises(TransportError):
        await s.write(b"x")
    b.abort("done")
