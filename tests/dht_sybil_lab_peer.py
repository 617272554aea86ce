"""Many DHT nodes in one process, inside a lab namespace, for test_dht_sybil_lab.py.

    ip netns exec NS python tests/dht_sybil_lab_peer.py honest IP_TEMPLATE COUNT FIRST
    ip netns exec NS python tests/dht_sybil_lab_peer.py sybil IP_TEMPLATE COUNT FIRST KEY BITS

IP_TEMPLATE has one ``{}`` for the node's number, FIRST to FIRST + COUNT - 1
(e.g. ``198.18.{}.2``); every
node listens on its own IP and dials from it (reuse_port), as separate hosts
would. Prints ``{"event": "ready", "addrs": [...]}`` once every node is up, then
reads JSON commands on stdin and answers each with one JSON line:

- honest: ``{"cmd": "join"}``; ``{"cmd": "attack", "key": K, "lookups": N}``
  (node 0 stores the record, then random other nodes read it N times);
- sybil: ``{"cmd": "join", "honest": [addrs], "each": M}`` (every Sybil
  bootstraps through M honest nodes). Sybils have IDs ground next to KEY
  (BITS leading bits), answer every lookup with the Sybils closest to the
  target, hide every value and drop every store while saying it was stored.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from typing import Any

import uvloop

from shoal.dht.node import DHTNode
from shoal.dht.protocol import build_nearest, parse_ids, parse_keys, parse_records
from shoal.dht.routing import key_id, node_id
from shoal.transport.host import Host, HostConfig
from shoal.transport.identity import Identity

HOST = {"max_connections_per_ip": 1000, "max_connections": 4096, "reuse_port": True}
VALUE = "the honest value"


def _say(msg: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(msg) + "\n")
    sys.stdout.flush()


def _ground_identity(target: int, bits: int) -> Identity:
    want = target >> (256 - bits)
    while True:
        identity = Identity.generate()
        if node_id(identity.peer_id) >> (256 - bits) == want:
            return identity


async def _hosts(template: str, first: int, identities: list[Identity]) -> list[Host]:
    hosts = []
    for i, identity in enumerate(identities, first):
        config = HostConfig(listen=(f"/ip4/{template.format(i)}/tcp/4001",), **HOST)
        host = Host(identity, config)
        await host.start()
        hosts.append(host)
    return hosts


class Sybils:
    """Colluding DHT nodes: they answer with each other only."""

    def __init__(self, nodes: list[DHTNode]) -> None:
        self.nodes = nodes
        self.contacts = [(n.peer_id, tuple(n.host.addresses())) for n in nodes]
        for node in nodes:
            service = node._server._service
            service.unary("find_node")(self._find_node)
            service.unary("find_value")(self._find_value)
            service.unary("store")(self._store)

    def _nearest(self, targets: list[int], exclude: Any) -> dict[str, Any]:
        per_key = []
        for t in targets:
            near = sorted(self.contacts, key=lambda c: node_id(c[0]) ^ t)
            per_key.append([c for c in near if c[0] != exclude][:20])
        return build_nearest(per_key)

    async def _find_node(self, ctx: Any, payload: Any) -> Any:
        return self._nearest(parse_ids(payload.get("ids")), ctx.peer)

    async def _find_value(self, ctx: Any, payload: Any) -> Any:
        keys = parse_keys(payload.get("keys"))
        return {**self._nearest([key_id(k) for k in keys], ctx.peer), "values": {}}

    async def _store(self, ctx: Any, payload: Any) -> Any:
        return {"stored": [True] * len(parse_records(payload.get("records")))}


async def _attack(nodes: list[DHTNode], key: str, lookups: int) -> dict[str, Any]:
    writer = nodes[0]
    stored = await writer.store(key, VALUE, time.time() + 600)
    rng = random.Random(7)
    sem = asyncio.Semaphore(8)
    latencies: list[float] = []

    async def read() -> bool:
        async with sem:
            started = time.perf_counter()
            got = await rng.choice(nodes[1:]).get(key)
            latencies.append(time.perf_counter() - started)
            return got is not None and got.value == VALUE

    found = await asyncio.gather(*(read() for _ in range(lookups)))
    holders = sum(n.storage.get(key, time.time()) is not None for n in nodes)
    latencies.sort()
    return {
        "stored": stored,
        "honest_replicas": holders,
        "found": sum(found),
        "lookups": lookups,
        "latency_p50_ms": round(1000 * latencies[len(latencies) // 2], 1),
        "busy_answers": sum(n.stats()["busy_answers"] for n in nodes),
    }


async def main() -> None:
    mode, template, count, first = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    if mode == "sybil":
        target, bits = key_id(sys.argv[5]), int(sys.argv[6])
        identities = [_ground_identity(target, bits) for _ in range(count)]
    else:
        identities = [Identity.generate() for _ in range(count)]
    hosts = await _hosts(template, first, identities)
    nodes = [await DHTNode.create(h, hop_timeout=2.0, max_connections=64) for h in hosts]
    if mode == "sybil":
        Sybils(nodes)
    _say({"event": "ready", "addrs": [str(h.addresses()[0]) for h in hosts]})
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := await reader.readline():
        cmd = json.loads(line)
        try:
            if cmd["cmd"] == "join" and mode == "honest":
                seed = str(hosts[0].addresses()[0])
                for node in nodes[1:]:
                    await node.bootstrap([seed])
                _say({"ok": True})
            elif cmd["cmd"] == "join":
                rng = random.Random(3)
                picks = [rng.sample(cmd["honest"], cmd["each"]) for _ in nodes]
                # a few at a time: 200 joins at once are thousands of handshakes in one
                # moment, and on a loaded 2-core machine they time out
                sem = asyncio.Semaphore(8)

                async def join(node: DHTNode, addrs: list[str], sem: Any = sem) -> None:
                    async with sem:
                        await node.bootstrap(addrs)

                await asyncio.gather(*(join(n, p) for n, p in zip(nodes, picks, strict=True)))
                _say({"ok": True})
            elif cmd["cmd"] == "attack":
                _say({"ok": True, **await _attack(nodes, cmd["key"], cmd["lookups"])})
        except Exception as e:
            _say({"ok": False, "error": repr(e)})
    await asyncio.gather(*(n.aclose() for n in nodes), return_exceptions=True)
    await asyncio.gather(*(h.aclose() for h in hosts), return_exceptions=True)


if __name__ == "__main__":
    uvloop.run(main())
