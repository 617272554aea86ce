"""`/dnsaddr/` bootstrap names, resolved through a DNS server on loopback, and named networks.

The DNS server is `dns_server.py` (authoritative, UDP, TXT records from a dict);
what it serves is a claim like any answer from the internet: the lying server
of the last tests gets bounded, never believed past the limits.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import Daemon, cli_env_path
from dns_server import Zone, dns_server

from shoal.dht.node import DHTNode
from shoal.peer.config import ConfigError, build_config
from shoal.peer.finding import find_bootstrap
from shoal.peer.finding.networks import NetworkError, load_networks, parse_entry
from shoal.transport import dnsaddr
from shoal.transport.dnsaddr import DnsaddrName, resolve_dnsaddr
from shoal.transport.identity import Identity

pytestmark = pytest.mark.timeout(30)


def _txt(value: str) -> bytes:
    return value.encode()


async def test_a_dnsaddr_name_resolves_nested_records_and_skips_what_it_cannot_dial() -> None:
    a, b = Identity.generate().peer_id, Identity.generate().peer_id
    zone = Zone(
        {
            "_dnsaddr.test.example": [
                _txt("dnsaddr=/dnsaddr/nested.test.example"),
                _txt("v=spf1 -all"),  # another use of the name: ignored
                _txt(f"dnsaddr=/ip4/127.0.0.1/tcp/4001/p2p/{a}"),
            ],
            "_dnsaddr.nested.test.example": [
                _txt(f"dnsaddr=/ip4/127.0.0.1/udp/4001/quic-v1/p2p/{b}"),  # not ours to dial
                _txt(f"dnsaddr=/ip4/127.0.0.1/tcp/4002/p2p/{b}"),
            ],
        }
    )
    async with dns_server(zone) as server:
        result = await resolve_dnsaddr(
            DnsaddrName.parse("/dnsaddr/test.example"), nameservers=[server]
        )
        only_b = await resolve_dnsaddr(
            DnsaddrName.parse(f"/dnsaddr/test.example/p2p/{b}"), nameservers=[server]
        )
    assert [str(x) for x in result.addrs] == [
        f"/ip4/127.0.0.1/tcp/4001/p2p/{a}",
        f"/ip4/127.0.0.1/tcp/4002/p2p/{b}",
    ]
    assert any("udp" in p for p in result.problems)
    assert [str(x) for x in only_b.addrs] == [f"/ip4/127.0.0.1/tcp/4002/p2p/{b}"]


async def test_a_peer_joins_through_a_dnsaddr_bootstrap_resolved_on_loopback(
    make_host: Callable[..., Any],
) -> None:
    first = await DHTNode.create(await make_host(), hop_timeout=0.5)
    joiner_host = await make_host()
    zone = Zone({"_dnsaddr.test.example": [_txt(f"dnsaddr={first.host.addresses()[0]}")]})
    try:
        async with dns_server(zone) as server:
            found = await find_bootstrap(
                [parse_entry(f"/dnsaddr/test.example/p2p/{first.host.peer_id}")],
                nameservers=[server],
            )
        assert found.addrs == [first.host.addresses()[0]]
        joiner = await DHTNode.create(joiner_host, bootstrap=found.addrs, hop_timeout=0.5)
        try:
            assert first.host.peer_id in {c.peer_id for c in joiner.routing_table}
        finally:
            await joiner.aclose()
    finally:
        await first.aclose()


async def test_a_lying_dns_server_is_bounded_in_records_depth_lookups_and_size() -> None:
    peer = Identity.generate().peer_id
    good = _txt(f"dnsaddr=/ip4/127.0.0.1/tcp/4001/p2p/{peer}")
    zone = Zone(
        {
            # 500 records in one answer: the first MAX_RECORDS are read.
            "_dnsaddr.many.example": [
                _txt(f"dnsaddr=/ip4/127.0.0.1/tcp/{10000 + i}/p2p/{peer}") for i in range(500)
            ],
            # A chain 20 deep, and a name that names itself.
            **{
                f"_dnsaddr.d{i}.example": [_txt(f"dnsaddr=/dnsaddr/d{i + 1}.example"), good]
                for i in range(20)
            },
            "_dnsaddr.loop.example": [_txt("dnsaddr=/dnsaddr/loop.example"), good],
            # A fan-out of 32 names with 32 names each: the lookups are capped.
            "_dnsaddr.fan.example": [_txt(f"dnsaddr=/dnsaddr/f{i}.example") for i in range(32)],
            **{
                f"_dnsaddr.f{i}.example": [
                    _txt(f"dnsaddr=/dnsaddr/g{i}-{j}.example") for j in range(32)
                ]
                for i in range(32)
            },
            # Garbage beside one good record.
            "_dnsaddr.garbage.example": [
                b"dnsaddr=\xff\xfe/ip4",
                (b"dnsaddr=/ip4/127.0.0.1/tcp/1/" + b"x" * 200, b"y" * 255, b"z" * 255, b"w" * 255),
                _txt("dnsaddr=/ip4/999.1.1.1/tcp/1"),
                _txt("dnsaddr=/dnsaddr/bad..name"),
                _txt("dnsaddr=/ip4/127.0.0.1"),
                good,
            ],
        },
        silent={"_dnsaddr.silent.example"},
    )
    async with dns_server(zone) as server:

        async def resolve(name: str, **kw: Any) -> dnsaddr.DnsaddrResult:
            return await resolve_dnsaddr(DnsaddrName.parse(name), nameservers=[server], **kw)

        many = await resolve("/dnsaddr/many.example")
        assert len(many.addrs) == dnsaddr.MAX_RECORDS
        assert any("ignored" in p for p in many.problems)

        zone.queries.clear()
        deep = await resolve("/dnsaddr/d0.example")
        assert len(zone.queries) == dnsaddr.MAX_DEPTH + 1
        assert deep.addrs and any("deeper" in p for p in deep.problems)

        zone.queries.clear()
        loop = await resolve("/dnsaddr/loop.example")
        assert zone.queries == ["_dnsaddr.loop.example"] and len(loop.addrs) == 1

        zone.queries.clear()
        fan = await resolve("/dnsaddr/fan.example")
        assert len(zone.queries) == dnsaddr.MAX_LOOKUPS and fan.addrs == []

        garbage = await resolve("/dnsaddr/garbage.example")
        assert [str(a) for a in garbage.addrs] == [good.decode()[len("dnsaddr=") :]]
        assert len(garbage.problems) == 5

        silent = await resolve("/dnsaddr/silent.example", timeout=0.5)
        assert silent.addrs == [] and silent.problems


def test_bootstrap_takes_dnsaddr_names_and_a_network_comes_from_the_shipped_or_users_list(
    tmp_path: Path,
) -> None:
    peer = Identity.generate().peer_id
    config = build_config(
        ["bootstrap", "network"],
        {"bootstrap": [f"/dnsaddr/boot.example/p2p/{peer}"], "network": "lab"},
        {},
    )
    assert config.bootstrap == (DnsaddrName("boot.example", peer),)
    assert config.network == "lab"
    assert load_networks()["public"].bootstrap == ()  # shipped, empty until public peers exist

    mine = tmp_path / "networks.toml"
    mine.write_text('[public]\nbootstrap = ["/dnsaddr/mine.example"]\n[lab]\nbootstrap = []\n')
    assert load_networks(mine)["public"].bootstrap == (DnsaddrName("mine.example"),)
    mine.write_text('[lab]\nbootstrap = ["/dnsaddr/-bad-.example"]\n')
    with pytest.raises(NetworkError, match="bad DNS name"):
        load_networks(mine)
    with pytest.raises(ConfigError, match="SHOAL_NETWORKS"):
        build_config(["networks"], {}, {"SHOAL_NETWORKS": str(mine)})
    with pytest.raises(ConfigError, match="--bootstrap"):
        build_config(["bootstrap"], {"bootstrap": ["/dnsaddr/x.example/tcp/1"]}, {})


async def test_a_network_without_a_list_or_with_an_empty_one_finds_no_address() -> None:
    unlisted = await find_bootstrap([], "lan-only")  # found over mDNS, if at all
    assert unlisted.error is None and unlisted.addrs == []
    assert "no list" in unlisted.source
    empty = await find_bootstrap([], "public")
    assert empty.error is None and empty.addrs == [] and empty.source == "network public"


async def test_doctor_names_the_network_and_what_its_dnsaddr_list_resolved_to(
    tmp_path: Path,
) -> None:
    peer = Identity.generate().peer_id
    # Nobody listens at the address: the doctor reports the resolution, then the failed dial.
    zone = Zone({"_dnsaddr.boot.example": [_txt(f"dnsaddr=/ip4/127.0.0.1/tcp/9/p2p/{peer}")]})
    networks = tmp_path / "networks.toml"
    networks.write_text('[lab]\nbootstrap = ["/dnsaddr/boot.example"]\n')
    async with dns_server(zone) as (ip, port):
        env = cli_env_path(tmp_path) | {"SHOAL_DNS_SERVER": f"{ip}:{port}"}
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "shoal.peer", "doctor", "--json", "--network", "lab",
            "--networks", str(networks), "--data-dir", str(tmp_path / "data"),
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip
        out, err = await asyncio.wait_for(proc.communicate(), 25)
    assert proc.returncode == 1, err.decode()
    report = json.loads(out)
    assert report["network"]["network"] == "lab"
    assert report["network"]["source"] == "network lab"
    assert report["network"]["dnsaddr"][0]["addrs"] == [f"/ip4/127.0.0.1/tcp/9/p2p/{peer}"]
    check = report["checks"][0]
    assert check["check"] == "network" and check["verdict"] == "ok"
    assert "/dnsaddr/boot.example -> 1 addresses" in check["detail"]
    assert "mDNS off" in check["detail"]  # (the harness turns it off)


@pytest.mark.slow
async def test_shoal_run_joins_through_a_dnsaddr_bootstrap_and_fails_clearly_on_an_empty_one(
    make_host: Callable[..., Any], tmp_path: Path
) -> None:
    first = await DHTNode.create(await make_host(), hop_timeout=0.5)
    zone = Zone({"_dnsaddr.test.example": [_txt(f"dnsaddr={first.host.addresses()[0]}")]})
    try:
        async with dns_server(zone) as (ip, port):
            dns = ["--no-train", "--dns-server", f"{ip}:{port}", "--bootstrap"]
            joiner = Daemon("joiner", tmp_path, [*dns, "/dnsaddr/test.example"], {})
            lost = Daemon("lost", tmp_path, [*dns, "/dnsaddr/nothing.example"], {})
            try:
                await asyncio.to_thread(joiner.wait_ready)
                assert "/dnsaddr/test.example resolves to 1 addresses" in joiner.log()
                assert "joined the network: 1 peer known" in joiner.log(), joiner.tail()
                code = await asyncio.to_thread(lost.proc.wait, 30)
                assert code == 1
                assert "the --bootstrap /dnsaddr/ names resolved to none" in lost.log()
                assert "no such name" in lost.log()
            finally:
                joiner.kill()
                lost.kill()
    finally:
        await first.aclose()
