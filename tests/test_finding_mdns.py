"""mDNS discovery (zeroconf) on the loopback interface: peers with no bootstrap find each
other and connect; what an announcement claims is bounded and checked by the handshake.

Multicast works on this machine's `lo` for zeroconf bound to 127.0.0.1 (the
interface has no MULTICAST flag, but the kernel loops the group traffic back),
so two peers in one process stand for two machines of one LAN. Each test uses
its own network name: parallel tests announce on the same link and must not
join each other.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import TINY_TASK, Daemon, cli_env_path, wait_for
from waiting import eventually

from shoal.dht.node import DHTNode
from shoal.peer.doctor import network_check
from shoal.peer.finding import Found, mdns_interfaces
from shoal.peer.finding.lan import LanFinder
from shoal.peer.finding.mdns import (
    MAX_ADDRS,
    MdnsDiscovery,
    announcement,
    parse_announcement,
)
from shoal.transport.identity import Identity
from shoal.transport.multiaddr import Multiaddr

pytestmark = pytest.mark.timeout(30)

LOOPBACK = ["127.0.0.1"]


def _network() -> str:
    return f"test-{uuid.uuid4().hex[:12]}"


def _props(values: dict[str, str]) -> dict[bytes, bytes | None]:
    return {k.encode(): v.encode() for k, v in values.items()}


def test_an_announcement_round_trips_and_every_address_carries_the_announced_id() -> None:
    peer = Identity.generate().peer_id
    addrs = [Multiaddr(f"/ip4/127.0.0.1/tcp/{4000 + i}") for i in range(MAX_ADDRS + 3)]
    parsed, why = parse_announcement(_props(announcement(peer, "lan", addrs, True)), "lan")
    assert parsed is not None, why
    assert parsed.peer_id == peer and parsed.settled
    assert len(parsed.addrs) == MAX_ADDRS
    assert all(a.peer_id == peer for a in parsed.addrs)


def test_a_lying_announcement_is_refused_or_trimmed() -> None:
    peer, other = Identity.generate().peer_id, Identity.generate().peer_id
    good = announcement(peer, "lan", [Multiaddr("/ip4/127.0.0.1/tcp/4001")], False)

    def parse(**changes: str) -> Any:
        return parse_announcement(_props(good | changes), "lan")[0]

    assert parse(net="other") is None  # another network's peer
    assert parse(id="not-a-peer-id") is None
    assert parse(a0="/ip4/999.0.0.1/tcp/1") is None  # no valid address left
    assert parse(a0=f"/ip4/127.0.0.1/tcp/1/p2p/{other}") is None  # someone else's address
    relayed = f"/ip4/127.0.0.1/tcp/1/p2p/{other}/p2p-circuit"
    assert parse(a0=relayed) is None  # only direct addresses of the announcer
    flood = _props(good | {f"x{i}": "1" for i in range(40)})
    assert parse_announcement(flood, "lan")[0] is None
    assert parse_announcement({**_props(good), b"net": b"\xff"}, "lan")[0] is None
    kept = parse(a1="/ip4/127.0.0.1/tcp/1/p2p/" + str(other), a2="x" * 300)
    assert kept is not None and [str(a) for a in kept.addrs] == [
        f"/ip4/127.0.0.1/tcp/4001/p2p/{peer}"
    ]


def test_mdns_runs_on_the_interfaces_listened_on_and_off_for_a_loopback_only_peer() -> None:
    loopback = [Multiaddr("/ip4/127.0.0.1/tcp/0")]
    assert mdns_interfaces("auto", loopback) is False
    assert mdns_interfaces("on", loopback) == LOOPBACK
    assert mdns_interfaces("auto", [Multiaddr("/ip4/0.0.0.0/tcp/0")]) is None  # all
    assert mdns_interfaces("auto", [Multiaddr("/ip4/192.168.1.5/tcp/0")]) == ["192.168.1.5"]
    assert mdns_interfaces("off", [Multiaddr("/ip4/0.0.0.0/tcp/0")]) is False
    assert mdns_interfaces("127.0.0.1", []) == LOOPBACK


async def test_two_peers_with_no_bootstrap_find_each_other_over_mdns_and_connect(
    make_host: Callable[..., Any],
) -> None:
    network = _network()
    host_a, host_b = await make_host(), await make_host()
    lan_a, lan_b = LanFinder(host_a, network, LOOPBACK), LanFinder(host_b, network, LOOPBACK)
    dht_a = dht_b = None
    try:
        await lan_a.start()
        dht_a = await DHTNode.create(host_a, hop_timeout=0.5)  # the first: alone
        lan_a.attach(dht_a)
        await lan_a.settled()
        await lan_b.start()
        heard, joins = await lan_b.first_peers(10.0)
        assert heard and all(a.peer_id == host_a.peer_id for a in heard)
        assert joins  # A has settled: B joins its experiment rather than hosting one
        dht_b = await DHTNode.create(host_b, bootstrap=heard, hop_timeout=0.5)
        lan_b.attach(dht_b)
        assert host_a.peer_id in {c.peer_id for c in dht_b.routing_table}
        await eventually(
            lambda: host_b.peer_id in {c.peer_id for c in dht_a.routing_table},
            "A lists B after B joined it",
        )
    finally:
        for dht in (dht_a, dht_b):
            if dht is not None:
                await dht.aclose()
        await asyncio.gather(lan_a.aclose(), lan_b.aclose())


async def test_two_networks_started_apart_on_one_lan_merge_once_they_hear_each_other(
    make_host: Callable[..., Any],
) -> None:
    network = _network()
    hosts = [await make_host(), await make_host()]
    dhts = [await DHTNode.create(h, hop_timeout=0.5) for h in hosts]  # each alone
    lans = [LanFinder(h, network, LOOPBACK) for h in hosts]
    try:
        for lan, dht in zip(lans, dhts, strict=True):
            lan.attach(dht)
            await lan.start()
        await asyncio.gather(*(lan.settled() for lan in lans))  # each says it is up
        await eventually(
            lambda: all(
                other.peer_id in {c.peer_id for c in dht.routing_table}
                for dht, other in zip(dhts, reversed(hosts), strict=True)
            ),
            "each DHT lists the other peer",
            timeout=15,
        )
    finally:
        await asyncio.gather(*(d.aclose() for d in dhts))
        await asyncio.gather(*(lan.aclose() for lan in lans))


async def test_an_announcement_that_claims_another_id_is_not_joined(
    make_host: Callable[..., Any],
) -> None:
    """A liar announces the address of a real peer (A) under an ID it made up: the
    joiner dials A expecting that ID, A's handshake proves another, and nothing joins."""
    network = _network()
    host_a, host_b = await make_host(), await make_host()
    made_up = Identity.generate().peer_id
    liar = MdnsDiscovery(
        made_up, network, addrs=lambda: [host_a.addresses()[0]], interfaces=LOOPBACK
    )
    lan_b = LanFinder(host_b, network, LOOPBACK)
    dht_b = await DHTNode.create(host_b, hop_timeout=0.5)
    try:
        await liar.start()
        await liar.settled()  # claims to be up, so that B tries to join it
        await lan_b.start()
        heard, _ = await lan_b.first_peers(10.0)
        assert [a.peer_id for a in heard] == [made_up]
        lan_b.attach(dht_b)
        await eventually(lambda: lan_b.joins_failed == 1, "the join failed", timeout=12)
        assert len(dht_b.routing_table) == 0
        assert host_b.connection(made_up) is None and host_b.connection(host_a.peer_id) is None
    finally:
        await dht_b.aclose()
        await asyncio.gather(liar.aclose(), lan_b.aclose())


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_two_daemons_with_no_bootstrap_find_each_other_over_mdns_and_average(
    tmp_path: Path,
) -> None:
    """`shoal run` twice, no --bootstrap, nothing remembered, mDNS on the loopback
    interface: the first hosts the default experiment, the second hears it (settled),
    joins it, and both commit the same round."""
    env = {
        "SHOAL_MDNS": "127.0.0.1",
        "SHOAL_NETWORK": _network(),
        "SHOAL_INNER_STEPS": "5",
        "SHOAL_TASK_OPTIONS": TINY_TASK,
        "SHOAL_STRATEGY_OPTIONS": "matchmaking_time=2,round_timeout=15,stall_timeout=3",
    }
    first = Daemon("first", tmp_path, [], env)
    daemons = [first]
    try:
        first.wait_ready()
        assert "starting a new network" in first.log()
        second = Daemon("second", tmp_path, [], env)
        daemons.append(second)
        second.wait_ready()
        assert "joined the peers found over mDNS" in second.log(), second.tail()
        assert second.join_ref == first.join_ref  # the same experiment, hosted by the first

        def a_round_of_both() -> list[int]:
            rounds = [first.committed_rounds(), second.committed_rounds()]
            return [s for s in rounds[0] if s in rounds[1] and rounds[0][s] == rounds[1][s]]

        wait_for(
            "a round committed by both with one fingerprint",
            a_round_of_both,
            60,
            debug=lambda: first.tail(15) + "\n" + second.tail(15),
        )
    finally:
        for d in daemons:
            d.kill()


async def test_experiments_finds_its_first_peer_over_mdns(
    make_host: Callable[..., Any], tmp_path: Path
) -> None:
    """`shoal experiments` with no --bootstrap, an unlisted network and nothing remembered
    asks the peer it hears over mDNS (here: a DHT peer with no experiment yet)."""
    network = _network()
    host = await make_host()
    dht = await DHTNode.create(host, hop_timeout=0.5)
    lan = LanFinder(host, network, LOOPBACK)
    try:
        await lan.start()
        lan.attach(dht)
        await lan.settled()
        env = cli_env_path(tmp_path) | {"SHOAL_MDNS": "127.0.0.1", "SHOAL_NETWORK": network}
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "shoal.peer", "experiments", "--json",
            "--data-dir", str(tmp_path / "data"),
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip
        out, err = await asyncio.wait_for(proc.communicate(), 25)
        assert proc.returncode == 0, err.decode()
        assert json.loads(out) == []
    finally:
        await dht.aclose()
        await lan.aclose()


def test_doctor_names_the_peers_heard_over_mdns() -> None:
    peer = str(Identity.generate().peer_id)
    found = Found("lan", "network lan (no list: neither shipped nor in --networks)")
    found.mdns_on = True
    found.mdns = [(peer, [f"/ip4/192.168.1.5/tcp/31337/p2p/{peer}"])]
    found.addrs = [Multiaddr(found.mdns[0][1][0])]
    check = network_check(found)
    assert check.verdict == "ok"
    assert check.detail.startswith("lan: network lan")
    assert f"mDNS: 1 peers ({peer[:16]})" in check.detail
    nothing = network_check(Found("public", "network public"))
    assert nothing.verdict == "warn" and "its list is empty" in nothing.detail


async def test_two_peers_starting_together_pick_the_lower_peer_id_as_host(
    make_host: Callable[..., Any],
) -> None:
    network = _network()
    hosts = sorted([await make_host(), await make_host()], key=lambda h: h.peer_id.to_bytes())
    lans = [LanFinder(h, network, LOOPBACK) for h in hosts]  # neither says it is up
    try:
        for lan in lans:
            await lan.start()
        (heard_low, low_joins), (heard_high, high_joins) = await asyncio.gather(
            *(lan.first_peers(10.0) for lan in lans)
        )
        assert heard_low and heard_high
        assert not low_joins  # the lower ID hosts the default experiment ...
        assert high_joins  # ... and the other joins it
    finally:
        await asyncio.gather(*(lan.aclose() for lan in lans))
