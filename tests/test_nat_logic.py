"""NAT traversal state machines without I/O: observed-address voting, the reachability
decision, relay bookkeeping and limits, hole-punch timing, identify message checks."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from shoal.transport.errors import ProtocolViolation
from shoal.transport.identity import Identity
from shoal.transport.multiaddr import Multiaddr
from shoal.transport.nat.config import RelayLimits
from shoal.transport.nat.holepunch import dial_targets, initiator_delay, parse_connect
from shoal.transport.nat.identify import IdentifyInfo
from shoal.transport.nat.observed import ObservedAddresses
from shoal.transport.nat.reachability import (
    ProbeResult,
    Reachability,
    ReachabilityTracker,
    has_public_interface,
    over_lan,
)
from shoal.transport.nat.relay import RelayBook

PEERS = [Identity.generate().peer_id for _ in range(6)]
NAT = Multiaddr("/ip4/203.0.113.7/tcp/31337")
OTHER = Multiaddr("/ip4/203.0.113.7/tcp/40000")


# --- observed addresses ------------------------------------------------------------------------


def test_an_observed_address_is_trusted_once_enough_distinct_peers_report_it() -> None:
    book = ObservedAddresses(threshold=2, ttl=100)
    assert not book.record(PEERS[0], NAT, 0.0)
    assert book.trusted(0.0) == []
    assert not book.record(PEERS[0], NAT, 1.0)  # the same observer again: still one vote
    assert book.trusted(1.0) == []
    assert book.best_guess(1.0) == [NAT]  # a single view is still the best guess
    assert book.record(PEERS[1], NAT.with_peer_id(PEERS[5]), 2.0)  # /p2p is ignored
    assert book.trusted(2.0) == [NAT]
    assert book.candidates(2.0) == [(NAT, 2)]


def test_an_observer_has_one_vote_and_votes_expire() -> None:
    book = ObservedAddresses(threshold=2, ttl=10)
    book.record(PEERS[0], NAT, 0.0)
    book.record(PEERS[1], NAT, 0.0)
    assert book.trusted(1.0) == [NAT]
    assert book.record(PEERS[1], OTHER, 2.0)  # it now sees another mapping: NAT lost a vote
    assert book.trusted(2.0) == []
    assert book.observed_by(PEERS[1], 2.0) == OTHER
    book.record(PEERS[2], OTHER, 5.0)
    assert book.trusted(5.0) == [OTHER]
    assert book.trusted(12.5) == []  # PEERS[1]'s vote (at t=2) expired
    assert book.observed_by(PEERS[1], 12.5) is None


def test_the_observer_table_is_bounded() -> None:
    book = ObservedAddresses(threshold=1, ttl=100, max_observers=3)
    for i, p in enumerate(PEERS[:5]):
        book.record(p, NAT, float(i))
    assert sum(n for _, n in book.candidates(5.0)) == 3


# --- reachability ------------------------------------------------------------------------------


def result(
    ok: bool, server: int = 0, addr: Multiaddr = NAT, at: float = 0.0, outcome: str = ""
) -> ProbeResult:
    kind = outcome or ("ok" if ok else "refused")
    return ProbeResult(PEERS[server], addr if ok else None, ok, at, (addr,), kind)


def public_host() -> ReachabilityTracker:
    """A tracker of a machine with a public interface address (a bootstrap or relay)."""
    t = ReachabilityTracker()
    t.public_interface = True
    return t


def test_reachability_starts_unknown_and_one_proved_dial_back_makes_it_public() -> None:
    t = public_host()
    assert t.reachability is Reachability.UNKNOWN
    assert t.record(result(True))
    assert t.reachability is Reachability.PUBLIC
    assert t.confirmed() == [NAT]


def test_one_timeout_does_not_make_a_public_host_private() -> None:
    t = public_host()
    t.record(result(False, 0, outcome="timeout"))
    assert t.reachability is Reachability.UNKNOWN
    assert t.may_serve_relay  # unconfirmed, but it keeps serving as a relay
    t.record(result(False, 1, outcome="timeout"))
    assert t.reachability is Reachability.UNKNOWN


def test_three_failures_from_distinct_servers_make_it_private() -> None:
    t = public_host()
    t.record(result(False, 0))
    t.record(result(False, 0))  # the same server again adds weight, not a second server
    t.record(result(False, 0))
    assert t.reachability is Reachability.UNKNOWN
    t.record(result(False, 1))
    assert t.reachability is Reachability.PRIVATE
    assert not t.may_serve_relay
    assert "4 dial-backs failed" in t.reason and PEERS[1].short() in t.reason


def test_timeouts_weigh_half_a_refusal() -> None:
    t = public_host()
    for server in range(5):
        t.record(result(False, server, outcome="timeout"))
    assert t.reachability is Reachability.UNKNOWN  # 2.5 of 3
    t.record(result(False, 5, outcome="timeout"))
    assert t.reachability is Reachability.PRIVATE


def test_a_success_after_private_makes_it_public_at_once() -> None:
    t = public_host()
    for server in range(3):
        t.record(result(False, server))
    assert t.reachability is Reachability.PRIVATE
    assert t.record(result(True, 3))
    assert t.reachability is Reachability.PUBLIC


def test_a_confirmed_host_needs_the_same_evidence_to_become_private() -> None:
    t = public_host()
    t.record(result(True, 0, NAT))
    t.record(result(False, 1))
    t.record(result(False, 2))
    assert t.reachability is Reachability.PUBLIC  # two failures: not enough against a proof
    t.record(result(False, 3))
    assert t.reachability is Reachability.PRIVATE
    assert t.confirmed() == []


def test_behind_a_nat_little_evidence_suffices() -> None:
    """Only private interface addresses: a NAT is in the way unless a port is forwarded."""
    t = ReachabilityTracker()
    assert not t.may_serve_relay
    t.record(result(False, 0, outcome="timeout"))
    assert t.reachability is Reachability.PRIVATE  # one server is all there was
    t.record(result(True, 1))
    assert t.reachability is Reachability.PUBLIC  # a forwarded port


def test_probes_come_soon_after_a_change_then_settle() -> None:
    t = public_host()
    assert t.next_delay() == 2.0  # unknown: keep asking
    t.record(result(True))
    delays = [t.next_delay() for _ in range(6)]
    assert delays == [2.0, 4.0, 8.0, 16.0, 300.0, 300.0]  # corrected within 30 s if wrong
    t.record(result(False, 1))  # contradicts PUBLIC: look again soon
    assert t.next_delay() == 2.0


def test_a_changed_address_drops_its_confirmation() -> None:
    t = public_host()
    t.record(result(True, 0, NAT))
    t.record(result(True, 1, OTHER))
    assert t.confirmed() == [OTHER, NAT] or set(t.confirmed()) == {NAT, OTHER}
    assert t.forget(lambda a: a != OTHER)
    assert t.confirmed() == [NAT]
    assert t.reachability is Reachability.PUBLIC
    assert t.forget(lambda a: False)
    assert t.reachability is Reachability.UNKNOWN  # the caller probes again


def test_public_interfaces_are_told_from_private_ones() -> None:
    assert has_public_interface([Multiaddr("/ip4/198.51.100.10/tcp/1")])
    assert has_public_interface(
        [Multiaddr("/ip4/10.0.1.2/tcp/1"), Multiaddr("/ip6/2001:db8::1/tcp/1")]
    )
    assert not has_public_interface(
        [
            Multiaddr(f"/ip4/{ip}/tcp/1")
            for ip in ("10.0.1.2", "192.168.1.5", "100.64.3.3", "127.0.0.1")
        ]
        + [
            Multiaddr("/ip6/::1/tcp/1"),
            Multiaddr("/ip6/fe80::1/tcp/1"),
            Multiaddr("/ip6/fd00::1/tcp/1"),
        ]
    )


def test_forced_reachability_ignores_results() -> None:
    t = ReachabilityTracker(forced=Reachability.PRIVATE)
    t.record(result(True))
    assert t.reachability is Reachability.PRIVATE


# --- relay bookkeeping -------------------------------------------------------------------------


def test_the_relay_refuses_reservations_beyond_its_limits() -> None:
    book = RelayBook(RelayLimits(max_reservations=2, max_reservations_per_ip=1))
    assert not isinstance(book.reserve(PEERS[0], "1.1.1.1", 0.0), str)
    refusal = book.reserve(PEERS[1], "1.1.1.1", 0.0)
    assert isinstance(refusal, str) and "per-IP reservation limit (1)" in refusal
    assert not isinstance(book.reserve(PEERS[1], "2.2.2.2", 0.0), str)
    refusal = book.reserve(PEERS[2], "3.3.3.3", 0.0)
    assert isinstance(refusal, str) and "reservation limit (2) reached" in refusal
    assert not isinstance(book.reserve(PEERS[0], "1.1.1.1", 1.0), str)  # a refresh is fine
    assert book.refused["reservation limit"] == 1


def test_reservations_expire_unless_refreshed() -> None:
    book = RelayBook(RelayLimits(reservation_ttl=10))
    r = book.reserve(PEERS[0], "1.1.1.1", 0.0)
    assert not isinstance(r, str) and r.expires == 10.0
    book.reserve(PEERS[0], "1.1.1.1", 8.0)
    assert book.expire(15.0) == []
    assert book.expire(18.0) == [PEERS[0]]
    assert isinstance(book.open_circuit(PEERS[1], PEERS[0], 18.0), str)


def test_circuits_need_a_reservation_and_respect_the_per_peer_limit() -> None:
    book = RelayBook(RelayLimits(max_circuits_per_peer=1, max_circuits=10))
    refusal = book.open_circuit(PEERS[1], PEERS[0], 0.0)
    assert isinstance(refusal, str) and "no reservation" in refusal
    book.reserve(PEERS[0], "1.1.1.1", 0.0)
    circuit = book.open_circuit(PEERS[1], PEERS[0], 0.0)
    assert not isinstance(circuit, str)
    refusal = book.open_circuit(PEERS[2], PEERS[0], 0.0)
    assert isinstance(refusal, str) and "limit 1" in refusal
    book.close_circuit(circuit, "finished")
    assert not isinstance(book.open_circuit(PEERS[2], PEERS[0], 0.0), str)
    assert book.finished[-1].ended == "finished"


def test_a_circuit_over_its_byte_limit_is_cut() -> None:
    book = RelayBook(RelayLimits(circuit_bytes=1000, circuit_duration=60))
    book.reserve(PEERS[0], "1.1.1.1", 0.0)
    circuit = book.open_circuit(PEERS[1], PEERS[0], 0.0)
    assert not isinstance(circuit, str)
    assert circuit.deadline == 60.0
    assert book.account(circuit, 600, True) is None
    reason = book.account(circuit, 600, False)
    assert reason is not None and reason.startswith("relay limit exceeded")
    assert circuit.bytes == 1200


# --- hole punching -----------------------------------------------------------------------------


def test_the_initiator_waits_half_the_round_trip() -> None:
    assert initiator_delay(0.050) == pytest.approx(0.025)
    assert initiator_delay(-1.0) == 0.0


def test_only_direct_ip_addresses_are_punched() -> None:
    relay = Identity.generate().peer_id
    addrs = [
        Multiaddr(f"/ip4/198.51.100.10/tcp/1/p2p/{relay}/p2p-circuit"),
        Multiaddr("/ip4/0.0.0.0/tcp/5"),
        Multiaddr("/dns/example.com/tcp/5"),
        NAT,
        NAT.with_peer_id(PEERS[0]),
        OTHER,
    ]
    assert dial_targets(addrs) == [("203.0.113.7", 31337), ("203.0.113.7", 40000)]


def test_a_peer_behind_our_public_ip_is_dialed_on_its_lan_addresses_first() -> None:
    msg = {
        "type": "connect",
        "addrs": [str(OTHER)],
        "lan": ["/ip4/10.0.1.2/tcp/4002", "/ip4/192.168.1.5/tcp/4002", "/ip4/10.9.9.9/tcp/1"],
    }
    # Same public IP as ours: its private addresses first (two of them at most).
    assert parse_connect(msg, [NAT]) == [
        ("10.0.1.2", 4002), ("192.168.1.5", 4002), ("203.0.113.7", 40000),
    ]  # fmt: skip
    # Another public IP: its private addresses name hosts on someone else's network.
    assert parse_connect(msg, [Multiaddr("/ip4/198.51.100.11/tcp/4001")]) == [
        ("203.0.113.7", 40000)
    ]
    assert parse_connect(msg) == [("203.0.113.7", 40000)]  # we know no public address
    assert parse_connect({"type": "connect", "addrs": [str(OTHER)]}, [NAT]) == [
        ("203.0.113.7", 40000)
    ]  # an older peer sends no "lan"
    with pytest.raises(ProtocolViolation):
        parse_connect({**msg, "lan": "10.0.1.2"}, [NAT])


# --- identify messages -------------------------------------------------------------------------


def test_identify_round_trips_and_rejects_garbage() -> None:
    info = IdentifyInfo("shoal/x", ("/a/1", "/b/1"), (NAT,), (OTHER,), NAT)
    assert IdentifyInfo.from_wire(info.to_wire()) == info
    wire = info.to_wire()
    with pytest.raises(ProtocolViolation, match="version"):
        IdentifyInfo.from_wire({**wire, "v": 2})
    with pytest.raises(ProtocolViolation, match="protocols"):
        IdentifyInfo.from_wire({**wire, "protocols": ["/x"] * 1000})
    with pytest.raises(ProtocolViolation, match="agent"):
        IdentifyInfo.from_wire({**wire, "agent": 5})
    # Unparseable addresses are dropped, not fatal; a relayed "observed" means nothing.
    odd = IdentifyInfo.from_wire({**wire, "listen": ["garbage", str(NAT)], "observed": "/p2p/x"})
    assert odd.listen == (NAT,) and odd.observed is None


def _conn(kind: str, ip: str) -> Any:
    """What `over_lan` reads of a connection: its kind and the far end's address."""
    return SimpleNamespace(kind=kind, remote_address=(ip, 4001))


def test_only_a_hole_punched_lan_peer_or_one_heard_on_our_link_is_over_the_lan() -> None:
    """A peer behind our NAT (hole-punched at its private address) or heard over mDNS
    dials us back over the LAN: no proof the internet can. A peer at a private address
    otherwise (a Docker network, a private cluster: the internet of the peers in it)
    is not, or those peers could never learn they are reachable."""
    heard = {"10.0.1.3"}
    assert over_lan(_conn("hole-punched", "10.0.1.3"))
    assert not over_lan(_conn("hole-punched", "84.17.40.2"))  # (a value: nothing is dialled)
    assert over_lan(_conn("direct", "10.0.1.3"), heard)
    assert not over_lan(_conn("direct", "10.0.1.3"))
    assert not over_lan(_conn("direct", "172.18.0.5"), heard)
    assert not over_lan(_conn("direct", "127.0.0.1"), {"127.0.0.1"})
    assert not over_lan(_conn("relayed", "10.0.1.3"), heard)
