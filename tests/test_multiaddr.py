"""Specification of shoal.transport.multiaddr: text and binary forms, validation, accessors."""

from __future__ import annotations

import copy
import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.transport.identity import Identity, PeerID
from shoal.transport.multiaddr import (
    MAX_COMPONENTS,
    MAX_TEXT_LEN,
    Multiaddr,
    MultiaddrError,
    from_socket_address,
    parse_many,
)

# From seeds: they name parametrized tests, which every xdist worker must collect alike.
PEERS = [Identity.from_seed(bytes([i + 1]) * 32).peer_id for i in range(6)]
RELAY = PEERS[0]
TARGET = PEERS[1]
R = RELAY.to_base58()
T = TARGET.to_base58()


# ---------------------------------------------------------------- valid addresses

VALID = [
    "/ip4/127.0.0.1/tcp/4001",
    "/ip4/0.0.0.0/tcp/0",
    "/ip4/255.255.255.255/tcp/65535",
    f"/ip4/203.0.113.5/tcp/31337/p2p/{T}",
    "/ip6/::1/tcp/4001",
    "/ip6/::/tcp/1",
    "/ip6/2001:db8::1/tcp/31337",
    f"/ip6/fe80::1/tcp/1/p2p/{T}",
    "/dns/example.com/tcp/443",
    "/dns/localhost/tcp/8080",
    "/dns4/a-b.c-d.example/tcp/1",
    "/dns6/xn--bcher-kva.example/tcp/2",
    "/dns/Bootstrap.Example.COM/tcp/31337",
    f"/dns/relay.example/tcp/1/p2p/{T}",
    f"/p2p/{T}",
    f"/p2p/{R}/p2p-circuit",
    f"/p2p/{R}/p2p-circuit/p2p/{T}",
    f"/ip4/1.2.3.4/tcp/1/p2p/{R}/p2p-circuit",
    f"/ip4/1.2.3.4/tcp/1/p2p/{R}/p2p-circuit/p2p/{T}",
    f"/ip6/2001:db8::7/tcp/31337/p2p/{R}/p2p-circuit/p2p/{T}",
    f"/dns6/relay.example/tcp/4/p2p/{R}/p2p-circuit/p2p/{T}",
]


@pytest.mark.parametrize("text", VALID)
def test_valid_addresses_round_trip_text_and_bytes(text: str) -> None:
    addr = Multiaddr(text)
    assert str(addr) == text
    assert Multiaddr.parse(text) == addr
    assert Multiaddr(str(addr)) == addr
    raw = addr.to_bytes()
    assert bytes(addr) == raw
    back = Multiaddr.from_bytes(raw)
    assert back == addr
    assert str(back) == text
    assert back.to_bytes() == raw
    assert Multiaddr.from_components(addr.components) == addr
    assert hash(Multiaddr(text)) == hash(addr)


def test_known_binary_vectors() -> None:
    assert Multiaddr("/ip4/127.0.0.1/tcp/4001").to_bytes() == bytes.fromhex("047f000001060fa1")
    ip6 = bytes.fromhex("29" + "00" * 15 + "01" + "060fa1")
    assert Multiaddr("/ip6/::1/tcp/4001").to_bytes() == ip6
    assert Multiaddr.from_bytes(ip6) == Multiaddr("/ip6/::1/tcp/4001")
    # p2p = 421 = varint a5 03, value = varint length + identity multihash
    assert Multiaddr(f"/p2p/{T}").to_bytes() == b"\xa5\x03\x26" + TARGET.to_bytes()
    # dns = 53, value = varint length + name; p2p-circuit = 290 = varint a2 02
    dns = Multiaddr("/dns/a.io/tcp/80").to_bytes()
    assert dns == b"\x35\x04a.io\x06\x00\x50"
    relayed = Multiaddr(f"/p2p/{R}/p2p-circuit").to_bytes()
    assert relayed == b"\xa5\x03\x26" + RELAY.to_bytes() + b"\xa2\x02"


def test_from_bytes_accepts_bytes_like() -> None:
    raw = bytes.fromhex("047f000001060fa1")
    assert Multiaddr.from_bytes(bytearray(raw)) == Multiaddr.from_bytes(memoryview(raw))


def test_ip6_is_normalized_to_compressed_form() -> None:
    addr = Multiaddr("/ip6/2001:0DB8:0000:0000:0000:0000:0000:0001/tcp/1")
    assert str(addr) == "/ip6/2001:db8::1/tcp/1"
    assert addr == Multiaddr("/ip6/2001:db8::1/tcp/1")
    assert str(Multiaddr("/ip6/0:0:0:0:0:0:0:0/tcp/1")) == "/ip6/::/tcp/1"


def test_dns_names_are_kept_as_given() -> None:
    addr = Multiaddr("/dns/Example.COM/tcp/1")
    assert str(addr) == "/dns/Example.COM/tcp/1"
    assert addr.tcp_endpoint() == ("Example.COM", 1)


def test_from_components() -> None:
    addr = Multiaddr.from_components([("ip4", "1.2.3.4"), ("tcp", "5")])
    assert addr == Multiaddr("/ip4/1.2.3.4/tcp/5")
    assert addr.components == (("ip4", "1.2.3.4"), ("tcp", "5"))
    relayed = Multiaddr.from_components([("p2p", R), ("p2p-circuit", None), ("p2p", T)])
    assert str(relayed) == f"/p2p/{R}/p2p-circuit/p2p/{T}"
    ip6 = Multiaddr.from_components([("ip6", "0::1"), ("tcp", "1")])
    assert ip6.components == (("ip6", "::1"), ("tcp", "1"))


# ---------------------------------------------------------------- object behaviour


def test_immutable_hashable_and_equal_by_components() -> None:
    a = Multiaddr("/ip4/1.2.3.4/tcp/5")
    with pytest.raises(AttributeError):
        a._components = ()  # type: ignore[misc]
    with pytest.raises(AttributeError):
        a.foo = 1  # type: ignore[attr-defined]
    assert isinstance(a.components, tuple)
    assert {a, Multiaddr("/ip4/1.2.3.4/tcp/5"), Multiaddr("/ip4/1.2.3.4/tcp/6")} == {
        a,
        Multiaddr("/ip4/1.2.3.4/tcp/6"),
    }
    assert a != "/ip4/1.2.3.4/tcp/5"
    assert Multiaddr(a) == a
    assert repr(a) == "Multiaddr('/ip4/1.2.3.4/tcp/5')"


def test_pickle_and_copy() -> None:
    a = Multiaddr(f"/ip4/1.2.3.4/tcp/1/p2p/{R}/p2p-circuit/p2p/{T}")
    assert pickle.loads(pickle.dumps(a)) == a
    assert copy.copy(a) == a
    assert copy.deepcopy(a) == a


def test_constructor_rejects_non_text() -> None:
    with pytest.raises(TypeError):
        Multiaddr(b"/ip4/1.2.3.4/tcp/1")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        Multiaddr.from_bytes("047f000001060fa1")  # type: ignore[arg-type]


# ---------------------------------------------------------------- accessors


def test_accessors_of_direct_address() -> None:
    a = Multiaddr(f"/ip4/203.0.113.5/tcp/31337/p2p/{T}")
    assert a.protocols() == ["ip4", "tcp", "p2p"]
    assert a.value_for("ip4") == "203.0.113.5"
    assert a.value_for("tcp") == "31337"
    assert a.value_for("ip6") is None
    assert a.value_for("nonsense") is None
    assert a.peer_id == TARGET
    assert isinstance(a.peer_id, PeerID)
    assert a.relay_peer_id is None
    assert not a.is_relayed
    assert a.is_direct_tcp
    assert a.family == "ip4"
    assert a.tcp_endpoint() == ("203.0.113.5", 31337)


def test_accessors_of_relayed_address() -> None:
    a = Multiaddr(f"/ip6/2001:db8::1/tcp/4001/p2p/{R}/p2p-circuit/p2p/{T}")
    assert a.protocols() == ["ip6", "tcp", "p2p", "p2p-circuit", "p2p"]
    assert a.value_for("p2p") == R  # first occurrence
    assert a.value_for("p2p-circuit") is None
    assert a.peer_id == TARGET  # the last /p2p: the target
    assert a.relay_peer_id == RELAY
    assert a.is_relayed
    assert not a.is_direct_tcp
    assert a.tcp_endpoint() is None
    assert a.family == "ip6"  # of the first hop, the relay

    no_target = Multiaddr(f"/p2p/{R}/p2p-circuit")
    assert no_target.relay_peer_id == RELAY
    assert no_target.peer_id == RELAY  # the last /p2p there is the relay's
    assert no_target.family is None


def test_accessors_of_bare_peer_id() -> None:
    a = Multiaddr(f"/p2p/{T}")
    assert a.peer_id == TARGET
    assert a.relay_peer_id is None
    assert not a.is_relayed
    assert not a.is_direct_tcp
    assert a.tcp_endpoint() is None
    assert a.family is None
    assert not (a.is_loopback or a.is_private or a.is_public_ip or a.is_unspecified)


def test_no_peer_id() -> None:
    assert Multiaddr("/dns/example.com/tcp/1").peer_id is None


@pytest.mark.parametrize(
    ("text", "endpoint", "family"),
    [
        ("/ip4/10.0.0.1/tcp/1", ("10.0.0.1", 1), "ip4"),
        ("/ip6/::1/tcp/2", ("::1", 2), "ip6"),  # no brackets: ready for open_connection
        ("/dns/example.com/tcp/3", ("example.com", 3), "dns"),
        ("/dns4/example.com/tcp/4", ("example.com", 4), "dns4"),
        (f"/dns6/example.com/tcp/0/p2p/{T}", ("example.com", 0), "dns6"),
    ],
)
def test_tcp_endpoint_and_family(text: str, endpoint: tuple[str, int], family: str) -> None:
    a = Multiaddr(text)
    assert a.tcp_endpoint() == endpoint
    assert a.family == family
    assert a.is_direct_tcp


@pytest.mark.parametrize(
    ("host", "unspecified", "loopback", "private", "public"),
    [
        ("0.0.0.0", True, False, True, False),
        ("::", True, False, True, False),
        ("127.0.0.1", False, True, True, False),
        ("::1", False, True, True, False),
        ("10.1.2.3", False, False, True, False),
        ("172.16.0.1", False, False, True, False),
        ("192.168.1.1", False, False, True, False),
        ("169.254.1.1", False, False, True, False),
        ("fd00::1", False, False, True, False),
        ("fe80::1", False, False, True, False),
        ("8.8.8.8", False, False, False, True),
        ("2606:4700:4700::1111", False, False, False, True),
        ("100.64.0.1", False, False, False, False),  # CGNAT: neither private nor global
    ],
)
def test_ip_predicates(
    host: str, unspecified: bool, loopback: bool, private: bool, public: bool
) -> None:
    proto = "ip6" if ":" in host else "ip4"
    a = Multiaddr(f"/{proto}/{host}/tcp/1")
    assert a.is_unspecified is unspecified
    assert a.is_loopback is loopback
    assert a.is_private is private
    assert a.is_public_ip is public


def test_ip_predicates_are_false_for_dns() -> None:
    a = Multiaddr("/dns/localhost/tcp/1")
    assert not (a.is_unspecified or a.is_loopback or a.is_private or a.is_public_ip)


# ---------------------------------------------------------------- derived addresses


def test_encapsulate() -> None:
    base = Multiaddr("/ip4/1.2.3.4/tcp/1")
    assert base.encapsulate(f"/p2p/{R}") == Multiaddr(f"/ip4/1.2.3.4/tcp/1/p2p/{R}")
    relay = base.encapsulate(Multiaddr(f"/p2p/{R}"))
    assert relay.encapsulate("/p2p-circuit").encapsulate(f"/p2p/{T}") == Multiaddr(
        f"/ip4/1.2.3.4/tcp/1/p2p/{R}/p2p-circuit/p2p/{T}"
    )
    assert relay.encapsulate(f"/p2p-circuit/p2p/{T}").is_relayed


def test_encapsulate_errors_quote_the_combined_address() -> None:
    base = Multiaddr("/ip4/1.2.3.4/tcp/1")
    with pytest.raises(MultiaddrError, match=r"'/ip4/1\.2\.3\.4/tcp/1/ip4/5\.6\.7\.8'"):
        base.encapsulate("/ip4/5.6.7.8")
    with pytest.raises(MultiaddrError, match=r"bad TCP port '99999'"):
        base.encapsulate("/tcp/99999")
    with pytest.raises(MultiaddrError, match=r"'/p2p-circuit' must follow /p2p/RELAY_ID"):
        base.encapsulate("/p2p-circuit")
    with pytest.raises(TypeError):
        base.encapsulate(42)  # type: ignore[arg-type]


def test_with_and_without_peer_id() -> None:
    base = Multiaddr("/ip4/1.2.3.4/tcp/1")
    with_t = base.with_peer_id(TARGET)
    assert with_t == Multiaddr(f"/ip4/1.2.3.4/tcp/1/p2p/{T}")
    assert with_t.with_peer_id(R) == Multiaddr(f"/ip4/1.2.3.4/tcp/1/p2p/{R}")  # replaced
    assert with_t.without_peer_id() == base
    assert base.without_peer_id() == base

    circuit = Multiaddr(f"/ip4/1.2.3.4/tcp/1/p2p/{R}/p2p-circuit")
    full = circuit.with_peer_id(TARGET)
    assert full.peer_id == TARGET
    assert full.relay_peer_id == RELAY
    assert full.with_peer_id(PEERS[2]).peer_id == PEERS[2]
    assert full.with_peer_id(PEERS[2]).relay_peer_id == RELAY
    assert full.without_peer_id() == circuit

    assert Multiaddr(f"/p2p/{R}").with_peer_id(TARGET) == Multiaddr(f"/p2p/{T}")
    with pytest.raises(MultiaddrError, match="nothing left"):
        Multiaddr(f"/p2p/{R}").without_peer_id()
    with pytest.raises(MultiaddrError, match=r"bad peer ID 'nope'"):
        base.with_peer_id("nope")


# ---------------------------------------------------------------- helpers


def test_from_socket_address() -> None:
    assert from_socket_address("1.2.3.4", 5) == Multiaddr("/ip4/1.2.3.4/tcp/5")
    assert from_socket_address("::1", 5) == Multiaddr("/ip6/::1/tcp/5")
    assert from_socket_address("2001:DB8:0::1", 7) == Multiaddr("/ip6/2001:db8::1/tcp/7")
    # An IPv4 peer seen through a dual-stack socket is an IPv4 peer.
    assert from_socket_address("::ffff:1.2.3.4", 5) == Multiaddr("/ip4/1.2.3.4/tcp/5")
    assert from_socket_address("::ffff:102:304", 5) == Multiaddr("/ip4/1.2.3.4/tcp/5")


@pytest.mark.parametrize(
    ("host", "port", "bad"),
    [
        ("1.2.3.999", 1, "'1.2.3.999'"),
        ("example.com", 1, "'example.com'"),
        ("fe80::1%eth0", 1, "'fe80::1%eth0'"),
        ("::ffff:1.2.3.4%eth0", 1, "zone"),
        ("1.2.3.4", 70000, "'70000'"),
        ("1.2.3.4", -1, "'-1'"),
    ],
)
def test_from_socket_address_errors(host: str, port: int, bad: str) -> None:
    with pytest.raises(MultiaddrError) as info:
        from_socket_address(host, port)
    assert bad in str(info.value)


def test_from_socket_address_types() -> None:
    with pytest.raises(TypeError):
        from_socket_address("1.2.3.4", "5")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        from_socket_address("1.2.3.4", True)


def test_parse_many() -> None:
    got = parse_many(["/ip4/1.2.3.4/tcp/1", "  /dns/a.example/tcp/2 ", "", "   ", f"/p2p/{T}"])
    assert got == [
        Multiaddr("/ip4/1.2.3.4/tcp/1"),
        Multiaddr("/dns/a.example/tcp/2"),
        Multiaddr(f"/p2p/{T}"),
    ]
    assert parse_many([]) == []
    assert parse_many(iter([Multiaddr("/ip4/1.2.3.4/tcp/1")])) == [Multiaddr("/ip4/1.2.3.4/tcp/1")]
    with pytest.raises(MultiaddrError, match=r"'/ip4/1\.2\.3\.4'.*missing /tcp"):
        parse_many(["/ip4/1.2.3.5/tcp/1", "/ip4/1.2.3.4"])


# ---------------------------------------------------------------- text errors

LONG_LABEL = "a" * 64
LONG_NAME = ".".join(["a" * 63] * 4)  # 255 characters

TEXT_ERRORS = [
    # (address, fragment the message must contain)
    ("", "empty address"),
    ("/", "empty address"),
    ("ip4/1.2.3.4/tcp/1", "must start with '/'"),
    (" /ip4/1.2.3.4/tcp/1", "must start with '/'"),
    ("/ip4/1.2.3.4/tcp/5/", "trailing '/'"),
    (f"/p2p/{T}/", "trailing '/'"),
    ("/ip4//tcp/1", "missing value for /ip4"),
    ("/ip4/1.2.3.4/tcp", "missing value for /tcp"),
    ("/ip4/1.2.3.4/tcp//p2p", "missing value for /tcp"),
    ("/ip4", "missing value for /ip4"),
    ("/p2p", "missing value for /p2p"),
    ("//ip4/1.2.3.4/tcp/1", "empty protocol name"),
    ("/ip4/1.2.3.4//tcp/1", "empty protocol name"),
    ("/udpx/1", "unknown protocol 'udpx'"),
    ("/ip4/1.2.3.4/udp/1", "unknown protocol 'udp'"),
    ("/IP4/1.2.3.4/tcp/1", "unknown protocol 'IP4'"),
    ("/ip4/1.2.3.4/tcp/1/quic-v1", "unknown protocol 'quic-v1'"),
    ("/ip4/1.2.3.4/5.6.7.8/tcp/1", "unknown protocol '5.6.7.8'"),
    ("/ip4/1.2.3.4/tcp/1/2", "unknown protocol '2'"),
    (f"/p2p-circuit/x/p2p/{T}", "unknown protocol 'x'"),
    ("/ip4/1.2.3.256/tcp/1", "bad IPv4 address '1.2.3.256'"),
    ("/ip4/01.2.3.4/tcp/1", "bad IPv4 address '01.2.3.4'"),
    ("/ip4/1.2.3/tcp/1", "bad IPv4 address '1.2.3'"),
    ("/ip4/::1/tcp/1", "bad IPv4 address '::1'"),
    ("/ip4/1.2.3.4 /tcp/1", "bad IPv4 address '1.2.3.4 '"),
    ("/ip6/1.2.3.4/tcp/1", "bad IPv6 address '1.2.3.4'"),
    ("/ip6/::g/tcp/1", "bad IPv6 address '::g'"),
    ("/ip6/1:2:3:4:5:6:7:8:9/tcp/1", "bad IPv6 address '1:2:3:4:5:6:7:8:9'"),
    ("/ip6/fe80::1%eth0/tcp/1", "bad IPv6 address 'fe80::1%eth0' (zone IDs are not supported"),
    ("/ip4/1.2.3.4/tcp/70000", "bad TCP port '70000'"),
    ("/ip4/1.2.3.4/tcp/65536", "bad TCP port '65536'"),
    ("/ip4/1.2.3.4/tcp/-1", "bad TCP port '-1'"),
    ("/ip4/1.2.3.4/tcp/+80", "bad TCP port '+80'"),
    ("/ip4/1.2.3.4/tcp/080", "bad TCP port '080'"),
    ("/ip4/1.2.3.4/tcp/8o", "bad TCP port '8o'"),
    ("/ip4/1.2.3.4/tcp/ 80", "bad TCP port ' 80'"),
    ("/ip4/1.2.3.4/tcp/٨٠", "bad TCP port '٨٠'"),
    ("/ip4/1.2.3.4/tcp/100000000000000000000", "bad TCP port '100000000000000000000'"),
    ("/p2p/12D3KooWnotanid", "bad peer ID '12D3KooWnotanid'"),
    (f"/p2p/{T[:-1]}", f"bad peer ID '{T[:-1]}'"),
    (f"/p2p/{T}0", f"bad peer ID '{T}0'"),  # '0' is not in base58
    ("/p2p/QmcgpsyWgH8Y8ajJz1Cu72KnS5uo2Aa2LpzU7kinSupNKC", "bad peer ID 'QmcgpsyW"),
    ("/dns/exa_mple.com/tcp/1", "bad DNS name 'exa_mple.com'"),
    ("/dns/-example.com/tcp/1", "bad DNS name '-example.com'"),
    ("/dns/example-.com/tcp/1", "bad DNS name 'example-.com'"),
    ("/dns/example..com/tcp/1", "bad DNS name 'example..com'"),
    ("/dns/.example.com/tcp/1", "bad DNS name '.example.com'"),
    ("/dns/example.com./tcp/1", "bad DNS name 'example.com.'"),
    ("/dns4/exämple.com/tcp/1", "bad DNS name 'exämple.com'"),
    ("/dns6/a b/tcp/1", "bad DNS name 'a b'"),
    (f"/dns/{LONG_LABEL}.com/tcp/1", f"bad DNS name '{LONG_LABEL}.com'"),
    (f"/dns/{LONG_NAME}/tcp/1", "longer than 253"),
    ("/ip4/1.2.3.4", "missing /tcp after '/ip4/1.2.3.4'"),
    ("/dns/example.com", "missing /tcp after '/dns/example.com'"),
    (f"/ip4/1.2.3.4/p2p/{T}", "missing /tcp after '/ip4/1.2.3.4'"),
    ("/tcp/1", "'/tcp/1' must follow /ip4"),
    (f"/p2p/{T}/tcp/1", "unexpected '/tcp/1'"),
    ("/ip4/1.2.3.4/tcp/1/tcp/2", "unexpected '/tcp/2' after '/tcp/1'"),
    ("/ip4/1.2.3.4/tcp/1/ip4/5.6.7.8/tcp/1", "unexpected '/ip4/5.6.7.8' after '/tcp/1'"),
    (f"/p2p/{R}/p2p/{T}", f"unexpected '/p2p/{T}' after '/p2p/{R}'"),
    ("/p2p-circuit", "'/p2p-circuit' must follow /p2p/RELAY_ID"),
    (f"/p2p-circuit/p2p/{T}", "'/p2p-circuit' must follow /p2p/RELAY_ID"),
    ("/ip4/1.2.3.4/tcp/1/p2p-circuit", "'/p2p-circuit' must follow /p2p/RELAY_ID"),
    (f"/p2p/{R}/p2p-circuit/p2p-circuit", "a second '/p2p-circuit'"),
    (f"/p2p/{R}/p2p-circuit/p2p/{T}/p2p-circuit", "a second '/p2p-circuit'"),
    (f"/p2p/{R}/p2p-circuit/ip4/1.2.3.4/tcp/1", "unexpected '/ip4/1.2.3.4'"),
    (f"/p2p/{R}/p2p-circuit/p2p/{T}/p2p/{R}", f"unexpected '/p2p/{R}'"),
    ("/p2p-circuit" * 17, "more than 16 components"),
    ("/" + "a" * MAX_TEXT_LEN, "longer than 1024 characters"),
]


@pytest.mark.parametrize(("text", "fragment"), TEXT_ERRORS)
def test_text_errors_quote_address_and_bad_part(text: str, fragment: str) -> None:
    with pytest.raises(MultiaddrError) as info:
        Multiaddr(text)
    message = str(info.value)
    assert fragment in message
    if len(text) <= 200:
        assert message.startswith(f"invalid multiaddr {text!r}: ")
    else:  # hostile lengths are quoted by their start only
        assert message.startswith(f"invalid multiaddr {text[:64]!r}...")
    assert isinstance(info.value, ValueError)
    assert info.value.reason in message


def test_error_message_example_from_the_brief() -> None:
    with pytest.raises(MultiaddrError) as info:
        Multiaddr("/ip4/1.2.3.256/tcp/1")
    assert str(info.value) == (
        "invalid multiaddr '/ip4/1.2.3.256/tcp/1': bad IPv4 address '1.2.3.256'"
    )


def test_hostile_text_is_not_echoed_in_full() -> None:
    text = "/ip4/" + "1" * 100_000
    with pytest.raises(MultiaddrError) as info:
        Multiaddr(text)
    assert len(str(info.value)) < 300


def test_control_characters_are_escaped_in_messages() -> None:
    with pytest.raises(MultiaddrError) as info:
        Multiaddr("/dns/evil\nINFO fake log line/tcp/1")
    assert "\n" not in str(info.value)


def test_component_limit() -> None:
    # The longest valid shape is 5 components, far below the limit.
    assert MAX_COMPONENTS >= 5
    with pytest.raises(MultiaddrError, match="more than 16 components"):
        Multiaddr.from_components([("p2p-circuit", None)] * 100)


@pytest.mark.parametrize(
    ("components", "fragment"),
    [
        ([], "empty address"),
        ([("ip4", "1.2.3.4"), ("tcp", 5)], "must be str"),
        ([("ip4", "1.2.3.4"), ("tcp", None)], "missing value for /tcp"),
        ([("ip4", "1.2.3.4"), ("tcp", "")], "missing value for /tcp"),
        ([("ip4", "1.2.3.4"), ("tcp", "5/p2p")], "bad TCP port '5/p2p'"),
        ([("p2p", R), ("p2p-circuit", "x")], "/p2p-circuit takes no value"),
        ([("udp", "1")], "unknown protocol 'udp'"),
        ([(["ip4"], "1")], "unknown protocol"),
        ([("ip4",)], "not a (protocol, value) pair"),
        ([("ip4", "1.2.3.4")], "missing /tcp"),
    ],
)
def test_from_components_errors(components: list, fragment: str) -> None:
    with pytest.raises(MultiaddrError) as info:
        Multiaddr.from_components(components)
    assert fragment in str(info.value)


# ---------------------------------------------------------------- binary errors

GOOD_IP4 = bytes.fromhex("047f000001060fa1")

BYTES_ERRORS = [
    (b"", "empty address"),
    (b"\x04\x7f\x00", "truncated value for /ip4"),
    (b"\x29" + b"\x00" * 15, "truncated value for /ip6"),
    (b"\x04\x7f\x00\x00\x01\x06\x0f", "truncated value for /tcp"),
    (b"\x04\x7f\x00\x00\x01", "missing /tcp"),
    (b"\x80", "truncated varint"),
    (b"\x84\x00\x7f\x00\x00\x01\x06\x0f\xa1", "non-minimal varint"),
    (b"\xff" * 10, "varint longer than 9 bytes"),
    (b"\x11\x00\x01", "unknown protocol code 17"),
    (b"\x35\x00\x06\x00\x01", "bad DNS name ''"),
    (b"\x35\x05a.io", "truncated value for /dns"),
    (b"\x35\x04a_io\x06\x00\x01", "bad DNS name 'a_io'"),
    (b"\x35\x02\xc3\xa4\x06\x00\x01", "not ASCII"),
    (b"\x35\xff\xff\xff\xff\x0f", "truncated value for /dns"),
    (b"\xa5\x03\x05hello", "bad peer ID bytes '68656c6c6f'"),
    (b"\xa5\x03\x26" + b"\x00" * 38, "bad peer ID bytes"),
    (b"\xa5\x03\x26" + TARGET.to_bytes()[:-1], "truncated value for /p2p"),
    (b"\xa2\x02", "'/p2p-circuit' must follow /p2p/RELAY_ID"),
    (GOOD_IP4 + GOOD_IP4, "unexpected '/ip4/127.0.0.1' after '/tcp/4001'"),
    (b"\xa2\x02" * 17, "more than 16 components"),
    (b"\x04" + b"\x00" * 2000, "longer than 1024 bytes"),
]


@pytest.mark.parametrize(("data", "fragment"), BYTES_ERRORS)
def test_bytes_errors(data: bytes, fragment: str) -> None:
    with pytest.raises(MultiaddrError) as info:
        Multiaddr.from_bytes(data)
    message = str(info.value)
    assert fragment in message
    if len(data) <= 100:
        assert message.startswith(f"invalid multiaddr bytes {data.hex()!r}: ")


# ---------------------------------------------------------------- properties

TOKENS = [
    "ip4",
    "ip6",
    "dns",
    "dns4",
    "dns6",
    "tcp",
    "p2p",
    "p2p-circuit",
    "udp",
    "",
    "1.2.3.4",
    "::1",
    "fe80::1%eth0",
    "example.com",
    "-a",
    "80",
    "65536",
    "0",
    "+1",
    R,
    T,
    T[:20],
]


@st.composite
def token_text(draw: st.DrawFn) -> str:
    """Text built from meaningful tokens, to reach deep into the parser."""
    tokens = draw(st.lists(st.sampled_from(TOKENS) | st.text(max_size=8), max_size=12))
    prefix = draw(st.sampled_from(["/", "", "//"]))
    suffix = draw(st.sampled_from(["", "/"]))
    return prefix + "/".join(tokens) + suffix


@given(st.text(max_size=300) | token_text())
@settings(max_examples=400, deadline=None)
def test_random_text_raises_only_multiaddr_error(text: str) -> None:
    try:
        addr = Multiaddr(text)
    except MultiaddrError:
        return
    # Whatever is accepted is canonical and round-trips.
    assert Multiaddr(str(addr)) == addr
    assert Multiaddr.from_bytes(addr.to_bytes()) == addr


CHUNKS = [
    GOOD_IP4,
    b"\x29" + b"\x00" * 15 + b"\x01",
    b"\x06\x0f\xa1",
    b"\x35\x0bexample.com",
    b"\xa5\x03\x26" + RELAY.to_bytes(),
    b"\xa5\x03\x26" + TARGET.to_bytes(),
    b"\xa2\x02",
    b"\xa5\x03",
    b"\x35",
]


@given(
    st.binary(max_size=200)
    | st.lists(st.sampled_from(CHUNKS) | st.binary(max_size=4), max_size=8).map(b"".join)
)
@settings(max_examples=400, deadline=None)
def test_random_bytes_raise_only_multiaddr_error(data: bytes) -> None:
    try:
        addr = Multiaddr.from_bytes(data)
    except MultiaddrError:
        return
    # Accepted bytes are the canonical encoding (minimal varints, normalized values).
    assert addr.to_bytes() == data
    assert Multiaddr(str(addr)) == addr


label = st.from_regex(r"[A-Za-z0-9]([A-Za-z0-9-]{0,10}[A-Za-z0-9])?", fullmatch=True)
dns_name = st.lists(label, min_size=1, max_size=4).map(".".join)
ip4 = st.ip_addresses(v=4).map(str)
ip6 = st.ip_addresses(v=6).map(str)
peer = st.sampled_from(PEERS).map(PeerID.to_base58)
port = st.integers(0, 65535).map(str)
host = st.one_of(
    st.tuples(st.just("ip4"), ip4),
    st.tuples(st.just("ip6"), ip6),
    st.tuples(st.sampled_from(["dns", "dns4", "dns6"]), dns_name),
)


@st.composite
def valid_components(draw: st.DrawFn) -> list[tuple[str, str | None]]:
    comps: list[tuple[str, str | None]] = []
    has_transport = draw(st.booleans())
    if has_transport:
        comps += [draw(host), ("tcp", draw(port))]
    if not has_transport or draw(st.booleans()):
        comps.append(("p2p", draw(peer)))
        if draw(st.booleans()):
            comps.append(("p2p-circuit", None))
            if draw(st.booleans()):
                comps.append(("p2p", draw(peer)))
    return comps


@given(valid_components())
@settings(max_examples=300, deadline=None)
def test_generated_valid_addresses_round_trip(comps: list[tuple[str, str | None]]) -> None:
    addr = Multiaddr.from_components(comps)
    text = str(addr)
    assert Multiaddr(text) == addr
    assert str(Multiaddr(text)) == text
    raw = addr.to_bytes()
    assert Multiaddr.from_bytes(raw) == addr
    assert Multiaddr.from_bytes(raw).to_bytes() == raw
    assert addr.is_relayed == ("p2p-circuit" in addr.protocols())
    assert addr.is_direct_tcp == (addr.tcp_endpoint() is not None)
    if addr.is_direct_tcp:
        (proto, given_host), (_, given_port) = comps[:2]
        host_text = addr.components[0][1]
        if proto != "ip6":  # ip4 from str() and DNS names are kept as given
            assert host_text == given_host
        assert addr.tcp_endpoint() == (host_text, int(given_port or "-1"))
