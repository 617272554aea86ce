"""Circuit relay and hole punching on loopback: reservations, relayed connections that are
ordinary secure connections (the relay sees ciphertext), relay limits with clear errors,
and the switch from a relayed connection to a hole-punched one."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from waiting import eventually

from shoal.transport import rpc
from shoal.transport.connection import Connection
from shoal.transport.errors import (
    ConnectionLost,
    DialError,
    RelayConnectRefused,
    RelayLimitExceeded,
    ReservationRefused,
    StreamReset,
)
from shoal.transport.host import Host, HostConfig
from shoal.transport.identity import Identity
from shoal.transport.multiaddr import Multiaddr
from shoal.transport.nat import NatConfig, NatManager, Reachability, RelayLimits, holepunch
from shoal.transport.nat.wire import messages, recv_map

LOOPBACK = ("/ip4/127.0.0.1/tcp/0",)
SINK = "/shoal/test-sink/1.0.0"
ECHO = "/shoal/test-echo/1.0.0"


async def sink(stream) -> None:
    """Reads everything, then answers with the byte count and the SHA-256."""
    h = hashlib.sha256()
    n = 0
    buf = memoryview(bytearray(1 << 20))
    while k := await stream.readinto(buf):
        h.update(buf[:k])
        n += k
    await stream.write(n.to_bytes(8, "big") + h.digest())


async def echo(stream) -> None:
    while data := await stream.read(1 << 20):
        await stream.write(data)


@pytest.fixture
async def make_peer() -> AsyncIterator[Callable[..., Any]]:
    """Factory of started (host, NatManager) pairs on 127.0.0.1, closed at teardown."""
    made: list[tuple[Host, NatManager]] = []

    async def make(limits: RelayLimits | None = None, **cfg: Any) -> tuple[Host, NatManager]:
        cfg.setdefault("observed_threshold", 1)
        cfg.setdefault("relay_retry", 0.2)  # the relay may not know it is public yet
        host = Host(Identity.generate(), HostConfig(listen=LOOPBACK, reuse_port=True))
        await host.start()
        host.set_handler(SINK, sink)
        host.set_handler(ECHO, echo)
        nat = NatManager(host, config=NatConfig(relay_limits=limits or RelayLimits(), **cfg))
        await nat.start()
        made.append((host, nat))
        return host, nat

    yield make
    for host, nat in reversed(made):
        await nat.aclose()
        await host.aclose()


def dial_addr(host: Host) -> Multiaddr:
    return host.listen_addrs[0].with_peer_id(host.peer_id)


async def relay_and_private(
    make_peer: Callable[..., Any],
    limits: RelayLimits | None = None,
    punch: bool = False,
    **a_config: Any,
) -> tuple[Host, NatManager, Host, NatManager, Multiaddr]:
    """A public relay r and a private peer a holding a reservation on it; a's relay address
    (`a_config`: more of a's NatConfig)."""
    r, nr = await make_peer(limits=limits, hole_punching=punch)
    a, na = await make_peer(reachability="private", hole_punching=punch, **a_config)
    await a.connect(dial_addr(r))
    assert await nr.wait_for(lambda: nr.reachability is Reachability.PUBLIC, 5)
    assert await na.wait_for(lambda: bool(na.relay_addresses()), 5), na.status()
    (addr,) = na.relay_addresses()
    return r, nr, a, na, addr


async def send_through(host: Host, peer: Any, payload_blocks: list[bytes]) -> bytes:
    stream = await host.open_stream(peer, SINK)
    for block in payload_blocks:
        await stream.write(block)
    await stream.close()
    return await stream.readexactly(8 + 32)


async def test_a_private_peer_is_reachable_at_its_relay_address(make_peer) -> None:
    r, nr, a, na, addr = await relay_and_private(make_peer)
    c, _ = await make_peer(hole_punching=False)
    # The address it advertises is /ip4/R/tcp/P/p2p/RELAY/p2p-circuit/p2p/SELF, only that.
    assert str(addr) == f"{dial_addr(r)}/p2p-circuit/p2p/{a.peer_id}"
    assert a.addresses() == [addr]
    assert na.status()["reservations"][0]["relay"] == str(r.peer_id)
    conn = await c.connect(addr)
    assert conn.kind == "relayed" and conn.relay == r.peer_id
    assert conn.remote_peer == a.peer_id  # authenticated end to end by the handshake
    await eventually(lambda: a.connection(c.peer_id) is not None, "a has the connection too")
    back = a.connection(c.peer_id)
    assert back is not None and back.kind == "relayed" and back.relay == r.peer_id
    s = await c.open_stream(a.peer_id, ECHO)
    await s.write(b"through the relay")
    assert await s.readexactly(17) == b"through the relay"
    await s.close()
    # Visibility: the relay sees one circuit, both ends see a relayed connection.
    (circuit,) = nr.status()["relay_service"]["circuits"]
    assert circuit["src"] == str(c.peer_id) and circuit["dst"] == str(a.peer_id)
    assert circuit["bytes"] > 0
    kinds = {e["peer"]: e["kind"] for e in na.status()["connections"]}
    assert kinds[str(c.peer_id)] == "relayed"


async def test_a_private_peer_is_reachable_at_its_relay_address_as_records_store_it(
    make_peer,
) -> None:
    # The DHT's routing table and state announcements keep a peer's addresses without
    # their trailing /p2p/SELF (dht.routing.dialable_addrs): a dial to that peer at such
    # a circuit address goes to it through the relay (it failed: "a circuit address
    # needs /p2p/RELAY/p2p-circuit/p2p/TARGET", the soak's holders behind NATs).
    r, _, a, _, addr = await relay_and_private(make_peer)
    c, _ = await make_peer(hole_punching=False)
    stored = addr.without_peer_id()
    assert str(stored) == f"{dial_addr(r)}/p2p-circuit"
    conn = await c.connect(a.peer_id, [stored])
    assert conn.kind == "relayed" and conn.remote_peer == a.peer_id


async def test_the_relay_of_a_peer_gone_says_so_when_dialing_it_through_itself(
    make_peer,
) -> None:
    # Its circuit address names us as its relay: were it still our client it would be
    # connected to us, so the dial fails at once, saying so (it said "refusing to dial
    # ourselves", which read like a bug in the soak).
    r, _, a, _, addr = await relay_and_private(make_peer)
    await a.aclose()
    await eventually(lambda: r.connection(a.peer_id) is None, "the relay saw it go")
    with pytest.raises(DialError, match="not connected to us, the relay it names"):
        await r.connect(a.peer_id, [addr], timeout=5)


async def test_the_relay_splices_only_ciphertext(make_peer) -> None:
    _, nr, a, _, addr = await relay_and_private(make_peer)
    c, _ = await make_peer(hole_punching=False)
    seen = bytearray()
    nr.relay.tap = lambda circuit, data: seen.extend(data)
    marker = b"PLAINTEXT-MARKER-" * 4096
    await c.connect(addr)
    n, _ = (await send_through(c, a.peer_id, [marker]))[:8], None
    assert int.from_bytes(n, "big") == len(marker)
    assert len(seen) > len(marker)  # it all went through the relay...
    assert b"PLAINTEXT-MARKER" not in seen  # ...encrypted end to end


async def test_fifty_megabytes_and_rpcs_go_through_the_relay(make_peer) -> None:
    _, _, a, _, addr = await relay_and_private(make_peer)
    c, _ = await make_peer(hole_punching=False)
    svc = rpc.RpcService(a, "/shoal/test-rpc/1.0.0")

    @svc.unary("double")
    async def double(ctx, x):
        return 2 * x

    await c.connect(addr)
    assert [
        await rpc.call(c, a.peer_id, "/shoal/test-rpc/1.0.0", "double", i) for i in range(20)
    ] == [2 * i for i in range(20)]
    block = os.urandom(5_000_000)
    answer = await asyncio.wait_for(send_through(c, a.peer_id, [block] * 10), 60)
    assert int.from_bytes(answer[:8], "big") == 50_000_000
    assert answer[8:] == hashlib.sha256(block * 10).digest()
    assert c.connection(a.peer_id).kind == "relayed"


async def test_the_relay_refuses_reservations_beyond_its_limit(make_peer) -> None:
    r, nr, _, _, _ = await relay_and_private(make_peer, RelayLimits(max_reservations=1))
    # max_relays=0: b's manager reserves nothing itself. Its own attempt, in flight when
    # we ask, would make keep() return at once (one attempt per relay at a time).
    b, nb = await make_peer(reachability="private", hole_punching=False, max_relays=0)
    await b.connect(dial_addr(r))
    with pytest.raises(ReservationRefused, match=r"reservation limit \(1\) reached"):
        await nb.relay_client.keep(r.peer_id, [dial_addr(r)])
    # The refusal shows in the manager's status.
    assert await nb.wait_for(lambda: bool(nb.status()["reservation_errors"]), 5)
    assert "reservation limit (1) reached" in nb.status()["reservation_errors"][str(r.peer_id)]
    assert nr.status()["relay_service"]["refused"]["reservation limit"] >= 1
    assert len(nr.status()["relay_service"]["reservations"]) == 1


async def test_a_reservation_outlives_its_ttl_by_refreshing(make_peer) -> None:
    _, nr, a, na, _ = await relay_and_private(make_peer, RelayLimits(reservation_ttl=1.0))
    await asyncio.sleep(2.5)
    assert [x["peer"] for x in nr.status()["relay_service"]["reservations"]] == [str(a.peer_id)]
    assert na.relay_addresses()


async def test_a_relayed_connection_over_its_byte_limit_is_cut_with_a_clear_error(
    make_peer,
) -> None:
    _, nr, a, _, addr = await relay_and_private(make_peer, RelayLimits(circuit_bytes=1_000_000))
    c, _ = await make_peer(hole_punching=False)
    conn = await c.connect(addr)
    await eventually(lambda: a.connection(c.peer_id) is not None, "a has the relayed connection")
    far = a.connection(c.peer_id)
    assert far is not None
    with pytest.raises(RelayLimitExceeded, match="more than 1000000 bytes relayed"):
        await send_through(c, a.peer_id, [os.urandom(1 << 20)] * 4)
    await asyncio.wait_for(asyncio.shield(far.closed), 5)
    for cn in (conn, far):
        assert isinstance(cn._lost_error, RelayLimitExceeded)
    (done,) = nr.status()["relay_service"]["finished"]
    assert done["ended"].startswith("relay limit exceeded")


async def test_a_relayed_connection_over_its_time_limit_is_cut_with_a_clear_error(
    make_peer,
) -> None:
    _, _, a, _, addr = await relay_and_private(make_peer, RelayLimits(circuit_duration=1.0))
    c, _ = await make_peer(hole_punching=False)
    await c.connect(addr)
    s = await c.open_stream(a.peer_id, ECHO)
    await s.write(b"x")
    assert await s.readexactly(1) == b"x"
    with pytest.raises(RelayLimitExceeded, match=r"duration 1s reached"):
        await asyncio.wait_for(s.read(), 5)  # idle, until the relay cuts the circuit
    assert c.connection(a.peer_id) is None


async def test_a_peer_without_a_reservation_cannot_be_reached_through_the_relay(
    make_peer,
) -> None:
    r, nr = await make_peer()
    c, _ = await make_peer()
    stranger = Identity.generate().peer_id
    await c.connect(dial_addr(r))
    assert await nr.wait_for(lambda: nr.reachability is Reachability.PUBLIC, 5)
    with pytest.raises(RelayConnectRefused, match="has no reservation on this relay"):
        await c.connect(Multiaddr(f"{dial_addr(r)}/p2p-circuit/p2p/{stranger}"))


async def test_when_the_relay_goes_away_relayed_connections_fail(make_peer) -> None:
    r, nr, a, _, addr = await relay_and_private(make_peer)
    c, _ = await make_peer(hole_punching=False)
    conn = await c.connect(addr)
    s = await c.open_stream(a.peer_id, ECHO)
    await nr.aclose()
    await r.aclose()
    with pytest.raises((ConnectionLost, StreamReset)):
        await asyncio.wait_for(s.read(), 5)
    await asyncio.wait_for(asyncio.shield(conn.closed), 5)


async def test_a_relayed_connection_is_replaced_by_a_hole_punched_one(make_peer) -> None:
    _, nr, a, na, addr = await relay_and_private(make_peer, punch=True)
    c, nc = await make_peer()
    relayed = await c.connect(addr)
    assert relayed.kind == "relayed"

    def punched(host: Host, peer: Any) -> bool:
        conn = host.connection(peer)
        return conn is not None and conn.kind == "hole-punched"

    assert await nc.wait_for(lambda: punched(c, a.peer_id), 10)
    assert await na.wait_for(lambda: punched(a, c.peer_id), 10)
    # The relayed connection closes gracefully and the relay's circuit ends...
    await asyncio.wait_for(asyncio.shield(relayed.closed), 10)
    assert await nr.wait_for(lambda: not nr.relay.book.circuits, 5)
    (done,) = nr.status()["relay_service"]["finished"]
    assert done["ended"] == "finished"
    # ...so the relay's byte count stays put while the peers talk.
    relayed_bytes = done["bytes"]
    answer = await send_through(c, a.peer_id, [os.urandom(1 << 20)] * 2)
    assert int.from_bytes(answer[:8], "big") == 2 << 20
    assert nr.status()["relay_service"]["finished"][0]["bytes"] == relayed_bytes
    direct = c.connection(a.peer_id)
    assert direct.bytes_sent > 2 << 20
    results = na.status()["hole_punching"]["results"]
    assert results and results[-1]["success"] and results[-1]["attempts"] == 1


async def test_punched_roles_agree_when_a_listener_accepts_the_connection(make_peer) -> None:
    # The agreed Noise initiator (a) gets the connection from its listener: it must
    # still play initiator, or both ends would wait for the other's first message.
    (a, _), (b, _) = await make_peer(), await make_peer()
    remove = a.expect_inbound("127.0.0.1", b.peer_id, initiator=True)
    try:
        conn = await b.dial_from_listen_port(
            a.listen_addrs[0].tcp_endpoint(), a.peer_id, initiator=False, timeout=5
        )
    finally:
        remove()
    assert conn.kind == "hole-punched" and not conn.initiator and conn.outbound
    await eventually(lambda: a.connection(b.peer_id) is not None, "a has the punched connection")
    far: Connection | None = a.connection(b.peer_id)
    assert far is not None and far.kind == "hole-punched" and far.initiator and not far.outbound
    s = await b.open_stream(a.peer_id, ECHO)
    await s.write(b"ok")
    assert await s.readexactly(2) == b"ok"
    await s.close()


async def test_private_peers_find_relays_through_the_dht(make_peer) -> None:
    from shoal.dht.node import DHTNode
    from shoal.dht.relay_directory import DHTRelayDirectory

    # p bootstraps the DHT but is no relay; r is a relay that a meets only through the DHT.
    p, np_ = await make_peer(relay_service=False)
    r, nr = await make_peer()
    nodes = [await DHTNode.create(p)]
    try:
        np_.directory = DHTRelayDirectory(nodes[0])
        nodes.append(await DHTNode.create(r, bootstrap=[dial_addr(p)]))
        nr.directory = DHTRelayDirectory(nodes[1])
        assert await nr.wait_for(lambda: nr.reachability is Reachability.PUBLIC, 5)
        listed = DHTRelayDirectory(nodes[1])
        for _ in range(50):  # r's advertisement is in the DHT (asked, not polled for free)
            if r.peer_id in await listed.find():
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError("the relay never listed itself in the DHT")
        a, na = await make_peer(reachability="private", hole_punching=False)
        nodes.append(await DHTNode.create(a, bootstrap=[dial_addr(p)]))
        na.directory = DHTRelayDirectory(nodes[2])
        assert await na.wait_for(lambda: bool(na.relay_addresses()), 10), na.status()
        (res,) = na.status()["reservations"]
        assert res["relay"] == str(r.peer_id)
    finally:
        for node in nodes:
            await node.aclose()


async def test_shutting_down_mid_transfer_leaves_no_task_behind() -> None:
    made = []
    for cfg in ({}, {"reachability": "private"}, {}):
        host = Host(Identity.generate(), HostConfig(listen=LOOPBACK, reuse_port=True))
        await host.start()
        host.set_handler(SINK, sink)
        nat = NatManager(host, config=NatConfig(relay_retry=0.2, **cfg))
        await nat.start()
        made.append((host, nat))
    (r, _), (a, na), (c, _) = made
    await a.connect(dial_addr(r))
    assert await na.wait_for(lambda: bool(na.relay_addresses()), 5)
    await c.connect(na.relay_addresses()[0])
    transfer = asyncio.create_task(send_through(c, a.peer_id, [os.urandom(1 << 20)] * 500))
    await eventually(lambda: c.bytes_sent > 4 << 20, "the transfer is under way")
    for host, nat in made:
        await nat.aclose()
        await host.aclose()
    with pytest.raises((ConnectionLost, StreamReset)):
        await transfer
    me = asyncio.current_task()
    await eventually(lambda: asyncio.all_tasks() == {me}, "no task of the hosts is left")


async def test_an_initiator_silent_before_its_sync_ends_the_punch_quietly(
    make_peer, caplog: pytest.LogCaptureFixture
) -> None:
    """The initiator sends its connect, then nothing (SIGSTOPped, or gone): the responder
    gives up on the exchange at its timeout without an ERROR traceback (the soak saw one)."""
    caplog.set_level(logging.INFO)
    *_, addr = await relay_and_private(make_peer, punch=True, punch_stream_timeout=0.5)
    c, _ = await make_peer(hole_punching=False)
    relayed = await c.connect(addr)
    assert relayed.kind == "relayed"
    stream = await relayed.open_stream(holepunch.PROTOCOL)
    ms = messages(stream)
    await ms.send({"type": "connect", "addrs": [str(c.listen_addrs[0])]})
    reply = await recv_map(ms, "dcutr connect")
    assert reply["type"] == "connect"
    # Silent from now on: the responder's wait for our sync runs out.
    async with asyncio.timeout(15):
        with contextlib.suppress(StreamReset):
            while await stream.read():
                pass
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
