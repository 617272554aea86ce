"""A host past its trim policy's high water closes the connections idle longest, down
to the low water (transport/trimming.py): a peer of a large swarm meets hundreds of
others, and without a bound it would reach `max_connections` and refuse everyone."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from waiting import eventually

from shoal.transport import trimming
from shoal.transport.connection import _IN_FLIGHT_MAX_S, Connection
from shoal.transport.errors import TransportError
from shoal.transport.host import Host, HostConfig
from shoal.transport.trimming import Trimmer, TrimPolicy

pytestmark = pytest.mark.timeout(30)
SINK = "/shoal/test-sink/1.0.0"
ECHO = "/shoal/test-echo/1.0.0"


@dataclass
class FakeConnection:
    name: str
    idle_for: float | None  # None: a stream is open
    is_open: bool = True


def test_nothing_is_closed_up_to_the_high_water() -> None:
    policy = TrimPolicy(high_water=4, low_water=2, grace=0.0)
    conns = [FakeConnection(str(i), 100.0) for i in range(4)]
    assert policy.pick(conns) == []
    # (closed ones do not count)
    assert policy.pick([*conns, FakeConnection("gone", 100.0, is_open=False)]) == []


def test_past_it_the_ones_idle_longest_go_down_to_the_low_water() -> None:
    policy = TrimPolicy(high_water=4, low_water=2, grace=10.0)
    conns = [
        FakeConnection("busy", None),  # a stream open: never
        FakeConnection("fresh", 3.0),  # idle within the grace: not yet
        FakeConnection("idle 50", 50.0),
        FakeConnection("idle 500", 500.0),
        FakeConnection("idle 20", 20.0),
        FakeConnection("idle 11", 11.0),
    ]
    picked = [c.name for c in policy.pick(conns)]
    assert picked == ["idle 500", "idle 50", "idle 20", "idle 11"]  # 6 open, down to 2
    # Fewer idle enough than asked: only those.
    assert [c.name for c in policy.pick(conns[:5])] == ["idle 500", "idle 50", "idle 20"]
    assert TrimPolicy(0, 0).pick(conns) == []  # high water 0: never


def test_a_policy_is_checked_and_a_host_defaults_to_its_connection_limit() -> None:
    with pytest.raises(ValueError):
        TrimPolicy(high_water=4, low_water=5)
    with pytest.raises(ValueError):
        TrimPolicy(high_water=4, low_water=2, grace=-1.0)
    with pytest.raises(ValueError, match="max_connections"):
        HostConfig(max_connections=8, trim=TrimPolicy(16, 8))
    assert HostConfig(max_connections=1024).trim_policy == TrimPolicy(768, 512)
    assert HostConfig(max_connections=8).trim_policy == TrimPolicy(6, 4)


def test_a_host_scans_its_connections_only_past_the_high_water_and_not_at_every_handshake() -> None:
    """A burst of rounds keeps every connection busy: past the high water, a scan that
    found nothing to close waits `recheck_s` before the next (new connections keep
    coming, each used to cost a scan of all of them)."""
    trimmer = Trimmer(TrimPolicy(high_water=4, low_water=2, grace=10.0), recheck_s=1.0)
    conns = [FakeConnection(str(i), 5.0) for i in range(6)]  # none idle for the grace
    listed = 0

    def listing() -> list[FakeConnection]:
        nonlocal listed
        listed += 1
        return conns

    assert trimmer.pick(4, listing, now=0.0) == [] and listed == 0  # a count decides
    assert trimmer.pick(6, listing, now=0.0) == [] and listed == 1  # past it: one scan
    assert trimmer.pick(6, listing, now=0.5) == [] and listed == 1  # not again so soon
    conns[0].idle_for = 30.0
    assert trimmer.pick(6, listing, now=1.0) == [conns[0]] and listed == 2  # then again
    # One that found some to close does not wait: the next new connection looks again.
    assert trimmer.pick(6, listing, now=1.1) == [conns[0]] and listed == 3
    assert Trimmer(TrimPolicy(0, 0)).pick(100, listing, now=0.0) == [] and listed == 3


def test_at_the_limit_the_connection_idle_longest_makes_room_after_a_short_grace() -> None:
    """At `max_connections` a newcomer (a group member's dial among them) used to be
    refused while connections nobody had used for seconds stayed open."""
    policy = TrimPolicy(high_water=0, low_water=0)  # (even a host that never trims)
    conns = [FakeConnection("busy", None), FakeConnection("fresh", 0.5),
             FakeConnection("idle 3", 3.0), FakeConnection("idle 9", 9.0),
             FakeConnection("closed", 99.0, is_open=False)]  # fmt: skip
    assert policy.room(conns, grace=2.0) is conns[3]
    assert policy.room(conns[:3], grace=2.0) is conns[2]
    assert policy.room(conns[:2], grace=2.0) is None
    trimmer = Trimmer(policy, recheck_s=1.0)
    listed = 0

    def listing() -> list[FakeConnection]:
        nonlocal listed
        listed += 1
        return conns[:2]

    assert trimmer.room(listing, now=0.0) is None and listed == 1
    assert trimmer.room(listing, now=0.5) is None and listed == 1  # not again so soon
    conns[1].idle_for = 30.0
    assert trimmer.room(listing, now=1.0) is conns[1] and listed == 2


async def sink(stream: Any) -> None:
    while await stream.read(1 << 20):
        pass


async def test_a_host_past_its_high_water_closes_idle_connections_and_keeps_busy_ones(
    make_host: Callable[..., Any],
) -> None:
    me = await make_host(trim=TrimPolicy(high_water=4, low_water=2, grace=0.0))
    others = [await make_host() for _ in range(6)]
    for other in others:
        other.set_handler(SINK, sink)
    # A stream held open to the first: a relay reservation, a round in progress.
    busy = await me.open_stream(others[0].addresses()[0], SINK)
    for other in others[1:4]:
        await me.connect(other.addresses()[0])
    assert len(me.connections) == 4 and me.connections_trimmed == 0  # at the high water
    await me.connect(others[4].addresses()[0])  # past it: down to 2
    await eventually(lambda: me.connections_trimmed == 3, "trimmed to the low water")
    # Those closing (still serving what crossed their GOAWAY) count no more.
    await me.connect(others[5].addresses()[0])
    await eventually(lambda: len(me.connections) == 3, "the trimmed ones closed")
    assert me.connections_trimmed == 3
    assert set(me.connections) == {p.peer_id for p in (others[0], others[4], others[5])}
    # The other ends see a graceful close, and a trimmed peer is dialed again when needed.
    await eventually(lambda: me.peer_id not in others[1].connections, "the remote end closed")
    await busy.write(b"still open")
    again = await me.open_stream(others[1].addresses()[0], SINK)
    await again.write(b"dialed again")
    await asyncio.gather(busy.close(), again.close())
    assert me.stats()["connections_trimmed"] == 3


async def echo(stream: Any) -> None:
    while data := await stream.read(1 << 20):
        await stream.write(data)


async def _a_stream_crosses_our_goaway(
    make_host: Callable[..., Any], close: Callable[[Connection], None]
) -> tuple[Host, Host, Connection]:
    """The other side opens a stream and, before either side's bytes travel (its OPEN
    queued), `close` sends our GOAWAY. The stream is served, then our end closes."""
    me, other = await make_host(), await make_host()
    me.set_handler(ECHO, echo)
    await other.connect(me.addresses()[0])
    await eventually(lambda: other.peer_id in me.connections, "we hold the connection too")
    ours = me.connections[other.peer_id]
    stream = await other.open_stream(me.peer_id, ECHO)
    close(ours)
    await stream.write(b"crossed the GOAWAY")
    assert await stream.readexactly(18) == b"crossed the GOAWAY"
    await stream.close()
    # The in-flight window is 4 smoothed RTTs, up to _IN_FLIGHT_MAX_S: on a loaded
    # machine the first keepalive's RTT can be over a second (CI: a 5 s wait failed).
    await eventually(ours.closed.done, "then it closes", timeout=_IN_FLIGHT_MAX_S + 10.0)
    return me, other, ours


async def test_a_stream_the_other_side_opens_as_we_trim_is_still_served(
    make_host: Callable[..., Any],
) -> None:
    """Our GOAWAY and its OPEN cross on the wire: it could not know, and a round whose
    stream met a closed socket would abort. Streams opened before the GOAWAY reached
    the other side are served; the next one goes over a new connection."""
    me, other, ours = await _a_stream_crosses_our_goaway(
        make_host, lambda conn: conn.close_idle("trimmed")
    )
    assert ours.close_reason == "trimmed"
    again = await other.open_stream(me.addresses()[0], ECHO)  # a new connection
    await again.write(b"next")
    assert await again.readexactly(4) == b"next"
    await again.close()


async def test_a_stream_the_other_side_opens_on_a_duplicate_as_we_retire_it_is_served(
    make_host: Callable[..., Any],
) -> None:
    """Two peers dialed each other at once, and we retire our duplicate before the
    other side's second handshake ended: it opens a stream on the duplicate as our
    GOAWAY goes out. The stream is served (it was reset, and an all-reduce round whose
    member's stream was reset aborted, in CI); then the duplicate closes."""
    await _a_stream_crosses_our_goaway(make_host, lambda conn: conn.retire(5.0))


async def test_a_host_at_its_limit_closes_an_idle_connection_for_a_newcomer_both_ways(
    make_host: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """At `max_connections`, with one connection idle and one busy: a peer that dials
    us gets in, and so does our own dial; the idle one closes gracefully. With none
    idle, the limit refuses as before."""
    monkeypatch.setattr(trimming, "AT_LIMIT_GRACE_S", 0.0)
    me = await make_host(max_connections=2, trim=TrimPolicy(0, 0))
    others = [await make_host() for _ in range(4)]
    for host in (me, *others):
        host.set_handler(SINK, sink)
    busy = await others[0].open_stream(me.addresses()[0], SINK)
    await others[1].connect(me.addresses()[0])  # idle from now on
    await eventually(lambda: len(me.connections) == 2, "at the limit")
    await others[2].connect(me.addresses()[0])  # inbound: makes room
    await eventually(lambda: others[2].peer_id in me.connections, "the newcomer is in")
    await eventually(lambda: me.peer_id not in others[1].connections, "the idle one closed")
    assert others[0].peer_id in me.connections and me.connections_trimmed == 1
    await busy.write(b"still open")
    # Our own dial too: the newcomer of a moment ago is the idle one now.
    out = await me.open_stream(others[3].addresses()[0], SINK)
    await eventually(lambda: others[2].peer_id not in me.connections, "it made room")
    assert me.connections_trimmed == 2
    # Both left busy: refused, as before.
    with pytest.raises(TransportError):
        await others[1].open_stream(me.addresses()[0], SINK)
    await asyncio.gather(busy.close(), out.close())


async def test_a_rounds_members_connections_are_protected_from_trimming_while_it_runs(
    make_host: Callable[..., Any],
) -> None:
    """A round's members' connections go quiet between its phases; closing one then
    (idle, or to make room at the limit) made the member redial mid-round. Within
    `protecting`, trimming leaves them open; after it, they may go."""
    me = await make_host(trim=TrimPolicy(high_water=1, low_water=1, grace=0.0))
    me._trimmer.recheck_s = 0.0  # (every handshake scans: the test connects in a row)
    member, *others = [await make_host() for _ in range(4)]

    def all_idle() -> bool:  # (each new connection's first stream, the hello, is done)
        return all(c.idle_for is not None for c in me.open_connections())

    with me.protecting([member.peer_id]), me.protecting([member.peer_id]):  # (nests)
        await me.connect(member.addresses()[0])
        await me.connect(others[0].addresses()[0])
        await eventually(all_idle, "both idle")
        await me.connect(others[1].addresses()[0])  # past the high water: not the member
        await eventually(lambda: others[0].peer_id not in me.connections, "the other trimmed")
        assert member.peer_id in me.connections and me.connections_trimmed == 1
    await eventually(all_idle, "all idle")
    await me.connect(others[2].addresses()[0])  # unprotected now: the member may go
    await eventually(lambda: member.peer_id not in me.connections, "the member trimmed")
    assert me._protected == {}


async def test_at_its_limit_with_nothing_idle_a_host_still_admits_and_dials_a_rounds_members(
    make_host: Callable[..., Any],
) -> None:
    """Every connection busy, so nothing makes room: a round's member dialing us gets in
    past the limit, and so does our dial to one; a stranger is refused after its
    handshake, as before."""
    me = await make_host(max_connections=2, trim=TrimPolicy(0, 0))
    busy_peers = [await make_host() for _ in range(2)]
    member_in, member_out, stranger = [await make_host() for _ in range(3)]
    for host in (me, *busy_peers, member_in, member_out, stranger):
        host.set_handler(SINK, sink)
    busy = [await p.open_stream(me.addresses()[0], SINK) for p in busy_peers]
    await eventually(lambda: me.admission.established_count == 2, "at the limit")
    with pytest.raises(TransportError):  # refused before the round: not protected
        await member_in.open_stream(me.addresses()[0], SINK)
    await eventually(lambda: me.admission.pending_at_limit == 0, "the refused one gone")
    with me.protecting([member_in.peer_id, member_out.peer_id]):
        inbound = await member_in.open_stream(me.addresses()[0], SINK)
        await inbound.write(b"in")
        outbound = await me.open_stream(member_out.addresses()[0], SINK)
        await outbound.write(b"out")
        with pytest.raises(TransportError):
            await stranger.open_stream(me.addresses()[0], SINK)
        assert me.admission.established_count == 4 and me.connections_trimmed == 0
        assert stranger.peer_id not in me.connections
    await asyncio.gather(inbound.close(), outbound.close(), *(s.close() for s in busy))


async def test_without_a_reserve_at_the_limit_a_member_is_refused_before_its_handshake(
    make_host: Callable[..., Any],
) -> None:
    """`max_pending_at_limit=0` restores the old admission: at the limit nobody's
    handshake runs, a round's member's included."""
    me = await make_host(max_connections=1, trim=TrimPolicy(0, 0), max_pending_at_limit=0)
    busy_peer, member = await make_host(), await make_host()
    for host in (me, busy_peer, member):
        host.set_handler(SINK, sink)
    busy = await busy_peer.open_stream(me.addresses()[0], SINK)
    await eventually(lambda: me.admission.established_count == 1, "at the limit")
    with me.protecting([member.peer_id]), pytest.raises(TransportError):
        await member.open_stream(me.addresses()[0], SINK)
    assert me.admission.pending_at_limit == 0 and member.peer_id not in me.connections
    await busy.close()
