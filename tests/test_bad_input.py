"""Hostile input: a bad peer loses its own connection, with one log line; nobody else notices."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import struct
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shoal.transport.connection import Connection, ConnectionConfig
from shoal.transport.errors import DialError, StreamReset
from shoal.transport.identity import Identity
from shoal.transport.mux import HEADER, OPEN, MuxLimits

ECHO = "/shoal/test-echo/1.0.0"


async def echo(stream) -> None:
    while data := await stream.read():
        await stream.write(data)


@pytest.fixture
async def guarded(make_host):
    """A server with a short handshake timeout, and a healthy client already connected."""
    server = await make_host(connection=ConnectionConfig(handshake_timeout=0.5))
    server.set_handler(ECHO, echo)
    friend = await make_host()
    await friend.connect(server.addresses()[0])
    return server, friend


async def assert_still_serving(server, friend) -> None:
    s = await friend.open_stream(server.peer_id, ECHO)
    await s.write(b"alive")
    assert await s.readexactly(5) == b"alive"
    await s.close()


async def raw_connect(server) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = server.addresses()[0].tcp_endpoint()
    return await asyncio.open_connection(host, port)


async def closed_within(reader: asyncio.StreamReader, seconds: float) -> float:
    """Seconds until the server closed the connection (reads everything until EOF)."""
    t0 = time.monotonic()
    async with asyncio.timeout(seconds):
        try:
            while await reader.read(65536):
                pass
        except ConnectionResetError:
            pass
    return time.monotonic() - t0


def log_lines(caplog, needle: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if needle in r.getMessage()]


async def test_garbage_instead_of_a_handshake_costs_only_that_connection(guarded, caplog) -> None:
    server, friend = guarded
    caplog.set_level(logging.INFO, logger="shoal.transport")
    reader, writer = await raw_connect(server)
    writer.write(os.urandom(4096))
    await closed_within(reader, 2)
    writer.close()
    lines = log_lines(caplog, "closing connection")
    assert len(lines) == 1 and "127.0.0.1:" in lines[0]  # names the peer, and why
    await assert_still_serving(server, friend)


async def test_a_stalled_handshake_is_cut_at_the_handshake_timeout(guarded, caplog) -> None:
    server, friend = guarded
    caplog.set_level(logging.INFO, logger="shoal.transport")
    reader, writer = await raw_connect(server)
    assert await closed_within(reader, 3) < 1.5  # handshake_timeout is 0.5 s
    writer.close()
    assert len(log_lines(caplog, "handshake not finished")) == 1
    await assert_still_serving(server, friend)


async def test_a_truncated_handshake_message_is_cut_at_the_handshake_timeout(guarded) -> None:
    server, friend = guarded
    reader, writer = await raw_connect(server)
    writer.write(struct.pack(">H", 32) + os.urandom(10))  # promises 32 bytes, sends 10
    assert await closed_within(reader, 3) < 1.5
    writer.close()
    await assert_still_serving(server, friend)


async def test_a_length_prefix_beyond_the_handshake_limit_is_refused_at_once(guarded) -> None:
    server, friend = guarded
    reader, writer = await raw_connect(server)
    writer.write(b"\xff\xff")  # a 64 KiB first message: nothing is buffered for it
    assert await closed_within(reader, 3) < 0.4
    writer.close()
    await assert_still_serving(server, friend)


class ForgingIdentity(Identity):
    """Claims its key but signs the Noise static key with garbage."""

    def sign(self, data: bytes) -> bytes:
        return os.urandom(64)


async def test_a_bad_signature_in_the_handshake_is_refused(guarded, make_host, caplog) -> None:
    server, friend = guarded
    caplog.set_level(logging.INFO, logger="shoal.transport")
    forger = await make_host()
    forger.identity = ForgingIdentity(Identity.generate().private_key)
    # In Noise XX the initiator finishes first, so the forger may think it is
    # connected for a moment; the server refuses message 3 and closes at once.
    try:
        conn = await forger.connect(server.addresses()[0], timeout=2)
    except DialError:
        pass
    else:
        await asyncio.wait_for(asyncio.shield(conn.closed), 2)
    await asyncio.sleep(0.05)
    assert forger.identity.peer_id not in server.connections
    assert any("signature" in line for line in log_lines(caplog, "closing connection"))
    await assert_still_serving(server, friend)


async def test_records_that_fail_authentication_close_the_connection(guarded, make_host, caplog):
    server, friend = guarded
    caplog.set_level(logging.INFO, logger="shoal.transport")
    bad = await make_host()
    conn = await bad.connect(server.addresses()[0])
    conn._transport.write(struct.pack(">H", 100) + os.urandom(100))  # not from our cipher
    await asyncio.wait_for(asyncio.shield(conn.closed), 2)
    await asyncio.sleep(0.05)
    assert any("authentication" in line for line in log_lines(caplog, "closing connection"))
    await assert_still_serving(server, friend)


async def test_authentic_records_with_malformed_frames_close_the_connection(guarded, make_host):
    server, friend = guarded
    bad = await make_host()
    conn = await bad.connect(server.addresses()[0])
    garbage = bytearray(2 + 7 + 16)
    garbage[2:9] = b"\x09" * 7  # a truncated frame header, properly encrypted
    struct.pack_into(">H", garbage, 0, 7 + 16)
    conn._send_cipher.seal_in_place(memoryview(garbage)[2:], 7)
    conn._transport.write(garbage)
    await asyncio.wait_for(asyncio.shield(conn.closed), 2)
    await assert_still_serving(server, friend)


async def test_streams_beyond_the_limit_are_reset_not_fatal(make_host) -> None:
    server = await make_host(connection=ConnectionConfig(mux=MuxLimits(max_streams=10)))
    hold = asyncio.Event()

    async def holder(stream) -> None:
        await hold.wait()

    server.set_handler("/shoal/hold/1.0.0", holder)
    client = await make_host()
    await client.connect(server.addresses()[0])
    streams = [await client.open_stream(server.peer_id, "/shoal/hold/1.0.0") for _ in range(15)]
    for s in streams:
        await s.write(b"x")
    refused = 0
    for s in streams[10:]:
        with pytest.raises(StreamReset, match="too many streams"):
            await asyncio.wait_for(s.read(), 2)
        refused += 1
    assert refused == 5
    hold.set()


async def test_connections_from_one_ip_beyond_its_limit_close_before_the_handshake(make_host):
    server = await make_host(max_connections_per_ip=3)
    host, port = server.addresses()[0].tcp_endpoint()
    socks = []
    for _ in range(3):
        s = socket.create_connection((host, port))
        socks.append(s)
    extra = socket.create_connection((host, port))
    extra.settimeout(2)
    await asyncio.sleep(0.1)
    assert await asyncio.to_thread(extra.recv, 10) == b""  # closed at once
    for s in [*socks, extra]:
        s.close()


# --- the record decoder and multiplexer behind a live Connection, fed random bytes ---------


class FakeTransport:
    """Just enough of an asyncio transport to drive a Connection without sockets."""

    def __init__(self) -> None:
        self.out = bytearray()
        self.closed = False
        self.protocol: Connection | None = None

    def get_extra_info(self, name: str, default: object = None) -> object:
        return {"peername": ("127.0.0.1", 9), "sockname": ("127.0.0.1", 10)}.get(name, default)

    def set_write_buffer_limits(self, high: int, low: int) -> None:
        pass

    def write(self, data: bytes) -> None:
        self.out += data

    def writelines(self, parts: list[bytes]) -> None:
        for p in parts:
            self.out += p

    def abort(self) -> None:
        if not self.closed:
            self.closed = True
            assert self.protocol is not None
            self.protocol.connection_lost(None)

    close = abort

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        pass


def feed(conn: Connection, data: bytes) -> None:
    while data and not conn.closed.done():
        buf = conn.get_buffer(len(data))
        n = min(len(buf), len(data))
        buf[:n] = data[:n]
        conn.buffer_updated(n)
        data = data[n:]


async def connected_pair() -> tuple[Connection, FakeTransport, Connection, FakeTransport]:
    a = Connection(Identity.generate(), initiator=True)
    b = Connection(Identity.generate(), initiator=False, on_stream=lambda s: None)
    ta, tb = FakeTransport(), FakeTransport()
    ta.protocol, tb.protocol = a, b
    a.connection_made(ta)
    b.connection_made(tb)
    for _ in range(4):  # shuttle handshake bytes both ways
        out_a, ta.out = bytes(ta.out), bytearray()
        feed(b, out_a)
        out_b, tb.out = bytes(tb.out), bytearray()
        feed(a, out_b)
    assert a.handshake_done.done() and b.handshake_done.done()
    return a, ta, b, tb


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chunks=st.lists(st.binary(min_size=1, max_size=3000), min_size=1, max_size=8))
async def test_random_bytes_after_the_handshake_only_ever_close_the_connection(chunks) -> None:
    a, _, b, _ = await connected_pair()
    for chunk in chunks:
        feed(b, chunk)  # never raises: a violation closes the connection
    if b.closed.done():
        assert b.close_reason
    for conn in (a, b):
        conn.abort("test over")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(frames=st.lists(st.binary(min_size=0, max_size=200), min_size=1, max_size=6))
async def test_random_authentic_plaintext_only_ever_closes_the_connection(frames) -> None:
    a, _, b, _ = await connected_pair()
    # A well-formed OPEN first, so random frames can also hit a live stream.
    plaintexts = [HEADER.pack(OPEN, 0, 1, 5) + b"/x/1.", *frames]
    for pt in plaintexts:
        record = bytearray(2 + len(pt) + 16)
        struct.pack_into(">H", record, 0, len(pt) + 16)
        record[2 : 2 + len(pt)] = pt
        a._send_cipher.seal_in_place(memoryview(record)[2:], len(pt))
        feed(b, bytes(record))
        if b.closed.done():
            break
    for conn in (a, b):
        conn.abort("test over")
