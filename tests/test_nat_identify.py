"""Identify, observed addresses, AutoNAT and the NatManager's view, on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest

from shoal.transport.errors import StreamReset
from shoal.transport.host import Host, HostConfig
from shoal.transport.identity import Identity
from shoal.transport.multiaddr import Multiaddr
from shoal.transport.nat import (
    NatConfig,
    NatManager,
    Reachability,
    autonat,
    holepunch,
    identify,
    relay,
)
from shoal.transport.nat.wire import messages, recv_map

LOOPBACK = ("/ip4/127.0.0.1/tcp/0",)


@pytest.fixture
async def make_peer() -> AsyncIterator[Callable[..., Any]]:
    """Factory of started (host, NatManager) pairs on 127.0.0.1, closed at teardown."""
    made: list[tuple[Host, NatManager]] = []

    async def make(**cfg: Any) -> tuple[Host, NatManager]:
        cfg.setdefault("observed_threshold", 1)
        host = Host(Identity.generate(), HostConfig(listen=LOOPBACK, reuse_port=True))
        await host.start()
        nat = NatManager(host, config=NatConfig(**cfg))
        await nat.start()
        made.append((host, nat))
        return host, nat

    yield make
    for host, nat in reversed(made):
        await nat.aclose()
        await host.aclose()


def listen_addr(host: Host) -> Multiaddr:
    return host.listen_addrs[0]


async def identified(nat: NatManager, host: Host, peer: Host) -> identify.IdentifyInfo:
    conn = host.connection(peer.peer_id)
    assert conn is not None
    info = await nat.identify.wait(conn, timeout=5)
    assert info is not None
    return info


async def test_identify_exchanges_addresses_protocols_agent_and_the_observed_address(
    make_peer,
) -> None:
    (a, na), (b, nb) = await make_peer(agent="shoal/test-a"), await make_peer()
    await a.connect(listen_addr(b).with_peer_id(b.peer_id))
    info_b = await identified(na, a, b)  # what a learned about b
    info_a = await identified(nb, b, a)
    assert info_a.agent == "shoal/test-a"
    assert listen_addr(b).with_peer_id(b.peer_id) in info_b.listen
    for proto in (identify.PROTOCOL, autonat.PROTOCOL, relay.HOP_PROTOCOL, holepunch.PROTOCOL):
        assert proto in info_b.protocols
    # a dialed from its listen port, so b sees a at a's listen address, and vice versa.
    assert info_b.observed == listen_addr(a)
    assert info_a.observed == listen_addr(b)


async def test_an_observed_address_is_trusted_only_after_enough_peers_report_it(
    make_peer,
) -> None:
    x, nx = await make_peer(observed_threshold=2, reachability="private")
    (p1, _), (p2, _) = await make_peer(), await make_peer()
    await x.connect(listen_addr(p1).with_peer_id(p1.peer_id))
    await identified(nx, x, p1)
    assert nx.observed_addresses() == []
    assert nx.status()["observed_addresses"] == [
        {"addr": str(listen_addr(x)), "observers": 1, "trusted": False}
    ]
    await x.connect(listen_addr(p2).with_peer_id(p2.peer_id))
    await identified(nx, x, p2)
    assert nx.observed_addresses() == [listen_addr(x)]


async def test_peers_that_can_be_dialed_back_find_themselves_public(make_peer, caplog) -> None:
    caplog.set_level(logging.INFO, logger="shoal.transport.version")
    (a, na), (b, nb) = await make_peer(), await make_peer()
    await a.connect(listen_addr(b).with_peer_id(b.peer_id))
    for nat, host in ((na, a), (nb, b)):
        assert await nat.wait_for(lambda n=nat: n.reachability is Reachability.PUBLIC, 5)
        mine = listen_addr(host).with_peer_id(host.peer_id)
        assert nat.confirmed_addresses() == [mine]
        # Only confirmed addresses are advertised, and the host (so the DHT) uses them.
        assert host.addresses() == [mine]
        assert nat.status()["reachability"] == "public"
        # A dial-back (a throwaway identity, no hello) is not software from before versions.
        assert host.versions.status()["peers_without_version"] == 0
    assert "before protocol versions" not in caplog.text


async def test_dial_backs_go_only_to_the_requesters_observed_ip(make_peer) -> None:
    # a is declared public: its own probes (b refuses those too) would race our count.
    (a, _), (b, nb) = await make_peer(reachability="public"), await make_peer()
    conn = await a.connect(listen_addr(b).with_peer_id(b.peer_id))
    stream = await conn.open_stream(autonat.PROTOCOL)
    ms = messages(stream)
    # A third party's address (another IP): b must not dial it for us.
    await ms.send({"nonce": b"n" * 16, "addrs": ["/ip4/127.0.0.2/tcp/80", "/dns/x.example/tcp/1"]})
    await stream.close()
    reply = await recv_map(ms, "reply")
    assert reply == {"status": "refused", "error": "no address at your observed IP 127.0.0.1"}
    assert nb.autonat.served["refused"] == 1


async def test_a_request_that_runs_out_of_time_is_counted_not_logged_as_an_error(
    make_peer, caplog: pytest.LogCaptureFixture
) -> None:
    """A client that never asks (or a server paused past `probe_timeout`): the server's
    handler ends quietly and counts it (the soak logged it as a handler failure)."""
    (a, _), (b, nb) = await make_peer(reachability="public"), await make_peer(probe_timeout=0.3)
    caplog.set_level(logging.DEBUG, logger="shoal.transport")
    conn = await a.connect(listen_addr(b).with_peer_id(b.peer_id))
    stream = await conn.open_stream(autonat.PROTOCOL)
    with pytest.raises(StreamReset):
        await recv_map(messages(stream), "reply")  # the server gives up first
    assert nb.autonat.served["timeout"] == 1
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


async def test_a_dial_back_that_reaches_another_peer_counts_as_a_failure(make_peer) -> None:
    (a, na), (c, _) = await make_peer(), await make_peer()
    (b, _) = await make_peer(autonat_server_min_interval=0)  # a's own probes may run too
    conn = await a.connect(listen_addr(b).with_peer_id(b.peer_id))
    # c listens at a's IP: the dial-back meets c, not a, so the handshake fails.
    result = await na.autonat.probe(conn, [listen_addr(c)])
    assert result is not None and not result.ok
    assert result.server == b.peer_id


@contextlib.contextmanager
def listener_dropping_syns() -> Iterator[Multiaddr]:
    """A loopback listener whose accept queue is full: the kernel drops further SYNs,
    as a NAT router does with unsolicited ones (no reset, no answer)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)  # one queued connection fills it
        with socket.create_connection(listener.getsockname(), timeout=5):
            yield Multiaddr(f"/ip4/127.0.0.1/tcp/{listener.getsockname()[1]}")


async def test_an_unanswered_syn_fails_the_dial_back_at_the_connect_deadline(make_peer) -> None:
    """Behind a NAT nobody answers the dial-back's SYN: the server says "timeout" once
    the connect's short deadline passes, not the whole dial-back's (a peer behind a NAT
    looks for relays that much sooner: bench/nat.py's time_to_direct_s)."""
    (a, na) = await make_peer(reachability="private")
    (b, _) = await make_peer(dialback_connect_timeout=0.3, dialback_timeout=60.0)
    conn = await a.connect(listen_addr(b).with_peer_id(b.peer_id))
    with listener_dropping_syns() as dropped:
        async with asyncio.timeout(20):  # the 60 s whole-dial-back deadline would not fit
            result = await na.autonat.probe(conn, [dropped])
    assert result is not None and not result.ok
    assert result.kind == "timeout"  # weak evidence: weighs 1/2 (reachability.py)


async def _forward_after(delay: float, target: Multiaddr) -> asyncio.Server:
    """A loopback TCP forwarder that accepts at once (as a busy peer's kernel does) but
    passes nothing on for `delay` seconds (its process is busy importing torch)."""
    host, port = target.tcp_endpoint()

    async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            while data := await r.read(65536):
                w.write(data)
                await w.drain()
        except ConnectionError:
            pass
        finally:
            w.close()

    async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await asyncio.sleep(delay)
        tr, tw = await asyncio.open_connection(host, port)
        await asyncio.gather(pipe(r, tw), pipe(tr, w))

    return await asyncio.start_server(serve, "127.0.0.1", 0)


async def test_a_peer_slow_to_answer_its_handshake_is_still_dialed_back(make_peer) -> None:
    """The short deadline is the connect's alone: a peer whose kernel accepts at once but
    whose process answers the handshake late keeps the whole dial-back's deadline (a
    busy peer is not taken for one behind a NAT)."""
    (a, na) = await make_peer(reachability="private")
    (b, _) = await make_peer(dialback_connect_timeout=0.3, dialback_timeout=10.0)
    forwarder = await _forward_after(1.0, listen_addr(a))
    try:
        conn = await a.connect(listen_addr(b).with_peer_id(b.peer_id))
        slow = Multiaddr(f"/ip4/127.0.0.1/tcp/{forwarder.sockets[0].getsockname()[1]}")
        result = await na.autonat.probe(conn, [slow])
    finally:
        forwarder.close()
    assert result is not None and result.ok and result.addr == slow


async def test_a_server_claiming_a_dial_back_that_never_came_is_not_believed(make_peer) -> None:
    (a, na) = await make_peer(reachability="private")
    liar = Host(Identity.generate(), HostConfig(listen=LOOPBACK))
    await liar.start()
    try:

        async def lie(stream) -> None:
            await recv_map(messages(stream), "req")
            await messages(stream).send({"status": "ok", "addr": str(listen_addr(a))})

        liar.set_handler(autonat.PROTOCOL, lie)
        conn = await a.connect(listen_addr(liar).with_peer_id(liar.peer_id))
        assert await na.autonat.probe(conn, [listen_addr(a)]) is None
    finally:
        await liar.aclose()


async def test_status_shows_each_connection_with_its_kind_and_byte_counters(make_peer) -> None:
    (a, na), (b, _) = await make_peer(), await make_peer()
    await a.connect(listen_addr(b).with_peer_id(b.peer_id))
    await identified(na, a, b)
    status = na.status()
    (entry,) = [c for c in status["connections"] if c["peer"] == str(b.peer_id)]
    assert entry["kind"] == "direct" and entry["relay"] is None
    assert entry["bytes_sent"] > 0 and entry["bytes_received"] > 0
    assert entry["remote_address"] == f"127.0.0.1:{listen_addr(b).tcp_endpoint()[1]}"
    for key in ("reachability", "confirmed_addresses", "reservations", "relay_service"):
        assert key in status


async def test_closing_the_manager_gives_the_host_back(make_peer) -> None:
    (a, na) = await make_peer()
    assert identify.PROTOCOL in a.protocols
    await na.aclose()
    assert a.protocols == []
    assert a.addresses() == a.interface_addresses()
    assert not na._tasks


async def test_garbage_on_nat_protocols_costs_only_the_stream(make_peer) -> None:
    (a, _), (b, _) = await make_peer(), await make_peer()
    conn = await a.connect(listen_addr(b).with_peer_id(b.peer_id))
    big = b"\xff\xff\xff\xff\x00"  # a frame header announcing 4 GiB
    for proto, payload in [
        (autonat.PROTOCOL, big),
        (autonat.PROTOCOL, b"\x00\x00\x00\x03\x00\x93\x01\x02"),  # a list, not a map
        (relay.HOP_PROTOCOL, b"\x00\x00\x00\x01\x00\xc0"),  # nil
        (relay.STOP_PROTOCOL, b"\x00\x00\x00\x05\x00garbage"),
        (autonat.DIALBACK_PROTOCOL, b"\x00\x00\x00\x01\x00\x90"),
    ]:
        s = await conn.open_stream(proto)
        await s.write(payload)
        await s.close()
        # never an answer (a 4 GiB frame is refused unread as PayloadTooLarge, a
        # ProtocolViolation: the reset names the narrower class)
        with pytest.raises(StreamReset, match=r"ProtocolViolation|PayloadTooLarge"):
            while await s.read():
                pass
    # Hole punching over a direct connection: nothing to do, the stream just ends.
    s = await conn.open_stream(holepunch.PROTOCOL)
    await s.write(big)
    assert await s.read() == b""
    assert conn.is_open and b.connection(a.peer_id) is not None
    info = await identified_again(a, b)
    assert info.agent


async def identified_again(a: Host, b: Host) -> identify.IdentifyInfo:
    """Run identify by hand on the existing connection: it still works."""
    stream = await a.connection(b.peer_id).open_stream(identify.PROTOCOL)
    await stream.close()
    return identify.IdentifyInfo.from_wire(await recv_map(messages(stream), "identify"))
