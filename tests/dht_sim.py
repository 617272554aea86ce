"""A DHT network in one event loop without sockets, for the Sybil tests and bench.

Every node has a real `RoutingTable`, `LocalStorage` and runs real lookups
(`lookup.traverse` with `KeyLookup`s set up as `DHTNode` does); only the
transport is fake: a request is a function call on the destination node,
which sees the sender's IP as the observed address of its connection. It
counts messages, and can delay each answer (`rtt`) for latency figures.

Sybils collude: they make IDs ground next to the attacked key (sharing
`grind_bits` leading bits with it, so all are closer to it than any honest
peer), sit in one /24, contact every honest peer so that every routing table
is offered all of them, answer every lookup with the Sybils closest to the
target (never an honest peer), hide every value, and accept (and drop) every
store. With `fakes`, half of every Sybil answer are made-up peers next to the
key that advertise addresses in other /24s: nobody answers there (a dial to
them fails), but until then they look as diverse as honest peers.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import heapq
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from shoal.dht.admission import NO_DIVERSITY, DiversityPolicy
from shoal.dht.lookup import Candidate, KeyLookup, traverse
from shoal.dht.protocol import WireContact
from shoal.dht.records import Record
from shoal.dht.routing import RoutingTable, key_id, node_id
from shoal.dht.storage import LocalStorage, merge_records
from shoal.transport.identity import PeerID
from shoal.transport.multiaddr import Multiaddr

_PREFIX = bytes.fromhex("0024080112 20".replace(" ", ""))  # identity multihash of an Ed25519 key
HONEST_NET = "198.18"  # honest peer i at 198.18.i.2 (i < 256) / 198.19.(i-256).2: one /24 each
SYBIL_NET = "203.0.113"  # every Sybil in this one /24


def _peer(raw_key: bytes) -> PeerID:
    return PeerID.from_public_key(raw_key)


def grind_peer(rng: random.Random, target: int, bits: int) -> PeerID:
    """A peer ID whose node ID shares the first `bits` bits with `target` (what an
    attacker does in a minute of CPU with real keys; key bytes suffice here)."""
    want = target >> (256 - bits)
    base = hashlib.sha256(_PREFIX)
    while True:
        raw = rng.randbytes(32)
        h = base.copy()
        h.update(raw)
        if int.from_bytes(h.digest(), "big") >> (256 - bits) == want:
            return _peer(raw)


@dataclass(eq=False)
class SimNode:
    peer_id: PeerID
    ip: str
    table: RoutingTable
    storage: LocalStorage
    sybil: bool = False

    @functools.cached_property
    def addrs(self) -> tuple[Multiaddr, ...]:
        return (Multiaddr(f"/ip4/{self.ip}/tcp/4001"),)


@dataclass
class SimStats:
    messages: int = 0
    lookups: int = 0
    found: int = 0
    latencies: list[float] = field(default_factory=list)


class SimNetwork:
    """Honest nodes and Sybils; `defended` switches every defence on or off."""

    def __init__(
        self,
        *,
        defended: bool,
        k: int = 20,
        alpha: int = 3,
        value_quorum: int = 3,
        rtt: float = 0.0,
        seed: int = 0,
    ) -> None:
        self.k, self.alpha, self.value_quorum, self.rtt = k, alpha, value_quorum, rtt
        self.policy = DiversityPolicy() if defended else NO_DIVERSITY
        self.rng = random.Random(seed)
        self.nodes: dict[PeerID, SimNode] = {}
        self.honest: list[SimNode] = []
        self.sybils: list[SimNode] = []
        self.stats = SimStats()
        self._fakes: list[WireContact] = []
        self._sybil_contacts: list[tuple[int, WireContact]] = []

    def now(self) -> float:
        return time.monotonic()

    # ---------------------------------------------------------------- building

    def _node(self, peer: PeerID, ip: str, sybil: bool) -> SimNode:
        table = RoutingTable(peer, self.k, diversity=self.policy, rng=self.rng)
        node = SimNode(peer, ip, table, LocalStorage(), sybil)
        self.nodes[peer] = node
        return node

    async def add_honest(self, count: int) -> None:
        """`count` honest nodes, each in its own /24, joining one after another."""
        for _ in range(count):
            i = len(self.honest)
            ip = f"{HONEST_NET}.{i}.2" if i < 256 else f"198.19.{i - 256}.2"
            node = self._node(_peer(self.rng.randbytes(32)), ip, False)
            if self.honest:
                seed = self.honest[0]
                node.table.add_or_update(seed.peer_id, seed.addrs, self.now(), observed_ip=seed.ip)
                await self.find_node(node, node.table.local_id)
            self.honest.append(node)

    def add_sybils(self, count: int, key: str, grind_bits: int = 12, fakes: int = 0) -> None:
        """`count` colluding Sybils next to `key`, in one /24, offered to every honest
        table; and a pool of `fakes` made-up contacts they hand out."""
        target = key_id(key)
        for i in range(fakes):
            fake = grind_peer(self.rng, target, grind_bits)
            addr = Multiaddr(f"/ip4/45.{i // 250}.{i % 250}.7/tcp/4001")
            self._fakes.append(WireContact(fake, (addr,)))
        for _ in range(count):
            j = len(self.sybils) + 1
            node = self._node(grind_peer(self.rng, target, grind_bits), f"{SYBIL_NET}.{j}", True)
            self.sybils.append(node)
        for s in self.sybils:
            for h in self.honest:  # a ping from each Sybil to each honest peer
                self._note_sender(h, s)
        self._sybil_contacts = [
            (node_id(s.peer_id), WireContact(s.peer_id, s.addrs)) for s in self.sybils
        ]

    # ---------------------------------------------------------------- server side

    def _note_sender(self, server: SimNode, client: SimNode) -> None:
        server.table.add_or_update(
            client.peer_id, client.addrs, self.now(), replace_addrs=True, observed_ip=client.ip
        )

    def _nearest(self, server: SimNode, target: int, exclude: PeerID) -> list[WireContact]:
        if server.sybil:  # collude: only Sybils, the closest to the target
            near = heapq.nsmallest(self.k + 1, self._sybil_contacts, key=lambda c: c[0] ^ target)
            real = [wc for _, wc in near if wc.peer_id != exclude]
            if not self._fakes:
                return real[: self.k]
            half = self.k // 2
            return real[: self.k - half] + self.rng.sample(self._fakes, half)
        contacts = server.table.nearest(target, self.k, {exclude})
        return [WireContact(c.peer_id, c.addrs) for c in contacts]

    async def _request(self, client: SimNode, cand: Candidate) -> SimNode:
        self.stats.messages += 1
        server = self.nodes.get(cand.peer_id)
        await asyncio.sleep(self.rtt)
        if server is None:  # a made-up contact: nobody listens at its address
            raise ConnectionRefusedError(f"nothing at {cand.addrs[0]}")
        if not server.sybil:
            self._note_sender(server, client)
        # the client's side of an answer (DHTNode._answered): verified, observed group
        cand.group = self.policy.group_of_ip(server.ip)
        client.table.add_or_update(server.peer_id, server.addrs, self.now(), observed_ip=server.ip)
        return server

    # ---------------------------------------------------------------- client side

    async def _traverse(self, client: SimNode, lookups: Sequence[KeyLookup], query: object) -> None:
        for lk in lookups:
            lk.per_group = self.policy.lookup_cap
            for c in client.table.nearest(lk.target, self.k):
                lk.add(Candidate(c.peer_id, c.node_id, c.addrs, 0, c.ip_group))
        await traverse(
            lookups,
            query,  # type: ignore[arg-type]
            k=self.k,
            alpha=self.alpha,
            stall_after=1.0,
            on_failure=lambda c, e: None,
            blocked=lambda p: False,
            group_of=self.policy.group_of_addrs,
        )

    async def find_node(self, client: SimNode, target: int) -> KeyLookup:
        async def query(cand: Candidate, lks: list[KeyLookup]) -> list[list[WireContact]]:
            server = await self._request(client, cand)
            return [self._nearest(server, lk.target, client.peer_id) for lk in lks]

        lk = KeyLookup(target)
        await self._traverse(client, [lk], query)
        return lk

    async def store(self, client: SimNode, key: str, value: bytes, ttl: float = 600.0) -> int:
        """Store on the `k` closest (per the lookup, with diversity); returns how many
        honest replicas hold it."""
        record = Record(key, None, value, time.time() + ttl)
        lk = KeyLookup(key_id(key), key, settle=self.alpha)

        async def query(cand: Candidate, lks: list[KeyLookup]) -> list[list[WireContact]]:
            server = await self._request(client, cand)
            return [self._nearest(server, x.target, client.peer_id) for x in lks]

        await self._traverse(client, [lk], query)
        honest = reached = 0
        for cand in lk.closest_live(2 * self.k):  # the next closest replace unreachable ones
            server = self.nodes.get(cand.peer_id)
            self.stats.messages += 1
            if server is None:
                continue
            reached += 1
            if reached > self.k:
                break
            if not server.sybil:  # Sybils accept and drop
                group = self.policy.group_of_ip(client.ip)
                honest += server.storage.store(record, time.time(), (client.peer_id, group))
        return honest

    async def get(self, client: SimNode, key: str) -> bytes | None:
        """A value lookup as `DHTNode.get` does it (local copy counts, quorum stop)."""
        self.stats.lookups += 1
        started = time.perf_counter()
        lk = KeyLookup(key_id(key), key, quorum=self.value_quorum)
        held = client.storage.get(key, time.time())
        if held is not None:
            lk.records.extend(held.records())
            lk.holders.append(Candidate(client.peer_id, client.table.local_id, (), 0))

        async def query(cand: Candidate, lks: list[KeyLookup]) -> list[list[WireContact]]:
            server = await self._request(client, cand)
            out = []
            for x in lks:
                if not server.sybil:
                    value = server.storage.get(key, time.time())
                    if value is not None:
                        x.records.extend(value.records())
                        x.holders.append(cand)
                out.append(self._nearest(server, x.target, client.peer_id))
            return out

        await self._traverse(client, [lk], query)
        self.stats.latencies.append(time.perf_counter() - started)
        merged = merge_records(key, lk.records, time.time())
        if merged is None or merged.plain is None:
            return None
        self.stats.found += 1
        return merged.plain.value


async def sybil_attack(
    *,
    defended: bool,
    lookups: int,
    honest: int = 50,
    sybils: int = 200,
    key: str = "honest-record",
    seed: int = 1,
    rtt: float = 0.0,
    concurrency: int = 32,
    fakes: int = 0,
) -> dict[str, float]:
    """Build the network, store one honest record, read it `lookups` times from
    random honest peers (never the writer); the success rate and the cost."""
    net = SimNetwork(defended=defended, seed=seed, rtt=rtt)
    await net.add_honest(honest)
    if sybils:
        net.add_sybils(sybils, key, fakes=fakes)
    writer = net.honest[0]
    replicas = await net.store(writer, key, b"the honest value")
    net.stats = SimStats()
    readers = [net.rng.choice(net.honest[1:]) for _ in range(lookups)]
    sem = asyncio.Semaphore(concurrency)

    async def one(reader: SimNode) -> bool:
        async with sem:
            return await net.get(reader, key) == b"the honest value"

    results = await asyncio.gather(*(one(r) for r in readers))
    lat = sorted(net.stats.latencies)
    return {
        "success_rate": sum(results) / len(results),
        "honest_replicas": replicas,
        "messages_per_lookup": net.stats.messages / len(results),
        "latency_p50_ms": 1000 * lat[len(lat) // 2],
        "latency_p99_ms": 1000 * lat[min(len(lat) - 1, int(0.99 * len(lat)))],
    }
