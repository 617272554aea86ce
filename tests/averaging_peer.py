"""One averaging peer as a separate process, for the crash tests (kill -9, SIGSTOP).

    python tests/averaging_peer.py --key K --size N [--bootstrap ADDR] [--rounds R] ...

Runs a host and a DHT node on 127.0.0.1 and an `Averager` over one float32
vector, and prints JSON lines on stdout:

    {"event": "ready", "peer": ID, "addr": MULTIADDR}
    {"event": "step", "committed": ..., "sha": ..., "members": [...], ...}

Before each step the vector is set to this peer's input for the round: a
pseudo-random vector seeded by (peer ID, number of commits so far), so any
process can recompute any member's input and check a result against the
float64 mean (`--check`: the error is computed here and reported as "err").
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import sys
import time
from typing import Any

import torch

from shoal.averaging.allreduce import AllReduceConfig
from shoal.averaging.averager import Averager, AveragerConfig
from shoal.averaging.matchmaking import MatchmakingConfig
from shoal.dht.node import DHTNode
from shoal.transport.host import Host, HostConfig
from shoal.transport.identity import Identity, PeerID


def input_for(peer: PeerID, commits: int, size: int) -> torch.Tensor:
    seed = int.from_bytes(hashlib.sha256(peer.to_bytes() + commits.to_bytes(8, "big")).digest()[:8])
    return torch.randn(size, generator=torch.Generator().manual_seed(seed))


def relative_error(result: torch.Tensor, members: list[PeerID], commits: int) -> float:
    """max |result - mean| / max |mean|, the mean taken in float64 over the members' inputs."""
    ref = torch.zeros(result.numel(), dtype=torch.float64)
    for m in members:
        ref += input_for(m, commits, result.numel()).double()
    ref /= len(members)
    return float((result.double() - ref).abs().max() / ref.abs().max())


def say(obj: dict[str, Any]) -> None:
    print(json.dumps(obj), flush=True)


async def main(opts: argparse.Namespace) -> None:
    host = Host(
        Identity.generate(),
        HostConfig(listen=("/ip4/127.0.0.1/tcp/0",), max_connections_per_ip=100_000),
    )
    await host.start()
    dht = await DHTNode.create(
        host, bootstrap=[opts.bootstrap] if opts.bootstrap else [], bootstrap_backoff=0.2
    )
    vector = torch.zeros(opts.size)
    config = AveragerConfig(
        matchmaking=MatchmakingConfig(
            min_group_size=opts.min_group,
            target_group_size=opts.target_group,
            matchmaking_time=opts.matchmaking_time,
        ),
        allreduce=AllReduceConfig(stall_timeout=opts.stall_timeout),
        codec=opts.codec,
    )
    averager = Averager(dht, opts.key, [vector], config=config)
    say({"event": "ready", "peer": host.peer_id.to_base58(), "addr": str(host.addresses()[0])})
    try:
        rounds = 0
        while opts.rounds <= 0 or rounds < opts.rounds:
            if not opts.keep_state:
                vector.copy_(input_for(host.peer_id, averager.commits, opts.size))
            commits = averager.commits
            result = await averager.step(timeout=opts.step_timeout)
            report: dict[str, Any] = {
                "event": "step",
                "committed": result.committed,
                "reason": result.reason,
                "members": [p.to_base58() for p in result.members],
                "round_id": result.round_id.hex() if result.round_id else None,
                "leader": result.leader.to_base58() if result.leader else None,
                "attempts": result.attempts,
                "resynced": result.resynced,
                "commits": averager.commits,
                "version": averager.state_version.hex(),
                "sha": hashlib.sha256(vector.numpy().tobytes()).hexdigest(),
                "fingerprint": averager.last_fingerprint,
                "bytes": result.bytes_sent,
                "seconds": result.seconds,
                "matchmaking_s": sum(a.matchmaking_s for a in result.attempt_log),
                "averaging_s": sum(a.averaging_s for a in result.attempt_log),
                "t": time.time(),
            }
            if result.committed and opts.check and not opts.keep_state:
                report["err"] = relative_error(vector, list(result.members), commits)
            say(report)
            if result.committed:
                rounds += 1
            elif opts.pause_on_abort:
                await asyncio.sleep(opts.pause_on_abort)
    finally:
        await averager.aclose()
        await dht.aclose()
        await host.aclose()


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--key", default="test/params")
    p.add_argument("--size", type=int, default=1000)
    p.add_argument("--bootstrap")
    p.add_argument("--rounds", type=int, default=0, help="committed rounds, 0: forever")
    p.add_argument("--codec", default="none")
    p.add_argument("--min-group", type=int, default=2)
    p.add_argument("--target-group", type=int, default=16)
    p.add_argument("--matchmaking-time", type=float, default=1.0)
    p.add_argument("--stall-timeout", type=float, default=3.0)
    p.add_argument("--step-timeout", type=float, default=60.0)
    p.add_argument("--pause-on-abort", type=float, default=0.1)
    p.add_argument("--check", action="store_true", help="report the error against float64")
    p.add_argument("--keep-state", action="store_true", help="average the state itself")
    return p.parse_args(argv)


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    try:
        import uvloop

        uvloop.run(main(parse()))
    except KeyboardInterrupt:
        pass
