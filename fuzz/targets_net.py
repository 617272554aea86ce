"""Fuzz targets for what a listener reads off the network beyond the framing layers:
the secure handshake, the NAT protocols, RPC requests and chunk headers, the
all-reduce and state-sync requests, matchmaking's join protocol, and the
status server's HTTP requests (the registry is `targets.TARGETS`)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import torch
from aiohttp import web
from aiohttp.base_protocol import BaseProtocol
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.http_parser import HttpRequestParserPy
from aiohttp.test_utils import make_mocked_request
from harness import REMOTE_IDENTITY, BytesStream, Target, expect, message, run_in_loop, run_now

from shoal.averaging import provenance_sync, state_sync
from shoal.averaging.certificate import Certificate, CertificateError, Statement
from shoal.averaging.group import Group
from shoal.averaging.lanes import RoundInfo, request_problem
from shoal.averaging.matchmaking_rules import Declaration, JoinReply, JoinRequest, check_group
from shoal.averaging.partition import Plan
from shoal.averaging.provenance import ChainError, Provenance
from shoal.peer.finding.mdns import MAX_ADDRS as MDNS_MAX_ADDRS
from shoal.peer.finding.mdns import parse_announcement
from shoal.peer.status.metrics import Metrics
from shoal.peer.status.server import StatusServer
from shoal.transport import dnsaddr, rpc
from shoal.transport.access import AccessControl
from shoal.transport.errors import HandshakeError, RemoteError, TransportError
from shoal.transport.identity import Identity
from shoal.transport.multiaddr import Multiaddr
from shoal.transport.nat import autonat, holepunch, relay, relay_client
from shoal.transport.nat.identify import IdentifyInfo
from shoal.transport.noise import NoiseHandshakeXX
from shoal.transport.remote_log import RemoteEvents
from shoal.transport.secure import SecureHandshake

__all__ = ["NET_TARGETS"]

_ME = Identity.from_seed(b"\x01" * 32)
_PEER = REMOTE_IDENTITY.peer_id
_SWARM_KEY = bytes(range(32))
_ALLOW = AccessControl(_SWARM_KEY, [_PEER])


# ---------------------------------------------------------------- secure channel


def _frame(message: bytes) -> bytes:
    return len(message).to_bytes(2, "big") + message


def secure_handshake(data: bytes) -> None:
    """The authenticated handshake as a listener (and a dialer) runs it: raw wire
    bytes, or a well-formed Noise message carrying the fuzzed identity payload;
    modes 4-7 the same in a private swarm (a swarm key, an allow list)."""
    mode, body = (data[0] % 8, data[1:]) if data else (0, b"")
    private, mode = mode >= 4, mode % 4
    psk = _SWARM_KEY if private else None
    authorize = _ALLOW.authorize if private else None

    def ours(initiator: bool) -> SecureHandshake:
        return SecureHandshake(_ME, initiator=initiator, psk=psk, authorize=authorize)

    if mode in (0, 1):  # raw bytes off the wire, in pieces as TCP may cut them
        hs = ours(mode == 1)
        hs.start()
        for i in range(0, len(body), 97):
            hs.receive(body[i : i + 97])
        return
    # The payload inside valid Noise encryption: what only a peer that completed
    # the Noise part can make us decode (the identity map, its key and signature).
    listener = ours(mode == 3)
    first = listener.start()
    if mode == 2:  # we listen; the dialer's message 3 carries the payload
        dialer = NoiseHandshakeXX(True, psk=psk)
        second = listener.receive(_frame(dialer.write_message()))
        dialer.read_message(second[2:])
        listener.receive(_frame(dialer.write_message(body)))
    else:  # we dial; the listener's message 2 carries the payload
        responder = NoiseHandshakeXX(False, psk=psk)
        responder.read_message(first[2:])
        listener.receive(_frame(responder.write_message(body)))
    assert listener.complete and listener.remote_peer is not None
    assert not private or listener.remote_peer == _PEER  # the allow list held


# ---------------------------------------------------------------- NAT protocols

_OUR_PUBLIC = [Multiaddr("/ip4/198.51.100.11/tcp/4001")]  # a DCUtR peer behind our NAT
_NAT_ERRORS = (TransportError,)  # ProtocolViolation, and ReservationRefused for a refusal


def nat_protocols(data: bytes) -> None:
    """Every NAT protocol message as its handler parses it: identify, AutoNAT request,
    dial-back and reply, relay hop/refresh/stop and replies, DCUtR connect and sync."""
    obj = message(data)
    msg: dict[str, Any] = obj if isinstance(obj, dict) else {"type": obj}
    for parse in (
        lambda: IdentifyInfo.from_wire(msg, 1.0),
        lambda: autonat.parse_request(msg),
        lambda: autonat.parse_dialback(msg),
        lambda: autonat.parse_probe_reply(msg),
        lambda: relay.parse_hop_kind(msg),
        lambda: relay.parse_hop_connect(msg),
        lambda: relay.parse_refresh(msg),
        lambda: relay_client.parse_reply_status(msg, _PEER),
        lambda: relay_client.parse_reservation_ttl(msg),
        lambda: relay_client.parse_relay_addrs(msg),
        lambda: relay_client.parse_stop(msg),
        lambda: holepunch.parse_connect(msg),
        lambda: holepunch.parse_connect(msg, _OUR_PUBLIC),
        lambda: holepunch.parse_sync(msg),
    ):
        expect(_NAT_ERRORS, parse)


# ---------------------------------------------------------------- RPC

_RPC_LIMITS = rpc.RpcLimits(max_message=1 << 16, max_tensor=1 << 16, max_timeout=5.0)


class _Host:
    """What an RpcService needs of its host: a handler table, and where refusals of
    remote peers are logged (rate-limited)."""

    remote_events = RemoteEvents(logging.getLogger("shoal.fuzz"))

    def set_handler(self, protocol: str, handler: Any) -> None:
        self.handler = handler

    def remove_handler(self, protocol: str) -> None:
        pass


def _rpc_service() -> rpc.RpcService:
    service = rpc.RpcService(_Host(), "/fuzz/rpc/1.0.0", _RPC_LIMITS)  # type: ignore[arg-type]

    @service.unary("echo")
    async def echo(ctx: rpc.CallContext, payload: Any) -> Any:
        return payload

    @service.stream("upload")
    async def upload(ctx: rpc.CallContext, payload: Any) -> Any:
        # A streaming handler reading what the caller sends after its request.
        while not ctx.stream.at_eof():
            yield await ctx.recv_tensor() if payload else await ctx.recv()

    return service


_SERVICE: list[rpc.RpcService] = []


def rpc_request(data: bytes) -> None:
    """An RPC request as the service reads it: the [method, timeout, payload] envelope,
    then whatever a streaming handler reads after it."""
    if not _SERVICE:
        _SERVICE.append(_rpc_service())
    run_in_loop(_SERVICE[0]._serve(BytesStream(data)))  # type: ignore[arg-type]


def chunk_headers(data: bytes) -> None:
    """A chunk where one is due (all-reduce lanes, state sync, pipeline tensors): its
    frame and `index:u32 nbytes:u32` header, or the remote error sent instead."""
    index, size = (data[0], data[1] * 3) if len(data) >= 2 else (0, 0)
    stream = rpc.MessageStream(BytesStream(data[2:]), _RPC_LIMITS)  # type: ignore[arg-type]
    into = bytearray(size)
    while not stream.stream.at_eof():
        assert run_now(stream.recv_chunk_into(index, memoryview(into))) == rpc.CHUNK.size + size
        index += 1


# ---------------------------------------------------------------- averaging

_MEMBERS = [Identity.from_seed(bytes([i + 1]) * 32).peer_id for i in range(3)]
_PLAN = Plan.build(1000, [1.0, 2.0, 1.0], streams=2, chunk_elements=64)
_ROUND = RoundInfo(b"r" * 32, 0, _MEMBERS, [p.short() for p in _MEMBERS], _PLAN,
                   _PLAN.digest(b"r" * 32, [p.to_bytes() for p in _MEMBERS], 0, b""),
                   1.0, 4, "/fuzz/allreduce")  # fmt: skip


def allreduce_request(data: bytes) -> None:
    """A member's request to stream into one lane of our part of an all-reduce round."""
    obj = message(data)
    header = obj if isinstance(obj, dict) else {"l": obj}
    header.setdefault("p", _ROUND.digest)  # past the plan check unless the input sets "p"
    for second in (False, True):
        problem = request_problem(_ROUND, header, {0, 1}, second)
        assert problem is None or isinstance(problem, str)


class _StateDHT:
    """What a StateServer needs of its DHT node when it only serves: a host."""

    host = _Host()
    peer_id = _ME.peer_id


_STATE = state_sync.make_state([torch.arange(40.0), torch.ones(3, 5)], {"step": 3})
_STATE_SERVER = state_sync.StateServer(_StateDHT(), "fuzz", lambda: _STATE)  # type: ignore[arg-type]


def state_sync_requests(data: bytes) -> None:
    """State sync: a holder's layout (what a downloader allocates, with and without the
    layout it holds) and a fetch request (what a holder serves)."""
    obj = message(data)
    expect((state_sync.LayoutError,), lambda: state_sync._allocate(obj))
    ours = expect((state_sync.LayoutError,), lambda: state_sync._allocate(obj, _STATE.tensors))
    assert ours is None or [t.shape for t in ours] == [t.shape for t in _STATE.tensors]
    payload = obj if isinstance(obj, dict) else {"offset": obj}
    payload.setdefault("fp", _STATE.fingerprint)
    ctx = rpc.CallContext(BytesStream(b""), "fetch", None, _RPC_LIMITS)  # type: ignore[arg-type]

    async def serve() -> None:
        async for _ in _STATE_SERVER._on_fetch(ctx, payload):
            pass

    expect((ValueError, LookupError), lambda: run_now(serve()))


def _certified_book() -> tuple[Provenance, provenance_sync.ProvenanceService, bytes]:
    book = Provenance("fuzz")
    statement = Statement.of_round("fuzz", b"", b"r" * 32, "f" * 64, [_PEER])
    book.add(Certificate(statement, {_PEER: REMOTE_IDENTITY.sign(statement.signed_bytes())}))

    class _Service:
        protocol = "/fuzz/state"

        def unary(self, name: str) -> Any:
            return lambda fn: fn

    return book, provenance_sync.ProvenanceService(_Service(), book), statement.version  # type: ignore[arg-type]


_BOOK, _PROVENANCE, _CERTIFIED = _certified_book()


def commit_certificates(data: bytes) -> None:
    """Commit certificates: one certificate, a page of a chain (and the chain it makes
    against what we hold), a `chain` request and a `signature` push (what a holder
    and a round member serve)."""
    obj = message(data)
    expect((CertificateError,), lambda: Certificate.from_wire(obj))
    page = expect((ChainError,), lambda: provenance_sync._page(obj))
    if page:
        expect((ChainError,), lambda: _BOOK.check_chain(page[0].version, page))
    ctx = rpc.CallContext(BytesStream(b""), "chain", None, _RPC_LIMITS)  # type: ignore[arg-type]
    payload = obj if isinstance(obj, dict) else {"version": _CERTIFIED, "known": obj}
    for serve in (_PROVENANCE._on_chain, _PROVENANCE._on_signature):
        expect((ValueError, LookupError), lambda serve=serve: run_now(serve(ctx, payload)))


def matchmaking_join(data: bytes) -> None:
    """Matchmaking's join protocol: a join request (leader side), a reply and the group
    it announces (follower side), then a follower's checks of that group; a neighbour's
    answer to hello (a cut-off peer's view)."""
    obj = message(data)
    expect((ValueError,), lambda: JoinRequest.from_wire(obj))
    expect((ValueError,), lambda: Declaration.from_hello(_PEER, obj))
    expect((ValueError,), lambda: Group.from_wire(obj))
    reply = expect((ValueError,), lambda: JoinReply.from_wire(obj))
    if reply is not None:
        expect((ValueError,), lambda: check_group(reply, key="k", version=b"v" * 8,
                                                  me=_MEMBERS[1], leader=_MEMBERS[0]))  # fmt: skip


# ---------------------------------------------------------------- status server


class _Provider:
    """A peer's status, as a daemon serves it (fixed: the HTTP side is fuzzed)."""

    def status(self) -> dict[str, Any]:
        return {"peer_id": str(_ME.peer_id), "step": 3, "loss": 2.5, "connections": []}

    async def peers(self) -> list[dict[str, Any]]:
        return [{"peer_id": str(_PEER), "step": 3, "loss": float("nan"), "addresses": []}]

    def history(self) -> list[dict[str, Any]]:
        return [{"t": 1.0, "step": 1, "loss": 3.0}]

    def swarm(self) -> dict[str, Any]:
        return {"peers": {}, "self": str(_ME.peer_id)}


_APP: list[web.Application] = []


async def _http_requests(data: bytes) -> None:
    if not _APP:  # the daemon's own app (router, handlers, middleware), started once
        provider = _Provider()
        server = StatusServer(provider, Metrics(provider), "127.0.0.1", 0)  # type: ignore[arg-type]
        await server.start()
        assert server._runner is not None
        _APP.append(server._runner.app)
    app, loop = _APP[0], asyncio.get_running_loop()
    parser = HttpRequestParserPy(BaseProtocol(loop), loop, 1 << 16, max_line_size=8190,
                                 max_field_size=8190)  # fmt: skip
    messages, _upgraded, _tail = parser.feed_data(data)
    for raw, _payload in messages:
        try:
            request = make_mocked_request(raw.method, raw.path, headers=raw.headers, app=app)
        except (UnicodeError, ValueError):
            # The mocked request re-encodes what the parser decoded (headers, an
            # absolute URL's host); the server builds its request from the parsed form.
            continue
        response = await app._handle(request)
        # The middleware turns a handler's exception into a 500: here, that is a bug.
        assert response.status != 500, (raw.method, raw.path, response.status)


def status_http(data: bytes) -> None:
    """Raw HTTP request bytes to a peer's status server: aiohttp's request parser, then
    each request through the server's app (router, handlers, error middleware)."""
    run_in_loop(_http_requests(data))


# ---------------------------------------------------------------- finding peers


def discovery_records(data: bytes) -> None:
    """What a peer looking for a first peer reads: /dnsaddr/ TXT values (mode 0: every
    name's answer is the same values, so nested names recurse as far as the limits let
    them) and mDNS TXT properties (mode 1: KEY=VALUE lines); a /dnsaddr/ name as text."""
    mode, body = (data[0] % 2, data[1:]) if data else (0, b"")
    lines = body.split(b"\n")
    if mode == 0:
        walk = dnsaddr.DnsaddrWalk(dnsaddr.DnsaddrName("fuzz.example"))
        while (query := walk.next_query()) is not None:
            walk.answer(query[0], query[1], lines)
        assert len(walk.result.addrs) <= dnsaddr.MAX_ADDRS
        assert walk.lookups <= dnsaddr.MAX_LOOKUPS
        try:
            name = dnsaddr.DnsaddrName.parse(body.decode("utf-8", "replace"))
        except dnsaddr.DnsaddrError:
            return
        assert dnsaddr.DnsaddrName.parse(str(name)) == name
        return
    properties = {key: value for key, _, value in (line.partition(b"=") for line in lines)}
    peer, _ = parse_announcement(properties, "fuzz")
    if peer is not None:
        assert 0 < len(peer.addrs) <= MDNS_MAX_ADDRS
        assert all(a.peer_id == peer.peer_id for a in peer.addrs)


NET_TARGETS = (
    Target("secure_handshake", secure_handshake, (HandshakeError,), secure_handshake.__doc__),
    Target("nat_protocols", nat_protocols, (), nat_protocols.__doc__),
    Target("rpc_request", rpc_request, (TransportError, EOFError), rpc_request.__doc__),
    Target("chunk_headers", chunk_headers, (TransportError, RemoteError), chunk_headers.__doc__),
    Target("allreduce_request", allreduce_request, (), allreduce_request.__doc__),
    Target("state_sync_requests", state_sync_requests, (), state_sync_requests.__doc__),
    Target("matchmaking_join", matchmaking_join, (), matchmaking_join.__doc__),
    Target("commit_certificates", commit_certificates, (), commit_certificates.__doc__),
    Target("status_http", status_http, (HttpProcessingError,), status_http.__doc__),
    Target("discovery_records", discovery_records, (), discovery_records.__doc__),
)
