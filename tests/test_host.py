"""The host: dialing, one connection per peer, streams, limits, liveness and shutdown."""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
import time

import pytest
from waiting import eventually

from shoal.transport.connection import ConnectionConfig
from shoal.transport.errors import (
    ClosedAtOnce,
    ConnectionLost,
    DialError,
    PeerBlocked,
    PeerIDMismatch,
    ProtocolNotSupported,
    StreamReset,
)
from shoal.transport.host import Host, HostConfig
from shoal.transport.identity import Identity
from shoal.transport.multiaddr import Multiaddr

ECHO = "/shoal/test-echo/1.0.0"
SINK = "/shoal/test-sink/1.0.0"


async def echo(stream) -> None:
    while data := await stream.read(1 << 20):
        await stream.write(data)


async def drain(stream) -> None:
    while await stream.read(1 << 20):
        pass


async def test_addresses_carry_the_peer_id_and_a_dial_meets_that_peer(pair) -> None:
    a, b = pair
    addr = b.addresses()[0]
    assert addr.peer_id == b.peer_id
    assert str(addr).startswith("/ip4/127.0.0.1/tcp/")
    conn = await a.connect(addr)
    assert conn.remote_peer == b.peer_id
    await eventually(lambda: a.peer_id in b.connections, "b has the connection too")
    assert b.connections[a.peer_id].remote_peer == a.peer_id


@pytest.mark.skipif(not hasattr(socket, "TCP_NOTSENT_LOWAT"), reason="no TCP_NOTSENT_LOWAT here")
async def test_the_kernel_holds_little_unsent_data_so_the_mux_orders_what_goes_out(pair) -> None:
    # The mux sends control frames first and streams in turn; what the kernel holds
    # unsent is past its reach (megabytes by default: seconds on a slow uplink).
    a, b = pair
    conn = await a.connect(b.addresses()[0])
    await eventually(lambda: a.peer_id in b.connections, "b has the connection too")
    for c in (conn, b.connections[a.peer_id]):
        sock = c._transport.get_extra_info("socket")
        lowat = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT)
        assert 0 < lowat <= 256 * 1024


async def test_a_blocked_peer_gets_no_connection_either_way(pair, make_host) -> None:
    a, b = pair
    b.set_handler(ECHO, echo)
    await a.connect(b.addresses()[0])
    await eventually(lambda: a.peer_id in b.connections, "b has the connection too")
    a.block(b.peer_id, "convicted")
    # The open connection closes at once, on both sides.
    await eventually(lambda: b.peer_id not in a.connections, "a dropped it")
    await eventually(lambda: a.peer_id not in b.connections, "b saw it close")
    assert a.blocked() == {b.peer_id: "convicted"}
    # a dials neither by peer ID nor by an address that turns out to be b's.
    with pytest.raises(PeerBlocked):
        await a.connect(b.peer_id, b.addresses())
    with pytest.raises(PeerBlocked):
        await a.connect(str(b.addresses()[0]).rsplit("/p2p/", 1)[0])
    # b's dials reach the handshake, then a closes them: no stream ever opens.
    with pytest.raises((ConnectionLost, DialError)):
        conn = await b.connect(a.addresses()[0])
        await eventually(lambda: not conn.is_open, "a closed b's connection")
        await b.open_stream(a.peer_id, ECHO)
    assert b.peer_id not in a.connections
    # Everyone else still gets through.
    c = await make_host()
    a.set_handler(ECHO, echo)
    stream = await c.open_stream(a.addresses()[0], ECHO)
    await stream.write(b"still open to others")
    assert await stream.readexactly(20) == b"still open to others"
    await stream.close()


async def test_a_stream_carries_bytes_both_ways_and_half_closes(pair) -> None:
    a, b = pair
    b.set_handler(ECHO, echo)
    s = await a.open_stream(b.addresses()[0], ECHO)
    await s.write(b"hello")
    assert await s.readexactly(5) == b"hello"
    await s.close()
    assert await s.read() == b""  # the echo handler returned and closed its side


async def test_sent_bytes_are_tallied_by_protocol_and_outlive_the_connection(pair) -> None:
    """What an uplink carries for what: each side counts the payload it sent under the
    protocol the stream was opened for, answers included, and keeps the counts when
    the connection closes."""
    a, b = pair
    b.set_handler(ECHO, echo)
    b.set_handler(SINK, drain)
    s = await a.open_stream(b.addresses()[0], ECHO)
    await s.write(b"x" * 1000)
    assert await s.readexactly(1000) == b"x" * 1000
    await s.close()
    sink = await a.open_stream(b.peer_id, SINK)
    await sink.write(b"y" * 300)
    await sink.close()
    await eventually(lambda: b.bytes_sent_by_protocol().get(ECHO) == 1000, "b echoed 1000")
    await eventually(lambda: a.bytes_sent_by_protocol().get(SINK) == 300, "a queued 300")
    tally = a.bytes_sent_by_protocol()
    # The hosts' own exchange (their hello) is tallied too, under its own name.
    assert tally.keys() >= {ECHO, SINK, "/shoal/hello/1.0.0"}
    assert (tally[ECHO], tally[SINK]) == (1000, 300)
    assert SINK not in b.bytes_sent_by_protocol()  # the sink answered nothing
    assert sum(tally.values()) < a.bytes_sent  # headers and encryption are not payload
    await a.disconnect(b.peer_id)
    await eventually(lambda: b.peer_id not in a.connections, "a closed the connection")
    assert a.bytes_sent_by_protocol() == tally


async def test_an_unknown_protocol_is_refused_cleanly(pair) -> None:
    a, b = pair
    s = await a.open_stream(b.addresses()[0], "/shoal/nothing-here/1.0.0")
    with pytest.raises(ProtocolNotSupported, match="nothing-here"):
        await s.read()
    b.set_handler(ECHO, echo)  # the connection is fine afterwards
    s2 = await a.open_stream(b.peer_id, ECHO)
    await s2.write(b"x")
    assert await s2.readexactly(1) == b"x"
    await s2.close()


async def test_dialing_an_address_whose_peer_id_differs_aborts(pair) -> None:
    a, b = pair
    impostor = Identity.generate().peer_id
    port = b.addresses()[0].tcp_endpoint()[1]
    with pytest.raises(PeerIDMismatch, match="peer ID mismatch"):
        await a.connect(Multiaddr(f"/ip4/127.0.0.1/tcp/{port}/p2p/{impostor}"))
    assert b.peer_id not in a.connections


async def test_one_gibibyte_on_one_stream_arrives_with_its_sha256(pair) -> None:
    a, b = pair
    total = 1 << 30
    block = os.urandom(16 << 20)
    got: asyncio.Future[tuple[int, bytes]] = asyncio.get_running_loop().create_future()

    async def sink(stream) -> None:
        h = hashlib.sha256()
        n = 0
        buf = bytearray(4 << 20)
        view = memoryview(buf)
        while k := await stream.readinto(view):
            h.update(view[:k])
            n += k
        got.set_result((n, h.digest()))

    b.set_handler("/shoal/sink/1.0.0", sink)
    sent = hashlib.sha256()
    s = await a.open_stream(b.addresses()[0], "/shoal/sink/1.0.0")
    for _ in range(total // len(block)):
        await s.write(block)
        sent.update(block)
    await s.close()
    n, digest = await asyncio.wait_for(got, 60)
    assert n == total
    assert digest == sent.digest()


async def test_a_thousand_concurrent_streams_share_one_connection(pair) -> None:
    a, b = pair
    b.set_handler(ECHO, echo)
    await a.connect(b.addresses()[0])

    async def one(i: int) -> bytes:
        s = await a.open_stream(b.peer_id, ECHO)
        payload = i.to_bytes(4, "big") * 100
        await s.write(payload)
        await s.close()
        data = await s.readexactly(len(payload))
        assert await s.read() == b""
        return data

    results = await asyncio.gather(*(one(i) for i in range(1000)))
    assert all(r == i.to_bytes(4, "big") * 100 for i, r in enumerate(results))
    assert len(a.connections) == 1
    assert a.connections[b.peer_id].stats()["streams"] == 0  # all finished and forgotten


async def test_small_calls_are_not_starved_by_a_bulk_transfer(pair) -> None:
    a, b = pair
    b.set_handler(ECHO, echo)

    async def sink(stream) -> None:
        buf = memoryview(bytearray(1 << 20))
        while await stream.readinto(buf):
            pass

    b.set_handler("/shoal/sink/1.0.0", sink)
    await a.connect(b.addresses()[0])
    bulk = await a.open_stream(b.peer_id, "/shoal/sink/1.0.0")
    block = os.urandom(8 << 20)
    calls_done, flowing = asyncio.Event(), asyncio.Event()

    async def transfer() -> int:
        # At least 200 MB, and still going for as long as the small calls run: were they
        # starved, they would never finish and neither would this.
        sent = 0
        while sent < 200_000_000 or not calls_done.is_set():
            await bulk.write(block)
            sent += len(block)
            flowing.set()
        await bulk.close()
        return sent

    bulk_task = asyncio.create_task(transfer())
    await flowing.wait()
    for _ in range(100):
        s = await a.open_stream(b.peer_id, ECHO)
        await s.write(b"ping")
        assert await s.readexactly(4) == b"ping"
        s.reset("done")
    calls_done.set()
    assert await bulk_task >= 200_000_000
    # (their latency meanwhile is a benchmark figure: bench/transport.py rpc_during_bulk_*)


async def test_simultaneous_dials_end_with_one_connection(pair) -> None:
    a, b = pair
    await asyncio.gather(a.connect(b.addresses()[0]), b.connect(a.addresses()[0]))
    await eventually(
        lambda: len(a._all) == 1 and len(b._all) == 1, "the duplicate connection is closed"
    )
    kept_a, kept_b = a.connections[b.peer_id], b.connections[a.peer_id]
    assert kept_a.local_address == kept_b.remote_address  # the same TCP connection
    b.set_handler(ECHO, echo)
    s = await a.open_stream(b.peer_id, ECHO)
    await s.write(b"ok")
    assert await s.readexactly(2) == b"ok"
    await s.close()


async def test_dialing_a_connected_peer_reuses_the_connection(pair) -> None:
    a, b = pair
    first = await a.connect(b.addresses()[0])
    again = await asyncio.gather(*(a.connect(b.peer_id) for _ in range(10)))
    assert all(c is first for c in again)


async def test_concurrent_dials_to_a_new_peer_make_one_connection(pair) -> None:
    a, b = pair
    addr = b.addresses()[0]
    conns = await asyncio.gather(*(a.connect(addr) for _ in range(10)))
    assert len({id(c) for c in conns}) == 1


async def test_per_ip_connection_limit_refuses_the_excess(make_host) -> None:
    server = await make_host(max_connections_per_ip=2)
    clients = [await make_host() for _ in range(3)]
    for c in clients[:2]:
        await c.connect(server.addresses()[0])
    with pytest.raises(DialError):
        await clients[2].connect(server.addresses()[0], timeout=2)
    assert len(server.connections) == 2


async def test_total_connection_limit_refuses_the_excess(make_host) -> None:
    server = await make_host(max_connections=2)
    clients = [await make_host() for _ in range(3)]
    for c in clients[:2]:
        await c.connect(server.addresses()[0])
    with pytest.raises(DialError):
        await clients[2].connect(server.addresses()[0], timeout=2)


async def test_a_dial_closed_before_the_peer_spoke_says_so_and_a_refused_one_does_not(
    make_host,
) -> None:
    """A peer that closes a connection before it opened any stream on it (at its limit
    after the handshake, or its half-open slots full) is alive: `ClosedAtOnce`, worth
    a second dial. A peer whose port refuses the dial is gone: a plain DialError."""
    server = await make_host(max_connections=2)
    clients = [await make_host() for _ in range(3)]
    for c in clients[:2]:
        await c.connect(server.addresses()[0])
    with pytest.raises(ClosedAtOnce):
        await clients[2].connect(server.addresses()[0], timeout=2)
    addr = server.addresses()[0]
    await server.aclose()
    with pytest.raises(DialError) as refused:
        await clients[2].connect(addr, timeout=2)
    assert not isinstance(refused.value, ClosedAtOnce)


async def test_ping_measures_the_round_trip(pair) -> None:
    a, b = pair
    await a.connect(b.addresses()[0])
    rtt = await a.ping(b.peer_id)
    assert 0 < rtt < 0.1


async def test_both_sides_know_the_round_trip_right_after_the_handshake(pair) -> None:
    """Deadlines on a connection follow its RTT (the DHT's requests on a far link): it is
    measured at once, not at the first keepalive ping of a quiet connection (15 s)."""
    a, b = pair
    conn = await a.connect(b.addresses()[0])
    await eventually(lambda: a.peer_id in b.connections, "b has the connection")
    back = b.connections[a.peer_id]
    await eventually(lambda: conn.rtt is not None and back.rtt is not None, "both RTTs", 2.0)
    assert 0 < conn.rtt < 0.1 and 0 < back.rtt < 0.1  # type: ignore[operator]


async def test_a_peer_that_stops_answering_is_declared_dead(make_host) -> None:
    cfg = ConnectionConfig(ping_interval=0.1, ping_timeout=0.5)
    a = await make_host(connection=cfg)
    b = await make_host()
    conn = await a.connect(b.addresses()[0])
    await eventually(lambda: a.peer_id in b.connections, "b has the connection")
    b.connections[a.peer_id]._transport.pause_reading()  # b freezes: no pongs
    await asyncio.wait_for(asyncio.shield(conn.closed), 3)
    assert "unresponsive" in conn.close_reason  # the pings' verdict, not the idle timer
    assert b.peer_id not in a.connections


async def test_keepalive_pings_go_only_over_a_quiet_connection(make_host) -> None:
    """A connection that carries traffic is known alive: its keepalive timer sends no
    ping (its RTT was measured at the handshake and is refreshed once a minute). Once
    it falls quiet for an interval, the pings resume. (Every connection used to ping
    at every tick, busy or not: most of an idle swarm's traffic.)"""
    cfg = ConnectionConfig(ping_interval=1.0, ping_timeout=10.0)  # a tick every second
    a = await make_host(connection=cfg)
    b = await make_host(connection=cfg)
    b.set_handler(ECHO, echo)
    conn = await a.connect(b.addresses()[0])
    await eventually(lambda: a.peer_id in b.connections and conn.rtt is not None, "a RTT")
    back = b.connections[a.peer_id]
    before = conn.keepalives_sent + back.keepalives_sent
    stream = await a.open_stream(b.peer_id, ECHO)
    for _ in range(50):  # 2.5 s of traffic: 2 ticks of each end's timer
        await stream.write(b"x")
        assert await stream.readexactly(1) == b"x"
        await asyncio.sleep(0.05)
    assert conn.keepalives_sent + back.keepalives_sent == before
    await eventually(
        lambda: conn.keepalives_sent + back.keepalives_sent > before, "a keepalive once quiet", 5
    )
    await stream.close()


async def test_a_connection_with_no_open_stream_is_pinged_after_four_quiet_intervals(
    make_host,
) -> None:
    """Nobody waits on a connection with no open stream: its keepalive comes after 4
    quiet intervals, not 1 (it still keeps a NAT's mapping and finds a dead peer
    before the idle close)."""
    cfg = ConnectionConfig(ping_interval=0.25, ping_timeout=10.0)
    a = await make_host(connection=cfg)
    b = await make_host(connection=cfg)
    conn = await a.connect(b.addresses()[0])
    await eventually(lambda: a.peer_id in b.connections, "b has the connection")
    back = b.connections[a.peer_id]
    await eventually(lambda: conn.rtt is not None and back.rtt is not None, "both RTTs")
    heard_last = max(conn.last_activity, back.last_activity)
    await eventually(lambda: conn.keepalives_sent + back.keepalives_sent > 0, "a keepalive", 5)
    assert time.monotonic() - heard_last >= 4 * cfg.ping_interval


async def test_a_stream_on_an_idle_connection_brings_its_keepalives_back_at_once(
    make_host,
) -> None:
    """An idle connection's timer sleeps till its idle ping (4 intervals, 8 s here);
    a stream opened on it wakes the timer, so a peer that freezes under the stream is
    declared dead within an interval and the ping timeout (3 s), not after the sleep."""
    cfg = ConnectionConfig(ping_interval=2.0, ping_timeout=1.0, idle_timeout=0)
    a = await make_host(connection=cfg)
    b = await make_host()
    b.set_handler(SINK, drain)
    conn = await a.connect(b.addresses()[0])
    await eventually(lambda: a.peer_id in b.connections and conn.rtt is not None, "a RTT")
    await asyncio.sleep(cfg.ping_interval * 1.5)  # (past the first tick: the timer sleeps)
    b.connections[a.peer_id]._transport.pause_reading()  # b freezes
    stream = await a.open_stream(b.peer_id, SINK)
    await stream.write(b"x")
    await asyncio.wait_for(asyncio.shield(conn.closed), 6)
    assert "unresponsive" in conn.close_reason


async def test_idle_connections_are_closed(make_host) -> None:
    cfg = ConnectionConfig(ping_interval=0.05, idle_timeout=0.3)
    a = await make_host(connection=cfg)
    b = await make_host()
    conn = await a.connect(b.addresses()[0])
    await asyncio.wait_for(asyncio.shield(conn.closed), 3)
    assert conn.close_reason == "idle"


async def test_a_protected_peers_idle_connection_stays_open_until_the_protection_ends(
    make_host,
) -> None:
    """A round's members open their next stream at any moment: the idle close leaves
    a protected peer's connection open, as trimming does, and closes it once nothing
    protects it any more."""
    cfg = ConnectionConfig(ping_interval=0.05, idle_timeout=0.3)
    a = await make_host(connection=cfg)
    b = await make_host()
    conn = await a.connect(b.addresses()[0])
    with a.protecting([b.peer_id]):
        await eventually(lambda: (conn.idle_for or 0) > 3 * cfg.idle_timeout, "idle long")
        assert not conn.closed.done() and conn.close_reason is None
    await asyncio.wait_for(asyncio.shield(conn.closed), 3)
    assert conn.close_reason == "idle"


async def test_shutdown_drains_open_streams_then_closes(pair) -> None:
    a, b = pair

    reading, finish = asyncio.Event(), asyncio.Event()

    async def slow(stream) -> None:
        data = await stream.readexactly(3)
        reading.set()
        await finish.wait()
        await stream.write(data)

    b.set_handler("/shoal/slow/1.0.0", slow)
    s = await a.open_stream(b.addresses()[0], "/shoal/slow/1.0.0")
    await s.write(b"abc")
    await reading.wait()  # the stream is open and being served
    closing = asyncio.create_task(b.aclose())
    await eventually(lambda: b._closing, "b's shutdown has begun")
    with pytest.raises((ConnectionLost, DialError, ProtocolNotSupported, StreamReset)):
        s2 = await a.open_stream(b.peer_id, "/shoal/slow/1.0.0")
        await s2.write(b"xyz")
        await s2.readexactly(3)
    finish.set()
    assert await s.readexactly(3) == b"abc"  # the open stream finished
    await asyncio.wait_for(closing, 5)
    assert not b.connections


async def test_a_remote_reset_fails_the_local_reader(pair) -> None:
    a, b = pair

    async def rude(stream) -> None:
        await stream.readexactly(1)
        stream.reset("go away")

    b.set_handler("/shoal/rude/1.0.0", rude)
    s = await a.open_stream(b.addresses()[0], "/shoal/rude/1.0.0")
    await s.write(b"x")
    with pytest.raises(StreamReset, match="go away"):
        await s.read()


async def test_closing_the_connection_fails_every_stream(pair) -> None:
    a, b = pair
    hold, held = asyncio.Event(), asyncio.Event()

    async def holder(stream) -> None:
        held.set()
        await hold.wait()

    b.set_handler("/shoal/hold/1.0.0", holder)
    s = await a.open_stream(b.addresses()[0], "/shoal/hold/1.0.0")
    await s.write(b"x")
    await held.wait()  # b serves the stream
    b.connections[a.peer_id].abort("test")
    with pytest.raises(ConnectionLost):
        await asyncio.wait_for(s.read(), 3)


async def test_host_context_manager_starts_and_stops() -> None:
    async with Host(Identity.generate(), HostConfig(listen=("/ip4/127.0.0.1/tcp/0",))) as h:
        assert h.listen_addrs[0].tcp_endpoint()[1] > 0
    assert all(s.sockets == () or not s.is_serving() for s in h._servers)


def test_by_default_a_host_listens_on_port_31337_on_ipv4_and_ipv6() -> None:
    assert HostConfig().listen == ("/ip4/0.0.0.0/tcp/31337", "/ip6/::/tcp/31337")
