"""What one averaging round costs each peer on the wire, by protocol and by DHT request.

    python bench/round_bytes.py [--peers 4,16] [--rounds 8] [--codec topk] [--arms ...]

N DiLoCo peers in one process on loopback (real hosts, DHT nodes and matchmaking), a
model of the daemon's default size (446K parameters, in four tensors), H = 2, run
until every peer committed `--rounds` rounds. Three arms per swarm size, in the same
run (`--arms`): `full_reads` (every matchmaking poll reads all k replicas in full: the
code before delta and sampled reads), `from_every_request` (as the default, but every
DHT request names its sender's addresses: the code before they went once per
connection) and `default` (delta reads, polls that read 3 replicas drawn among the
k, addresses once per connection). Each reports, per peer per round: the stream payload
sent by protocol (`Host.bytes_sent_by_protocol`), everything its connections sent
(`bytes_sent`), and the DHT requests it sent by method.

Prints one JSON object on stdout: {"<peers>": {"<arm>": {...}}, "ratios_default_to_<arm>":
...}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import Counter
from typing import Any

import torch

from shoal.averaging import declarer
from shoal.averaging.strategies import make_strategy
from shoal.dht import requester
from shoal.dht.node import DHTNode
from shoal.transport.host import Host, HostConfig
from shoal.transport.identity import Identity
from shoal.transport.multiaddr import Multiaddr

PARAMS = 446_000  # the daemon's default model (d_model 128)
LISTEN = [Multiaddr("/ip4/127.0.0.1/tcp/0")]
HOST = {"max_connections_per_ip": 100_000, "max_connections": 100_000}


class RequestCount:
    """DHT requests sent, by method (wraps `Requester.request`)."""

    def __init__(self) -> None:
        self.by_method: Counter[str] = Counter()
        self._original = requester.Requester.request

    def __enter__(self) -> RequestCount:
        count, original = self.by_method, self._original

        async def request(self: Any, peer: Any, addrs: Any, method: str, payload: Any) -> Any:
            count[method] += 1
            return await original(self, peer, addrs, method, payload)

        requester.Requester.request = request  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        requester.Requester.request = self._original  # type: ignore[method-assign]


ARMS = ("full_reads", "from_every_request", "default")


def _from_every_request(self: Any, conn: Any, payload: Any) -> tuple[Any, None]:
    return payload, None  # (what `Requester._over` did before: `from` on every request)


async def run_swarm(n: int, rounds: int, codec: str, arm: str) -> dict[str, Any]:
    full_reads = arm == "full_reads"
    declarer.POLL_REPLICAS = None if full_reads else 3  # type: ignore[assignment]
    over = requester.Requester._over
    if arm == "from_every_request":
        requester.Requester._over = _from_every_request  # type: ignore[assignment,method-assign]
    try:
        return await _run_swarm(n, rounds, codec, full_reads)
    finally:
        requester.Requester._over = over  # type: ignore[method-assign]


async def _run_swarm(n: int, rounds: int, codec: str, full_reads: bool) -> dict[str, Any]:
    hosts, dhts, strategies, params = [], [], [], []
    try:
        for i in range(n):
            host = Host(Identity.generate(), HostConfig(listen=LISTEN, **HOST))  # type: ignore[arg-type]
            await host.start()
            hosts.append(host)
            boot = [str(hosts[0].addresses()[0])] if i else []
            dht = await DHTNode.create(host, bootstrap=boot, delta_reads=not full_reads)
            dhts.append(dht)
            g = torch.Generator().manual_seed(0)
            p = [torch.randn(PARAMS // 4, generator=g) for _ in range(4)]
            params.append(p)
            options = {"inner_steps": 2, "codec": codec, "matchmaking_time": 2.0}
            strategies.append(make_strategy("diloco", dht, "bench/rounds", p, options))
        await asyncio.gather(*(s.start(join=False) for s in strategies))
        with RequestCount() as requests:
            payload_at_start = [h.bytes_sent_by_protocol() for h in hosts]
            sent_at_start = [h.bytes_sent for h in hosts]
            t0 = time.monotonic()
            pairs = zip(strategies, params, strict=True)
            await asyncio.gather(*(train(s, p, rounds) for s, p in pairs))
            seconds = time.monotonic() - t0
        per_protocol: Counter[str] = Counter()
        for host, start in zip(hosts, payload_at_start, strict=True):
            for protocol, sent in host.bytes_sent_by_protocol().items():
                per_protocol[protocol.split("/")[2]] += sent - start.get(protocol, 0)
        norm = n * rounds
        total = sum(h.bytes_sent - s for h, s in zip(hosts, sent_at_start, strict=True))
        return {
            "seconds": round(seconds, 2),
            "bytes_sent_per_round": round(total / norm),
            "payload_per_round_by_protocol": {
                p: round(v / norm) for p, v in per_protocol.most_common()
            },
            "dht_requests_per_round": {
                m: round(c / norm, 2) for m, c in requests.by_method.most_common()
            },
        }
    finally:
        for s in strategies:
            await s.aclose()
        for d in dhts:
            await d.aclose()
        for h in hosts:
            await h.aclose()


async def train(strategy: Any, params: list[torch.Tensor], rounds: int) -> None:
    committed = 0
    while committed < rounds:
        with torch.no_grad():
            for x in params:
                x.add_(torch.randn_like(x), alpha=0.01)
        committed += sum(r.committed for r in await strategy.after_inner_step(8))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--peers", default="4,16", help="comma-separated swarm sizes")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--codec", default="topk")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {ARMS}")
    args = p.parse_args()
    chosen = args.arms.split(",")
    if unknown := set(chosen) - set(ARMS):
        p.error(f"unknown arms {sorted(unknown)}: expected some of {ARMS}")
    out: dict[str, Any] = {"codec": args.codec, "rounds": args.rounds, "params": PARAMS}
    ratios: dict[str, dict[str, Any]] = {arm: {} for arm in chosen if arm != "default"}
    for n in (int(x) for x in args.peers.split(",")):
        arms = {}
        for arm in chosen:
            print(f"[{time.strftime('%H:%M:%S')}] {n} peers, {arm}", file=sys.stderr)
            arms[arm] = asyncio.run(run_swarm(n, args.rounds, args.codec, arm))
        out[str(n)] = arms
        if "default" in arms:
            for arm, by_size in ratios.items():
                by_size[str(n)] = _ratios(arms["default"], arms[arm])
    for arm, by_size in ratios.items():
        out[f"ratios_default_to_{arm}"] = by_size
    print(json.dumps(out))


def _ratios(default: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    dht = [a["payload_per_round_by_protocol"].get("dht", 0) for a in (default, other)]
    return {
        "dht_bytes": round(dht[0] / dht[1], 3) if dht[1] else None,
        "bytes_sent": round(default["bytes_sent_per_round"] / other["bytes_sent_per_round"], 3),
    }


if __name__ == "__main__":
    main()
