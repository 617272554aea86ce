"""Private swarms (transport/access.py): a peer without the swarm key, with another key,
or not in the allow list cannot connect, dial or be dialed, over every kind of
connection (direct, relayed, hole-punched), and is counted; the key and list files."""

from __future__ import annotations

import os
import stat
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from waiting import eventually

from shoal.peer.config import ConfigError, build_config
from shoal.peer.diagnosis import Facts, diagnose
from shoal.peer.status.metrics import Metrics
from shoal.transport.access import (
    AccessControl,
    AccessFileError,
    format_swarm_key,
    parse_allow_list,
    parse_swarm_key,
    read_allow_list,
    read_swarm_key,
    swarm_key_fingerprint,
    write_new_swarm_key,
)
from shoal.transport.errors import (
    HandshakeError,
    PeerNotAllowed,
    SwarmKeyMismatch,
    TransportError,
)
from shoal.transport.host import Host, HostConfig
from shoal.transport.identity import Identity, PeerID
from shoal.transport.multiaddr import Multiaddr
from shoal.transport.nat import NatConfig, NatManager, Reachability
from shoal.transport.secure import SecureHandshake

LOOPBACK = ("/ip4/127.0.0.1/tcp/0",)
K1, K2 = bytes(range(32)), bytes(range(1, 33))
ECHO = "/shoal/test-echo/1.0.0"


# -- the swarm key file --------------------------------------------------------------------------


def test_a_libp2p_swarm_key_file_is_read_in_every_encoding_go_libp2p_reads() -> None:
    assert parse_swarm_key(format_swarm_key(K1).encode()) == K1
    assert (
        parse_swarm_key(f"/key/swarm/psk/1.0.0/\r\n/base16/\r\n{K1.hex().upper()}".encode()) == K1
    )
    b64 = "/key/swarm/psk/1.0.0/\n/base64/\nAAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=\n"
    assert parse_swarm_key(b64.encode()) == K1
    assert parse_swarm_key(b"/key/swarm/psk/1.0.0/\n/bin/\n" + K1) == K1


@pytest.mark.parametrize(
    ("text", "why"),
    [
        (b"", "first line"),
        (b"/key/swarm/psk/2.0.0/\n/base16/\n" + K1.hex().encode(), "first line"),
        (b"/key/swarm/psk/1.0.0/\n/base32/\n" + K1.hex().encode(), "second line"),
        (b"/key/swarm/psk/1.0.0/\n/base16/\n" + b"zz" * 32, "not base16"),
        (b"/key/swarm/psk/1.0.0/\n/base16/\n" + K1.hex()[:-2].encode(), "32 bytes"),
        (b"/key/swarm/psk/1.0.0/\n/base16/\n", "32 bytes"),
        (b"/key/swarm/psk/1.0.0/\n/base64/\n!!!", "not base64"),
        (b"\xff\xfe\x00garbage", "first line"),
    ],
)
def test_a_malformed_swarm_key_is_refused_saying_what_is_wrong(text: bytes, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_swarm_key(text)


def test_a_new_swarm_key_file_is_private_random_and_never_overwritten(tmp_path: Path) -> None:
    path = tmp_path / "swarm.key"
    key = write_new_swarm_key(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert read_swarm_key(path) == key and key not in (K1, K2)
    with pytest.raises(AccessFileError, match="exists"):
        write_new_swarm_key(path)
    assert read_swarm_key(path) == key
    assert write_new_swarm_key(tmp_path / "other.key") != key


def test_the_fingerprint_names_the_key_without_revealing_it() -> None:
    fp = swarm_key_fingerprint(K1)
    assert len(fp) == 16 and fp != swarm_key_fingerprint(K2)
    assert K1.hex()[:16] not in fp
    status = AccessControl(K1).status()
    assert status["swarm_key_fingerprint"] == fp
    assert K1.hex() not in repr(status)


def test_an_unreadable_or_invalid_key_file_stops_the_start_in_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.key"
    bad.write_text("/key/swarm/psk/1.0.0/\n/base16/\n1234\n")
    for path in (bad, tmp_path / "missing.key"):
        with pytest.raises(ConfigError) as e:
            build_config(["swarm_key"], {"swarm_key": str(path)}, {})
        assert "\n" not in str(e.value) and "--swarm-key" in str(e.value)
    good = tmp_path / "good.key"
    good.write_text(format_swarm_key(K1))
    config = build_config(["swarm_key"], {}, {"SHOAL_SWARM_KEY": str(good)})
    assert config.access_control().swarm_key == K1
    assert config.access_control().mode == "swarm-key"


# -- the allow list file -------------------------------------------------------------------------


def test_the_allow_list_takes_one_peer_id_a_line_with_comments() -> None:
    a, b = Identity.generate().peer_id, Identity.generate().peer_id
    text = f"# lab machines\n{a}\n\n  {b}   # the GPU box\n"
    assert parse_allow_list(text) == {a, b}


def test_a_bad_allow_list_line_is_refused_by_its_number(tmp_path: Path) -> None:
    a = Identity.generate().peer_id
    with pytest.raises(ValueError, match="line 2: 'not-a-peer-id'"):
        parse_allow_list(f"{a}\nnot-a-peer-id\n")
    empty = tmp_path / "empty"
    empty.write_text("# nobody yet\n")
    with pytest.raises(AccessFileError, match="refuse everyone"):
        read_allow_list(empty)
    with pytest.raises(ConfigError, match="--allow-peers"):
        build_config(["allow_peers"], {"allow_peers": str(empty)}, {})


# -- the handshake, sans-IO ----------------------------------------------------------------------


def _run_handshake(
    i: SecureHandshake, r: SecureHandshake
) -> tuple[Exception | None, Exception | None]:
    """Drive both sides; (initiator error, responder error). Stops at the first error,
    as a connection does."""
    to_r = i.start()
    r.start()
    for _ in range(3):
        try:
            to_i = r.receive(to_r) if to_r else b""
        except HandshakeError as e:
            return None, e
        if r.complete and not to_i:
            break
        try:
            to_r = i.receive(to_i) if to_i else b""
        except HandshakeError as e:
            return e, None
    return None, None


def _sides(
    i_key: bytes | None, r_key: bytes | None, **kw: Any
) -> tuple[SecureHandshake, SecureHandshake]:
    i = SecureHandshake(Identity.generate(), True, psk=i_key, authorize=kw.get("i_auth"))
    r = SecureHandshake(Identity.generate(), False, psk=r_key, authorize=kw.get("r_auth"))
    return i, r


def test_peers_with_the_same_swarm_key_complete_the_handshake() -> None:
    i, r = _sides(K1, K1)
    assert _run_handshake(i, r) == (None, None)
    assert i.complete and r.complete and i.handshake_hash == r.handshake_hash
    assert i.remote_peer == r.identity.peer_id and r.remote_peer == i.identity.peer_id


@pytest.mark.parametrize(("i_key", "r_key"), [(None, K1), (K2, K1)])
def test_a_responder_with_a_key_refuses_a_dialer_without_it_before_saying_anything(
    i_key: bytes | None, r_key: bytes
) -> None:
    i, r = _sides(i_key, r_key)
    first = i.start()
    r.start()
    with pytest.raises(SwarmKeyMismatch, match="swarm key mismatch"):
        r.receive(first)  # the responder's answer would have been message 2: none goes out
    assert not r.complete and r.remote_peer is None and i.remote_peer is None


@pytest.mark.parametrize(("i_key", "r_key"), [(K1, None), (K1, K2)])
def test_a_dialer_with_a_key_is_refused_by_a_responder_without_it(
    i_key: bytes, r_key: bytes | None
) -> None:
    i, r = _sides(i_key, r_key)
    i_error, r_error = _run_handshake(i, r)
    assert i_error is None and isinstance(r_error, HandshakeError)
    # Nothing went back: the dialer is left waiting for message 2, and learned nothing.
    assert i.unanswered and i.remote_peer is None
    if r_key is None:
        assert "uses a swarm key" in str(r_error)


def test_the_allow_list_refuses_an_unlisted_dialer_before_the_handshake_completes() -> None:
    listed = Identity.generate().peer_id
    i, r = _sides(None, None, r_auth=AccessControl(None, [listed]).authorize)
    _, r_error = _run_handshake(i, r)
    assert isinstance(r_error, PeerNotAllowed) and not r.complete and r.remote_peer is None


def test_the_allow_list_refuses_an_unlisted_responder_before_message_3() -> None:
    i, r = _sides(None, None, i_auth=AccessControl(None, [Identity.generate().peer_id]).authorize)
    i_error, _ = _run_handshake(i, r)
    assert isinstance(i_error, PeerNotAllowed) and not i.complete
    assert not r.complete  # it never got message 3


def test_an_open_host_runs_the_plain_handshake() -> None:
    # No key, no list: the same Noise protocol as before private swarms, nothing asked.
    access = AccessControl()
    assert access.mode == "open" and access.swarm_key is None and access.authorize is None
    i = SecureHandshake(Identity.generate(), True, psk=access.swarm_key)
    assert i._noise.protocol_name == "Noise_XX_25519_AESGCM_SHA256"
    assert len(i.start()) == 2 + 32


# -- hosts on loopback ---------------------------------------------------------------------------


@pytest.fixture
async def make_host() -> AsyncIterator[Callable[..., Any]]:
    made: list[Host] = []

    async def make(access: AccessControl | None = None, identity: Identity | None = None) -> Host:
        host = Host(identity or Identity.generate(), HostConfig(listen=LOOPBACK), access=access)
        await host.start()
        made.append(host)
        return host

    yield make
    for host in reversed(made):
        await host.aclose()


def addr(host: Host) -> Multiaddr:
    return host.listen_addrs[0].with_peer_id(host.peer_id)


async def test_keyed_peers_connect_and_talk(make_host) -> None:
    a, b = await make_host(AccessControl(K1)), await make_host(AccessControl(K1))

    async def echo(stream) -> None:
        await stream.write(await stream.read())

    b.set_handler(ECHO, echo)
    stream = await a.open_stream(addr(b), ECHO, timeout=5)
    await stream.write(b"hello, swarm")
    await stream.close()
    assert await stream.read() == b"hello, swarm"
    assert a.access.status()["refusals"] == b.access.status()["refusals"] == 0


@pytest.mark.parametrize("outsider_key", [None, K2], ids=["no-key", "another-key"])
async def test_an_outsider_can_neither_dial_nor_be_dialed_and_the_keyed_side_counts_it(
    make_host, outsider_key: bytes | None
) -> None:
    member = await make_host(AccessControl(K1))
    outsider = await make_host(AccessControl(outsider_key))
    # The outsider dials the member: refused at message 1, counted there.
    with pytest.raises(TransportError):
        await outsider.connect(addr(member), timeout=5)
    await eventually(lambda: member.access.refusals["swarm_key"] == 1, "member counts it")
    # The member dials the outsider: it never answers, and the member says why.
    with pytest.raises(TransportError, match="swarm key probably differs"):
        await member.connect(addr(outsider), timeout=5)
    assert member.access.unanswered == 1
    if outsider_key is not None:
        await eventually(lambda: outsider.access.refusals["swarm_key"] == 1, "outsider too")
    assert not member.open_connections() and not outsider.open_connections()
    assert member.access.status()["mode"] == "swarm-key"


async def test_the_allow_list_refuses_unlisted_peers_both_ways(make_host) -> None:
    friend_id, stranger_id = Identity.generate(), Identity.generate()
    gate = await make_host(AccessControl(None, [friend_id.peer_id]))
    friend = await make_host(identity=friend_id)
    stranger = await make_host(identity=stranger_id)
    assert (await friend.connect(addr(gate), timeout=5)).remote_peer == gate.peer_id
    with pytest.raises(TransportError):
        await stranger.connect(addr(gate), timeout=5)
    await eventually(lambda: gate.access.refusals["not_allowed"] == 1, "the refusal counted")
    with pytest.raises(TransportError, match="not in the allow list"):
        await gate.connect(addr(stranger), timeout=5)
    assert gate.access.refusals["not_allowed"] == 2
    assert set(gate.connections) == {friend_id.peer_id}
    assert not stranger.open_connections()


async def test_swarm_key_and_allow_list_together(make_host) -> None:
    friend_id = Identity.generate()
    gate = await make_host(AccessControl(K1, [friend_id.peer_id]))
    assert gate.access.mode == "swarm-key+allow-peers"
    listed_without_key = await make_host(identity=friend_id)
    keyed_stranger = await make_host(AccessControl(K1))
    with pytest.raises(TransportError):
        await listed_without_key.connect(addr(gate), timeout=5)
    with pytest.raises(TransportError):
        await keyed_stranger.connect(addr(gate), timeout=5)
    await eventually(lambda: sum(gate.access.refusals.values()) == 2, "both refused")
    assert gate.access.refusals == {"swarm_key": 1, "not_allowed": 1}


# -- relayed and hole-punched connections --------------------------------------------------------


@pytest.fixture
async def make_peer() -> AsyncIterator[Callable[..., Any]]:
    """Started (host, NatManager) pairs on 127.0.0.1 under `access`, closed at teardown."""
    made: list[tuple[Host, NatManager]] = []

    async def make(
        access: AccessControl | None = None, identity: Identity | None = None, **cfg: Any
    ) -> tuple[Host, NatManager]:
        cfg.setdefault("observed_threshold", 1)
        cfg.setdefault("relay_retry", 0.2)
        host = Host(
            identity or Identity.generate(),
            HostConfig(listen=LOOPBACK, reuse_port=True),
            access=access,
        )
        await host.start()
        nat = NatManager(host, config=NatConfig(**cfg))
        await nat.start()
        made.append((host, nat))
        return host, nat

    yield make
    for host, nat in reversed(made):
        await nat.aclose()
        await host.aclose()


async def _relay_and_private(
    make_peer: Callable[..., Any],
    relay_access: AccessControl,
    private_access: AccessControl,
    private_id: Identity | None = None,
    punch: bool = False,
) -> tuple[Host, NatManager, Host, NatManager, Multiaddr]:
    r, nr = await make_peer(relay_access, hole_punching=punch)
    a, na = await make_peer(private_access, private_id, reachability="private", hole_punching=punch)
    await a.connect(addr(r))
    assert await nr.wait_for(lambda: nr.reachability is Reachability.PUBLIC, 5)
    assert await na.wait_for(lambda: bool(na.relay_addresses()), 5), na.status()
    (circuit,) = na.relay_addresses()
    return r, nr, a, na, circuit


async def test_a_keyed_relay_does_not_carry_a_keyless_circuit_to_a_keyed_peer(make_peer) -> None:
    r, _, a, _, circuit = await _relay_and_private(make_peer, AccessControl(K1), AccessControl(K1))
    # The intruder holds the relay's key for the hop, then dials the circuit under
    # another: the inner handshake, end to end with the target, checks the key too.
    intruder, _ = await make_peer(AccessControl(K1), hole_punching=False)
    await intruder.connect(addr(r), timeout=5)
    intruder.access.swarm_key = K2
    with pytest.raises(TransportError):
        await intruder.connect(circuit, timeout=5)
    await eventually(lambda: a.access.refusals["swarm_key"] == 1, "the target refused it")
    assert a.connection(intruder.peer_id) is None
    # A member reaches the target through the same relay.
    member, _ = await make_peer(AccessControl(K1), hole_punching=False)
    conn = await member.connect(circuit, timeout=5)
    assert conn.kind == "relayed" and conn.remote_peer == a.peer_id


async def test_an_open_relay_does_not_let_an_unlisted_peer_reach_an_allow_listed_one(
    make_peer,
) -> None:
    relay_id, a_id, friend_id = Identity.generate(), Identity.generate(), Identity.generate()
    gate = AccessControl(None, [relay_id.peer_id, friend_id.peer_id])
    r, _ = await make_peer(identity=relay_id, hole_punching=False)
    a, na = await make_peer(gate, a_id, reachability="private", hole_punching=False)
    await a.connect(addr(r))
    assert await na.wait_for(lambda: bool(na.relay_addresses()), 10), na.status()
    (circuit,) = na.relay_addresses()
    stranger, _ = await make_peer(hole_punching=False)
    with pytest.raises(TransportError):
        await stranger.connect(circuit, timeout=5)
    await eventually(lambda: gate.refusals["not_allowed"] == 1, "the target refused it")
    friend, _ = await make_peer(identity=friend_id, hole_punching=False)
    assert (await friend.connect(circuit, timeout=5)).remote_peer == a.peer_id


async def test_keyed_peers_still_hole_punch(make_peer) -> None:
    _, _, a, na, circuit = await _relay_and_private(
        make_peer, AccessControl(K1), AccessControl(K1), punch=True
    )
    c, nc = await make_peer(AccessControl(K1))
    assert (await c.connect(circuit, timeout=5)).kind == "relayed"

    def punched(host: Host, peer: PeerID) -> bool:
        conn = host.connection(peer)
        return conn is not None and conn.kind == "hole-punched"

    assert await nc.wait_for(lambda: punched(c, a.peer_id), 10)
    assert await na.wait_for(lambda: punched(a, c.peer_id), 10)
    assert a.access.status()["refusals"] == c.access.status()["refusals"] == 0


async def test_autonat_dial_backs_pass_an_allow_list_that_names_the_server(make_peer) -> None:
    # The dial-back comes from a throwaway identity derived from the request's nonce:
    # the asking peer admits exactly that one for the request, so a public peer in an
    # allow-list swarm still learns that it is public.
    ids = [Identity.generate() for _ in range(2)]
    gates = [AccessControl(K1, [i.peer_id for i in ids]) for _ in ids]
    (x, nx), (y, ny) = [await make_peer(g, i) for g, i in zip(gates, ids, strict=True)]
    await x.connect(addr(y), timeout=5)
    assert await nx.wait_for(lambda: nx.reachability is Reachability.PUBLIC, 10), nx.status()
    assert await ny.wait_for(lambda: ny.reachability is Reachability.PUBLIC, 10), ny.status()
    assert gates[0].refusals == gates[1].refusals == {}
    assert not gates[0]._admitted and not gates[1]._admitted  # released after each probe


# -- what the peer shows -------------------------------------------------------------------------


class _Provider:
    def __init__(self, access: dict[str, Any]) -> None:
        self.access = access

    def status(self) -> dict[str, Any]:
        return {"peer_id": "x", "access": self.access}

    async def peers(self) -> list[dict[str, Any]]:
        return []

    def history(self) -> list[dict[str, Any]]:
        return []

    def swarm(self) -> dict[str, Any]:
        return {}


def test_refusals_are_a_prometheus_counter_by_reason() -> None:
    access = AccessControl(K1)
    access.refused("swarm_key")
    access.refused("swarm_key")
    text = Metrics(_Provider(access.status())).render()[0].decode()
    assert 'shoal_access_refusals_total{reason="swarm_key"} 2.0' in text
    assert 'shoal_access_refusals_total{reason="not_allowed"} 0.0' in text


def test_doctor_says_the_swarm_key_probably_differs() -> None:
    error = (
        "DialError: could not connect to 12D3KooW...: handshake with 10.0.0.1:31337 failed: "
        "closed by peer before answering our first message: its swarm key probably differs "
        "from ours (or it has none)"
    )
    facts = Facts(bootstrap=[("/ip4/10.0.0.1/tcp/31337", error)])
    facts.access = AccessControl(K1).status()
    (bootstrap, access, *_) = diagnose(facts)
    assert bootstrap.verdict == "fail" and "swarm key probably differs" in bootstrap.detail
    assert "--swarm-key" in bootstrap.advice
    assert access.verdict == "ok" and swarm_key_fingerprint(K1) in access.detail


def test_doctor_warns_of_bootstrap_peers_the_allow_list_would_refuse() -> None:
    facts = Facts(bootstrap=[("/ip4/10.0.0.1/tcp/31337/p2p/12D3KooWA", None)])
    facts.access = AccessControl(None, [Identity.generate().peer_id]).status()
    facts.unlisted_bootstrap = ["12D3KooWA"]
    access = diagnose(facts)[1]
    assert access.verdict == "warn" and "12D3KooWA" in access.detail
    assert "list bootstrap peers and relays" in access.advice


def test_the_probe_identity_is_the_same_on_both_sides_and_new_per_nonce() -> None:
    from shoal.transport.nat.autonat import probe_identity

    nonce = os.urandom(16)
    assert probe_identity(nonce).peer_id == probe_identity(bytes(nonce)).peer_id
    assert probe_identity(nonce).peer_id != probe_identity(os.urandom(16)).peer_id
