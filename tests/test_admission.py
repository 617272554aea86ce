"""Host admission: half-open connections have slots of their own (transport/admission.py)."""

from __future__ import annotations

from shoal.transport.admission import Admission, AdmissionLimits, subnet_of

LIMITS = AdmissionLimits(
    max_connections=8,
    max_connections_per_ip=4,
    max_connections_per_subnet=6,
    max_pending=4,
    max_pending_per_ip=2,
    max_pending_per_subnet=3,
)


def test_subnets_are_slash_24_and_slash_48() -> None:
    assert subnet_of("203.0.113.7") == "203.0.113.0/24"
    assert subnet_of("::ffff:203.0.113.7") == "203.0.113.0/24"
    assert subnet_of("2001:db8:1:2::5") == "2001:db8:1::/48"
    assert subnet_of("not an address") is None


def test_a_half_open_flood_does_not_take_the_established_slots() -> None:
    adm = Admission(LIMITS)
    # An attacker fills every half-open slot from four /24s...
    attackers = [(f"198.51.{i}.1", f"a{i}") for i in range(4)]
    for ip, key in attackers:
        assert adm.admit(key, ip, inbound=True, now=0).refusal is None
    assert adm.pending == 4
    # ...and an honest peer arriving later still gets in: the oldest half-open goes.
    verdict = adm.admit("honest", "203.0.113.9", inbound=True, now=5)
    assert verdict.refusal is None and verdict.evict == ("a0",)
    assert adm.established("honest") is None
    assert adm.established_count == 1 and adm.evicted == 1
    adm.closed("a0")  # the host aborts it
    assert adm.connections_from("198.51.0.1") == 0


def test_the_crowded_subnet_loses_its_oldest_half_open_connection() -> None:
    adm = Admission(LIMITS)
    adm.admit("lone", "192.0.2.1", inbound=True, now=0)  # the oldest, alone in its /24
    adm.admit("a1", "198.51.100.1", inbound=True, now=1)
    adm.admit("a2", "198.51.100.2", inbound=True, now=2)
    adm.admit("a3", "198.51.100.3", inbound=True, now=3)
    verdict = adm.admit("new", "203.0.113.9", inbound=True, now=4)
    assert verdict.evict == ("a1",)  # not "lone": 198.51.100.0/24 holds three
    assert adm.pending == 4
    # A newcomer from the most crowded subnet is refused rather than evict anyone.
    assert adm.admit("a4", "198.51.100.4", inbound=True, now=5).refusal == (
        "handshake slots (4) full"
    )


def test_per_ip_and_per_subnet_half_open_caps_refuse_the_sources_own() -> None:
    adm = Admission(LIMITS)
    assert adm.admit(1, "198.51.100.1", inbound=True, now=0).refusal is None
    assert adm.admit(2, "198.51.100.1", inbound=True, now=0).refusal is None
    assert "per-IP handshake" in (adm.admit(3, "198.51.100.1", inbound=True, now=0).refusal or "")
    assert adm.admit(4, "198.51.100.2", inbound=True, now=0).refusal is None
    assert "per-subnet handshake" in (
        adm.admit(5, "198.51.100.3", inbound=True, now=0).refusal or ""
    )
    adm.established(1)  # a finished handshake frees its half-open slot
    assert adm.admit(6, "198.51.100.3", inbound=True, now=0).refusal is None


def test_established_caps_and_outbound_connections() -> None:
    adm = Admission(LIMITS)
    for i in range(6):
        assert adm.admit(i, f"198.51.100.{i}", inbound=True, now=0).refusal is None
        assert adm.established(i) is None
    assert "per-subnet connection" in (
        adm.admit(9, "198.51.100.9", inbound=True, now=0).refusal or ""
    )
    for i in range(2):  # we dialed: never refused, but counted
        assert adm.admit(f"out{i}", f"192.0.2.{i}", inbound=False, now=0).refusal is None
    assert adm.established_count == 8
    # At the limit its handshake runs (its peer may be a round's member), then it is
    # refused: it is not.
    assert adm.admit("x", "192.0.2.77", inbound=True, now=0).refusal is None
    assert adm.established("x") == "connection limit (8) reached"
    adm.closed("x")
    adm.closed("out0")
    assert adm.admit("x", "192.0.2.77", inbound=True, now=0).refusal is None
    assert adm.established("x") is None


def test_a_handshake_finishing_after_the_slots_filled_is_refused_then() -> None:
    adm = Admission(AdmissionLimits(max_connections=1, max_pending=4))
    adm.admit("a", "198.51.100.1", inbound=True, now=0)
    adm.admit("b", "198.51.100.2", inbound=True, now=0)
    assert adm.established("a") is None
    assert adm.established("b") == "connection limit (1) reached"
    adm.closed("b")
    assert adm.established_count == 1 and adm.pending == 0


def test_loopback_is_exempt_from_the_new_caps_but_not_from_the_old() -> None:
    adm = Admission(LIMITS)
    for i in range(4):  # beyond max_pending_per_ip: exempt
        assert adm.admit(i, "127.0.0.1", inbound=True, now=0).refusal is None
    assert adm.pending == 0
    assert "per-IP connection" in (adm.admit(9, "127.0.0.1", inbound=True, now=0).refusal or "")
    strict = Admission(AdmissionLimits(max_pending_per_ip=1, exempt_loopback=False))
    strict.admit(1, "127.0.0.2", inbound=True, now=0)
    assert "per-IP handshake" in (strict.admit(2, "127.0.0.2", inbound=True, now=0).refusal or "")


def test_a_connection_we_close_gives_its_slot_at_once_within_a_bound_on_draining_ones() -> None:
    """A trimmed connection drains for seconds (streams in flight served, then its
    socket closes): a newcomer at the limit takes its slot meanwhile, not a refusal.
    Past `max_draining` closing ones, a closing one keeps its slot until it closes."""
    adm = Admission(AdmissionLimits(max_connections=2, max_draining=1))
    for key in ("a", "b"):
        adm.admit(key, f"198.51.100.{len(key)}", inbound=False, now=0)
    adm.admit("c", "192.0.2.1", inbound=True, now=0)
    assert adm.established("c") == "connection limit (2) reached"
    adm.closed("c")
    adm.draining("a")
    assert adm.established_count == 1 and adm.draining_count == 1 and not adm.can_drain
    assert adm.admit("c", "192.0.2.1", inbound=True, now=0).refusal is None
    assert adm.established("c") is None
    adm.draining("b")  # past the bound: still counted
    assert adm.established_count == 2 and adm.draining_count == 1
    adm.closed("a")  # the drained socket closed
    assert adm.draining_count == 0 and adm.can_drain and adm.established_count == 2
    adm.draining("b")
    adm.draining("b")  # (once only)
    adm.closed("b")
    assert adm.established_count == 1 and adm.draining_count == 0
    adm.draining("nobody")  # (unknown keys and half-open ones: nothing to drain)
    adm.admit("d", "192.0.2.9", inbound=True, now=0)
    adm.draining("d")
    assert adm.pending == 1 and adm.draining_count == 0
    assert Admission(AdmissionLimits(max_connections=1024)).can_drain  # (an eighth: 128)


def at_the_limit(**limits: object) -> Admission:
    """An admission at its limit of 2 established connections, both ours (dialed)."""
    adm = Admission(AdmissionLimits(max_connections=2, **limits))  # type: ignore[arg-type]
    for i in range(2):
        adm.admit(f"out{i}", f"192.0.2.{i}", inbound=False, now=0)
    return adm


def test_at_the_limit_a_handshake_runs_and_only_a_protected_peer_gets_in() -> None:
    """A round's member dialing a host at its limit was refused before its handshake
    named it; now its handshake runs, and a protected peer is let in past the limit."""
    adm = at_the_limit()
    assert adm.admit("member", "198.51.100.1", inbound=True, now=0).refusal is None
    assert adm.admit("stranger", "203.0.113.1", inbound=True, now=0).refusal is None
    assert adm.pending_at_limit == 2
    assert adm.established("member", protected=True) is None
    assert adm.established("stranger") == "connection limit (2) reached"
    adm.closed("stranger")
    assert adm.established_count == 3 and adm.pending == 0 and adm.pending_at_limit == 0
    # Room made meanwhile: one admitted at the limit gets in like anyone.
    adm.admit("late", "203.0.113.2", inbound=True, now=1)
    adm.closed("out0")
    adm.closed("out1")
    assert adm.established("late") is None


def test_the_reserve_at_the_limit_is_bounded_one_per_ip_and_fair_to_subnets() -> None:
    adm = at_the_limit(max_pending_at_limit=3)
    assert adm.admit("a1", "198.51.100.1", inbound=True, now=0).refusal is None
    # One handshake per address at the limit.
    assert adm.admit("a1'", "198.51.100.1", inbound=True, now=0).refusal == (
        "connection limit (2) reached"
    )
    adm.admit("a2", "198.51.100.2", inbound=True, now=1)
    adm.admit("b1", "192.0.2.77", inbound=True, now=2)
    assert adm.pending_at_limit == 3
    # Full: one from the most crowded subnet waits; one from another takes its oldest.
    assert adm.admit("a3", "198.51.100.3", inbound=True, now=3).refusal == (
        "connection limit (2) reached"
    )
    verdict = adm.admit("c1", "203.0.113.1", inbound=True, now=4)
    assert verdict.refusal is None and verdict.evict == ("a1",)
    adm.closed("a1")  # the host aborts it
    assert adm.pending_at_limit == 3 and adm.pending == 3 and adm.evicted == 1
    for key in ("a2", "b1", "c1"):
        assert adm.established(key) == "connection limit (2) reached"
        adm.closed(key)
    assert (
        adm.pending_at_limit == 0 and adm.pending == 0 and adm.connections_from("198.51.100.2") == 0
    )


def test_without_a_reserve_the_limit_refuses_before_the_handshake() -> None:
    adm = at_the_limit(max_pending_at_limit=0)
    assert adm.admit("x", "198.51.100.1", inbound=True, now=0).refusal == (
        "connection limit (2) reached"
    )


def test_loopback_past_the_limit_gets_in_only_if_protected() -> None:
    """Exempt loopback half-open connections were never refused after the handshake;
    one admitted at the limit is, unless protected: no way past the limit by loopback."""
    adm = at_the_limit()
    adm.admit("lo1", "127.0.0.1", inbound=True, now=0)
    assert adm.established("lo1") == "connection limit (2) reached"
    adm.closed("lo1")
    adm.admit("lo2", "127.0.0.1", inbound=True, now=0)
    assert adm.established("lo2", protected=True) is None
    assert adm.established_count == 3
