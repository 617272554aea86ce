"""NAT traversal through real Linux NAT routers (network namespaces from ../shared/lab/lab.sh).

Each test builds its own lab under its own LAB_PREFIX and tears it down even when it
fails; peers are tests/nat_peer.py processes inside the namespaces, with the default
NatConfig unless a test says otherwise.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from lab import NAT_IP, PUB_IP, Lab, LabError, LabPeer, lab_unavailable

_UNAVAILABLE = lab_unavailable()
pytestmark = [
    pytest.mark.lab,
    pytest.mark.skipif(_UNAVAILABLE is not None, reason=_UNAVAILABLE or ""),
]

PUB_PORT = 4001
A1_IP = "10.0.1.2"  # the host behind natA (../shared/lab/README.md)
INET = "198.51.100.0/24"  # the lab's public internet
TRIALS = 10


async def start_pub(lab: Lab, **cfg: Any) -> tuple[LabPeer, str]:
    pub = await lab.spawn("pub")
    r = await pub.call("start", listen=f"/ip4/0.0.0.0/tcp/{PUB_PORT}", **cfg)
    return pub, f"/ip4/{PUB_IP}/tcp/{PUB_PORT}/p2p/{r['peer_id']}"


async def start_private(peer: LabPeer, pub_addr: str, **cfg: Any) -> dict[str, Any]:
    """A fresh session (new identity and port) connected to the public peer."""
    started = await peer.call("start", **cfg)
    await peer.call("connect", addr=pub_addr)
    return started


async def relay_address(peer: LabPeer, timeout: float = 10.0) -> str:
    w = await peer.call("wait", what="relay_addr", timeout=timeout)
    assert w["met"], f"{peer.name} got no relay reservation: {await peer.call('status')}"
    status = await peer.call("status")
    (addr,) = [a for a in status["advertised_addresses"] if "/p2p-circuit/" in a]
    return addr


def circuits_between(status: dict[str, Any], x: str, y: str) -> tuple[list[Any], list[Any]]:
    relay = status["relay_service"]
    pair = {x, y}
    active = [c for c in relay["circuits"] if {c["src"], c["dst"]} == pair]
    finished = [c for c in relay["finished"] if {c["src"], c["dst"]} == pair]
    return active, finished


async def test_a_peer_behind_nat_finds_itself_private_and_the_public_peer_public() -> None:
    async with Lab("n1-") as lab:
        pub, pub_addr = await start_pub(lab)
        a = await lab.spawn("a1")
        started = await start_private(a, pub_addr)
        port = started["listen"][0].rsplit("/", 1)[1]
        assert (await a.call("wait", what="reachability", value="private", timeout=10))["met"]
        assert (await pub.call("wait", what="reachability", value="public", timeout=10))["met"]
        st = await a.call("status")
        # What the public peer sees: the router's address, with our port (plain MASQUERADE
        # keeps it, and we dial from the listen port). One observer is below the default
        # trust threshold (2): it is a candidate, enough to probe and to punch with.
        assert st["observed_addresses"] == [
            {"addr": f"/ip4/{NAT_IP['A']}/tcp/{port}", "observers": 1, "trusted": False}
        ]
        assert st["confirmed_addresses"] == []
        assert not st["autonat"]["results"][-1]["ok"]
        relay_addr = await relay_address(a)
        # Only confirmed addresses are advertised: a private peer has only its relay address.
        assert (await a.call("status"))["advertised_addresses"] == [relay_addr]
        assert relay_addr.startswith(pub_addr + "/p2p-circuit/p2p/")
        pst = await pub.call("status")
        assert pst["confirmed_addresses"] == [pub_addr]
        assert pst["advertised_addresses"] == [pub_addr]
        assert pst["autonat"]["results"][-1]["ok"]


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("prefix", "harsh"),
    [("n2-", False), ("n3-", True)],
    ids=["masquerade", "natA-reject-25ms"],
)
async def test_peers_behind_two_nats_meet_through_the_relay_then_punch(
    prefix: str, harsh: bool
) -> None:
    async with Lab(prefix) as lab:
        if harsh:
            # natA answers unsolicited packets with RST, and its uplink adds 25 ms each
            # way: only SYNs that cross in flight get through (the RTT/2 wait matters).
            lab.sh("inbound", "natA", "reject")
            lab.sh("delay", "natA", "25", "0", "400")
        pub, pub_addr = await start_pub(lab)
        a, c = await lab.spawn("a1"), await lab.spawn("c1")
        outcomes = []
        for _ in range(TRIALS):
            ra = await start_private(a, pub_addr)
            await start_private(c, pub_addr)
            addr = await relay_address(a)
            assert (await c.call("connect", addr=addr))["kind"] == "relayed"
            direct = await c.call("wait", what="direct", value=ra["peer_id"], timeout=12)
            outcomes.append(direct["met"])
            if not direct["met"]:
                continue
            # After the switch the relayed connection closes and the relay's byte count
            # for the pair stops growing while they keep talking.
            cid = (await c.call("status"))["peer_id"]
            assert (await c.call("wait", what="no_relayed", value=ra["peer_id"], timeout=10))["met"]
            pair = [cid, ra["peer_id"]]
            assert (await pub.call("wait", what="no_circuit", value=pair, timeout=10))["met"]
            active, finished = circuits_between(await pub.call("status"), cid, ra["peer_id"])
            assert active == [] and len(finished) == 1
            before = finished[0]["bytes"]
            sent = await c.call("send", peer=ra["peer_id"], nbytes=2_000_000)
            assert sent["kind"] == "hole-punched" and sent["bytes"] == 2_000_000
            active, finished = circuits_between(await pub.call("status"), cid, ra["peer_id"])
            assert active == [] and finished[0]["bytes"] == before
        print(f"hole punching ({prefix}): {sum(outcomes)}/{TRIALS}")
        assert sum(outcomes) >= 9, outcomes


@pytest.mark.timeout(120)
async def test_two_peers_behind_one_nat_punch_over_their_lan_and_outlive_a_cut_uplink() -> None:
    # natA does not hairpin: a SYN from inside to its own public address is dropped, so
    # the public targets alone never connect two peers behind it (they stayed on the
    # relay, and lost each other with it when the uplink was cut).
    async with Lab("n7-") as lab:
        _, pub_addr = await start_pub(lab)
        a, b = await lab.spawn("a1"), await lab.spawn("a1")
        ra = await start_private(a, pub_addr)
        await start_private(b, pub_addr)
        addr = await relay_address(a)
        assert (await b.call("connect", addr=addr))["kind"] == "relayed"
        assert (await b.call("wait", what="direct", value=ra["peer_id"], timeout=12))["met"]
        stats = (await b.call("conn", peer=ra["peer_id"]))["stats"]
        assert stats["kind"] == "hole-punched"
        assert stats["remote_address"][0] == A1_IP  # over the LAN, not through natA
        # What a LAN neighbour sees of us says nothing of the internet: neither takes its
        # LAN address for a public one (nor gets "dialed back" there and turns public).
        for peer, other in ((a, (await b.call("status"))["peer_id"]), (b, ra["peer_id"])):
            # (b's own dial-back may still be out when the punch is done: wait for it)
            assert (await peer.call("wait", what="reachability", value="private"))["met"]
            assert (await peer.call("wait", what="identified_direct", value=other))["met"]
            st = await peer.call("status")
            assert not any(A1_IP in o["addr"] for o in st["observed_addresses"]), st
            assert st["reachability"] == "private"
        # Cut the NAT's side of the internet: the pair keeps talking.
        lab.sh("exec", lab.ns("a1"), "iptables", "-A", "OUTPUT", "-d", INET, "-j", "DROP")
        sent = await b.call("send", peer=ra["peer_id"], nbytes=2_000_000, timeout=20)
        assert sent["kind"] == "hole-punched" and sent["bytes"] == 2_000_000


@pytest.mark.timeout(120)
async def test_behind_a_symmetric_nat_peers_stay_on_the_relay() -> None:
    async with Lab("n4-") as lab:
        pub, pub_addr = await start_pub(lab)
        a, b = await lab.spawn("a1"), await lab.spawn("b1")
        ra = await start_private(a, pub_addr)
        rb = await start_private(b, pub_addr)
        addr_b = await relay_address(b)
        await relay_address(a)
        assert (await a.call("connect", addr=addr_b))["kind"] == "relayed"
        # b accepted the relayed connection, so b punches: --random-fully defeats it.
        assert (await b.call("wait", what="punch_done", timeout=30))["met"]
        (result,) = (await b.call("status"))["hole_punching"]["results"]
        assert not result["success"] and result["attempts"] == 3
        assert (await a.call("echo", peer=rb["peer_id"], n=20))["kinds"] == ["relayed"]
        assert (await b.call("echo", peer=ra["peer_id"], n=20))["kinds"] == ["relayed"]
        for x, y in ((a, rb), (b, ra)):
            sent = await x.call("send", peer=y["peer_id"], nbytes=50_000_000, timeout=120)
            assert sent["bytes"] == 50_000_000 and sent["kind"] == "relayed"
        active, _ = circuits_between(await pub.call("status"), ra["peer_id"], rb["peer_id"])
        assert len(active) == 1 and active[0]["bytes"] > 100_000_000


@pytest.mark.timeout(120)
async def test_a_dht_of_the_public_peer_and_three_private_ones() -> None:
    async with Lab("n5-") as lab:
        pub, pub_addr = await start_pub(lab)
        await pub.call("dht_start")
        peers = {"pub": pub}
        for ns in ("a1", "b1", "c1"):
            peers[ns] = await lab.spawn(ns)
            await start_private(peers[ns], pub_addr)
        for ns in ("a1", "b1", "c1"):
            await relay_address(peers[ns])  # reachable (through the relay) before joining
            await peers[ns].call("dht_start", bootstrap=[pub_addr])
        for name, peer in peers.items():
            assert (await peer.call("dht_store", key=f"key-{name}", value=f"from {name}"))["stored"]
        for reader_name, reader in peers.items():
            for name in peers:
                got = await reader.call("dht_get", key=f"key-{name}")
                assert got["value"] == f"from {name}", (reader_name, name)
        # Private peers advertised no LAN address: only relay (or confirmed) addresses.
        for peer in peers.values():
            snapshot = json.dumps((await peer.call("dht_snapshot"))["snapshot"])
            assert "/ip4/10.0." not in snapshot
        # ... and they are clients, not hops: the public peer's table holds none of them.
        table = json.dumps((await pub.call("dht_snapshot"))["snapshot"])
        for ns in ("a1", "b1", "c1"):
            assert (await peers[ns].call("status"))["peer_id"] not in table


@pytest.mark.timeout(120)
async def test_the_relay_enforces_its_limits_and_peers_see_why() -> None:
    async with Lab("n6-") as lab:
        limits = {"max_reservations": 1, "circuit_bytes": 2_000_000, "circuit_duration": 2.0}
        _, pub_addr = await start_pub(lab, relay_limits=limits)
        a, b, c = await lab.spawn("a1"), await lab.spawn("b1"), await lab.spawn("c1")
        ra = await start_private(a, pub_addr, hole_punching=False)
        addr_a = await relay_address(a)
        await start_private(b, pub_addr, hole_punching=False)
        assert (await b.call("wait", what="reachability", value="private", timeout=10))["met"]
        errors: dict[str, str] = {}
        for _ in range(50):
            errors = (await b.call("status"))["reservation_errors"]
            if errors:
                break
            await b.call("wait", what="relay_addr", timeout=0.2)
        assert "reservation limit (1) reached" in next(iter(errors.values()))
        await start_private(c, pub_addr, hole_punching=False)
        # Over the byte limit: the relay cuts the connection, both ends learn why.
        assert (await c.call("connect", addr=addr_a))["kind"] == "relayed"
        with pytest.raises(LabError, match=r"RelayLimitExceeded.*more than 2000000 bytes"):
            await c.call("send", peer=ra["peer_id"], nbytes=10_000_000)
        # Over the time limit: an idle relayed connection is cut after 2 s.
        assert (await c.call("connect", addr=addr_a))["kind"] == "relayed"
        held = await c.call("hold", peer=ra["peer_id"], timeout=10)
        assert held["error"].startswith("RelayLimitExceeded") and "duration 2s" in held["error"]
        assert 1.5 < held["elapsed_s"] < 5
