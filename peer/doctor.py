"""`shoal doctor`: measure what decides whether this machine can take part, then say so.

It names the network and how its first peers were found (--bootstrap or the
network's list, each /dnsaddr/ name and what it resolved to, peers heard over
mDNS: `finding.Found`), then starts a throwaway peer (a fresh identity, a free port, the same NAT
traversal as `shoal run`, the same --swarm-key and --allow-peers; in an
allow-list swarm it goes as this peer, whose ID the others list), reaches the
bootstrap peers, asks them and other peers of the network how they see it
(observed addresses, dial-backs), waits for the reachability decision and,
behind a NAT, for a relay, asks the peers' clocks, and looks at the disk and
torch. `peer/diagnosis.py` turns that into verdicts. Exit status 0 when the
peer can take part, 1 when no bootstrap peer answered (or torch is missing).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from shoal.dht.node import DEFAULT_PROTOCOL, DHTNode
from shoal.dht.records import owner_of
from shoal.transport import rpc
from shoal.transport.access import AccessControl
from shoal.transport.host import Host, HostConfig
from shoal.transport.identity import Identity, PeerID
from shoal.transport.multiaddr import Multiaddr
from shoal.transport.nat import NatConfig, NatManager
from shoal.transport.nat.reachability import over_lan

from .diagnosis import Check, Facts, as_json, as_text, can_take_part, diagnose
from .discovery import list_experiments
from .finding import Found

__all__ = ["doctor_command"]

CONNECT_TIMEOUT = 8.0
REACHABILITY_WAIT = 25.0
RELAY_WAIT = 10.0
PUNCH_WAIT = 12.0  # a punch: the relayed connection, then DCUtR's attempts
PUNCH_TARGETS = 2  # NATed peers a punch is tried to, at most
MORE_OBSERVERS = 4  # peers besides the bootstrap ones asked how they see us


async def _ping_skew(host: Host, peer: Any) -> float | None:
    sent = time.time()
    reply = await rpc.call(host, peer, DEFAULT_PROTOCOL, "ping", {"from": [], "client": True})
    received = time.time()
    theirs = reply.get("t") if isinstance(reply, dict) else None
    if isinstance(theirs, bool) or not isinstance(theirs, int | float):
        return None
    return (sent + received) / 2 - theirs  # ours minus theirs


async def _reach(host: Host, facts: Facts, bootstrap: list[Multiaddr]) -> list[Multiaddr]:
    reached = []
    for addr in bootstrap:
        try:
            conn = await host.connect(addr, timeout=CONNECT_TIMEOUT)
        except Exception as e:
            text = str(e)
            if len(text) > 180:  # the end says why (a dial error starts with whom it dialed)
                text = "..." + text[-177:]
            reason = "connection refused" if "Errno 111" in text else f"{type(e).__name__}: {text}"
            facts.bootstrap.append((str(addr), reason))
            continue
        facts.bootstrap.append((str(addr), None))
        reached.append(addr)
        with contextlib.suppress(Exception):
            skew = await _ping_skew(host, conn.remote_peer)
            if skew is not None:
                facts.clock_skews_s.append(skew)
    return reached


LAN_ONLY = (
    "only peers on this LAN answered, and none of them can tell how the internet "
    "reaches this machine (peers of the same LAN train together all the same)"
)


def _only_lan_peers(host: Host, nat: NatManager) -> bool:
    """Every connection is over our LAN (`over_lan`): no observer can decide."""
    connections = list(host.connections.values())
    return bool(connections) and all(over_lan(c, nat.lan_neighbours) for c in connections)


async def _more_observers(host: Host, dht: DHTNode) -> None:
    """Connect to a few more peers of the network, at other IPs: two observers at
    different IPs tell a NAT that keeps one port from one that maps per destination."""
    seen_ips = {c.remote_address[0] for c in host.connections.values() if c.remote_address}
    asked = 0
    for contact in list(dht.routing_table):
        if asked >= MORE_OBSERVERS:
            break
        for addr in contact.addrs:
            endpoint = addr.tcp_endpoint()
            if endpoint is None or endpoint[0] in seen_ips:
                continue
            with contextlib.suppress(Exception):
                await host.connect(contact.peer_id, [addr], timeout=CONNECT_TIMEOUT)
                seen_ips.add(endpoint[0])
                asked += 1
            break


async def _natted_peers(dht: DHTNode, me: PeerID) -> list[tuple[PeerID, Multiaddr]]:
    """Peers of the network's experiments that are reachable only through a relay
    (their reports list relayed addresses): what a punch can be tried to."""
    out: dict[PeerID, Multiaddr] = {}
    for row in (await list_experiments(dht))[:3]:
        found = await dht.get(f"shoal/x/{row['id']}/peers", latest=True)
        for subkey, (report, _) in ((found.subkeys or {}) if found else {}).items():
            with contextlib.suppress(Exception):
                peer = owner_of(subkey)
                addrs = [Multiaddr(a) for a in report.get("addresses", [])[:8]]
                relayed = [a for a in addrs if a.is_relayed]
                if peer is not None and peer != me and relayed and len(relayed) == len(addrs):
                    out.setdefault(peer, relayed[0])
    return list(out.items())[:PUNCH_TARGETS]


async def _try_punch(host: Host, nat: NatManager, dht: DHTNode, facts: Facts) -> None:
    """Connect to a NATed peer through its relay and wait for the hole punch (DCUtR) that
    its side starts: whether a direct connection between two NATed peers works here."""
    try:
        targets = await _natted_peers(dht, host.peer_id)
    except Exception:  # the DHT did not answer: nothing to try
        return
    for peer, addr in targets:
        name = peer.short()
        try:
            await host.connect(addr, timeout=CONNECT_TIMEOUT)
        except Exception as e:
            facts.punches.append((name, f"its relay did not connect us: {type(e).__name__}"))
            continue

        def punched(peer: PeerID = peer) -> bool:
            conn = host.connection(peer)
            return conn is not None and conn.kind == "hole-punched"

        if await nat.wait_for(punched, PUNCH_WAIT):
            facts.punches.append((name, None))
            return
        facts.punches.append((name, "no direct connection: traffic stays relayed"))


def _observations(host: Host, nat: NatManager) -> list[tuple[str, str]]:
    now = asyncio.get_running_loop().time()
    out = []
    for peer, conn in host.connections.items():
        if conn.remote_address is None or conn.kind == "relayed":
            continue
        seen = nat.observed.observed_by(peer, now)
        if seen is not None:
            out.append((conn.remote_address[0], str(seen)))
    return out


def _write_probe(directory: Path) -> str | None:
    """Write, fsync and remove a small file in `directory` (what a checkpoint does);
    why it failed, or None."""
    path = directory / f".shoal-doctor-{os.getpid()}.tmp"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, b"\0" * 4096)
            os.fsync(fd)
        finally:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(path)
    except OSError as e:
        return e.strerror or str(e)
    return None


def _local_facts(facts: Facts, data_dir: Path) -> None:
    facts.data_dir = str(data_dir)
    probe = data_dir
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent  # not created yet: the disk it would be created on
    with contextlib.suppress(OSError):
        facts.free_disk_bytes = shutil.disk_usage(probe).free
    facts.unwritable = _write_probe(probe)
    try:
        import torch
    except ImportError:
        return
    facts.torch = torch.__version__
    facts.threads = torch.get_num_threads()
    facts.device = "cuda" if torch.cuda.is_available() else "cpu"


async def gather_facts(
    bootstrap: list[Multiaddr],
    data_dir: Path,
    access: AccessControl | None = None,
    identity: Identity | None = None,
    lan_ips: Iterable[str] = (),
) -> Facts:
    """`lan_ips`: the IPs of peers heard over mDNS (on our link), whose view of us
    says nothing of how the internet reaches us, as in the daemon."""
    facts = Facts()
    _local_facts(facts, data_dir)
    access = access or AccessControl()
    facts.access = access.status()
    if access.allowed is not None:
        facts.unlisted_bootstrap = [
            str(a.peer_id) for a in bootstrap if a.peer_id and a.peer_id not in access.allowed
        ]
    host = Host(
        identity or Identity.generate(),
        HostConfig(listen=(Multiaddr("/ip4/0.0.0.0/tcp/0"),), reuse_port=True),
        access=access,
    )
    await host.start()
    nat = NatManager(host, config=NatConfig(relay_service=False))
    await nat.start()
    nat.heard_on_lan(lan_ips)
    dht: DHTNode | None = None
    try:
        reached = await _reach(host, facts, bootstrap)
        if not reached:
            return facts
        with contextlib.suppress(Exception):
            dht = await DHTNode.create(host, bootstrap=reached, serves=lambda: False)
            await _more_observers(host, dht)
        if _only_lan_peers(host, nat):
            # Nobody who could decide answered: waiting would only add 25 s.
            facts.reachability_reason = LAN_ONLY
            facts.observed = _observations(host, nat)
            return facts
        await nat.wait_for(lambda: nat.reachability.value != "unknown", REACHABILITY_WAIT)
        if nat.reachability.value == "private":
            await nat.wait_for(lambda: bool(nat.relay_client.reservations), RELAY_WAIT)
        facts.reachability = nat.reachability.value
        facts.reachability_reason = nat.tracker.reason
        facts.relays = [str(a) for a in nat.relay_client.circuit_addresses()]
        facts.observed = _observations(host, nat)
        if facts.reachability == "private" and dht is not None:
            await _try_punch(host, nat, dht, facts)
        return facts
    finally:
        if dht is not None:
            await dht.aclose()
        await nat.aclose()
        await host.aclose()


def _ip_of(text: str) -> str | None:
    """The IP of a multiaddr's text (/ip4/A/... or /ip6/A/...), None for others."""
    parts = text.split("/")
    return parts[2] if len(parts) > 2 and parts[1] in ("ip4", "ip6") else None


def network_check(found: Found) -> Check:
    """The network, and what each way of finding its peers found."""
    if found.error is not None:
        return Check("network", "fail", found.error, "fix the --network name or --networks file")
    parts = [f"{found.network}: {found.source}"]
    if found.source.startswith("network") and not found.entries:
        parts.append("its list is empty")
    for result in found.dnsaddr:
        why = f" ({result.problems[0]})" if result.problems and not result.addrs else ""
        parts.append(f"{result.name} -> {len(result.addrs)} addresses{why}")
    if found.mdns_error is not None:
        parts.append(f"mDNS failed: {found.mdns_error}")
    elif not found.mdns_on:
        parts.append("mDNS off")
    else:
        heard = ", ".join(p[:16] for p, _ in found.mdns[:4])
        parts.append(f"mDNS: {len(found.mdns)} peers" + (f" ({heard})" if heard else ""))
    if not found.addrs:
        return Check(
            "network", "warn", "; ".join(parts),
            "no way in: give --bootstrap ADDR or a --network with a bootstrap list",
        )  # fmt: skip
    return Check("network", "ok", "; ".join(parts))


async def doctor_command(
    found: Found,
    data_dir: Path,
    *,
    json_output: bool,
    access: AccessControl | None = None,
    identity: Identity | None = None,
) -> tuple[int, str]:
    """(exit status, text): 0 when the peer can take part. `found`: the network and the
    addresses its peers were found at (cli.py's `_first_peers`)."""
    lan_ips = {ip for _, addrs in found.mdns for ip in map(_ip_of, addrs) if ip}
    facts = await gather_facts(found.addrs, data_dir, access, identity, lan_ips)
    checks = [network_check(found), *diagnose(facts)]
    status = 0 if can_take_part(checks) else 1
    if json_output:
        report = {"ok": status == 0, "checks": as_json(checks), "network": found.as_json()}
        return status, json.dumps(report) + "\n"
    return status, as_text(checks)
