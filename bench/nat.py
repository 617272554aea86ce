"""NAT traversal benchmark in the namespace lab (needs root): hole-punch success rate, time
to a direct connection, and throughput over the punched connection against the same
transfer between two public hosts, measured in the same run.

    sudo python bench/nat.py [--trials 10] [--mb 200] [--repeats 3]

Topology (../shared/lab/lab.sh): the relay/bootstrap peer on the public host; private
peers behind NAT A and NAT C (plain MASQUERADE) punch; a peer behind NAT B
(--random-fully) stays on the relay (relayed_MBps); the public baseline runs between
the public host and a second public host (NAT B's router namespace, which is on the
public network too).

Time to direct: from the moment both private peers start (host, NAT manager) until
their connection is direct, through connecting to the bootstrap peer, AutoNAT finding
them private, the relay reservation, the relayed dial and the hole punch. The first
trial starts the peer processes cold (Python start-up included: time_to_direct_cold_s);
the others start fresh sessions (new identity and port) in running processes.

Prints one JSON object.

    sudo python bench/nat.py --baseline cf034cc [--ab-rounds 3] [--trials 4]

A/B: runs this benchmark and REF's own (bench/baseline.py: a git worktree of
REF, its code first on the path) alternately, each in a fresh process and lab,
and prints each side's median and range of every figure and the ratio
current/baseline.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from baseline import checkout, compare, env_for, order
from lab import PUB_IP, Lab, LabPeer, lab_unavailable

PUB_PORT = 4001


async def start_private(peer: LabPeer, pub_addr: str) -> dict[str, Any]:
    started = await peer.call("start")
    await peer.call("connect", addr=pub_addr)
    return started


async def relay_address(peer: LabPeer) -> str:
    w = await peer.call("wait", what="relay_addr", timeout=10)
    if not w["met"]:
        raise RuntimeError(f"{peer.name}: no relay reservation")
    status = await peer.call("status")
    return next(a for a in status["advertised_addresses"] if "/p2p-circuit/" in a)


async def punch_trial(
    lab: Lab, pub_addr: str, a: LabPeer | None, c: LabPeer | None
) -> tuple[bool, float, LabPeer, LabPeer, str]:
    """One trial; spawns a and c when not given (a cold start). (ok, seconds, a, c, a's ID)."""
    t0 = time.monotonic()
    if a is None or c is None:
        a, c = await asyncio.gather(lab.spawn("a1"), lab.spawn("c1"))
    ra, _ = await asyncio.gather(start_private(a, pub_addr), start_private(c, pub_addr))
    addr = await relay_address(a)
    await c.call("connect", addr=addr)
    w = await c.call("wait", what="direct", value=ra["peer_id"], timeout=15)
    return bool(w["met"]), time.monotonic() - t0, a, c, ra["peer_id"]


async def throughput(sender: LabPeer, receiver_id: str, nbytes: int, repeats: int) -> float:
    """Best of `repeats` one-stream transfers, in MB/s (10^6 bytes per second)."""
    best = 0.0
    for _ in range(repeats):
        r = await sender.call("send", peer=receiver_id, nbytes=nbytes, timeout=300)
        best = max(best, r["MBps"])
    return best


async def run(args: argparse.Namespace) -> dict[str, Any]:
    async with Lab(args.prefix) as lab:
        pub = await lab.spawn("pub")
        rp = await pub.call("start", listen=f"/ip4/0.0.0.0/tcp/{PUB_PORT}")
        pub_addr = f"/ip4/{PUB_IP}/tcp/{PUB_PORT}/p2p/{rp['peer_id']}"

        times: list[float] = []
        cold: float | None = None
        successes = 0
        a = c = None
        a_id = ""
        for trial in range(args.trials):
            ok, seconds, a, c, a_id = await punch_trial(lab, pub_addr, a, c)
            if trial == 0:
                cold = seconds
            else:
                times.append(seconds)
            successes += ok
        assert a is not None and c is not None
        if not ok:  # the last trial must leave a direct connection to measure
            raise RuntimeError("the last hole punch failed: no direct connection to measure")

        nbytes = args.mb * 1_000_000
        direct = await throughput(c, a_id, nbytes, args.repeats)
        kind = (await c.call("conn", peer=a_id))["stats"]["kind"]

        # Baseline: the same transfer between two public hosts.
        # (The router drops unsolicited inbound packets, so the second host dials.)
        other = await lab.spawn("natB")
        ro = await other.call("start", listen="/ip4/0.0.0.0/tcp/4002")
        await other.call("connect", addr=pub_addr)
        public = await throughput(pub, ro["peer_id"], nbytes, args.repeats)
        await other.call("stop")

        # Relayed: a peer behind the symmetric NAT cannot punch.
        b = await lab.spawn("b1")
        rb = await start_private(b, pub_addr)
        addr_b = await relay_address(b)
        await a.call("connect", addr=addr_b)
        relayed = await throughput(a, rb["peer_id"], nbytes, args.repeats)
        relayed_kind = (await a.call("conn", peer=rb["peer_id"]))["stats"]["kind"]

    warm = statistics.median(times) if times else cold
    return {
        "punch_successes": successes,
        "punch_trials": args.trials,
        "time_to_direct_s": round(warm, 3) if warm is not None else None,
        "time_to_direct_max_s": round(max(times), 3) if times else None,
        "time_to_direct_cold_s": round(cold, 3) if cold is not None else None,
        "direct_MBps": round(direct, 1),
        "public_MBps": round(public, 1),
        "relayed_MBps": round(relayed, 1),
        "direct_vs_public": round(direct / public, 3) if public else None,
        "direct_kind": kind,
        "relayed_kind": relayed_kind,
        "transfer_MB": args.mb,
        "repeats": args.repeats,
    }


AB_KEYS = (
    "time_to_direct_s",
    "time_to_direct_max_s",
    "time_to_direct_cold_s",
    "relayed_MBps",
    "direct_MBps",
    "public_MBps",
    "punch_successes",
)


def run_ab(args: argparse.Namespace, passed: list[str]) -> dict[str, Any]:
    """This benchmark and the baseline's, alternately, each as its own process."""
    runs: dict[str, list[dict[str, Any]]] = {"current": [], "baseline": []}
    with checkout(args.baseline) as tree:
        trees = {"current": None, "baseline": tree}
        for i in range(args.ab_rounds):
            for side in order(i):
                root = trees[side] or Path(__file__).resolve().parents[1]
                out = subprocess.run(
                    [sys.executable, str(root / "bench" / "nat.py"), *passed],
                    env=env_for(trees[side]),
                    capture_output=True,
                    text=True,
                    check=True,
                )
                result = json.loads(out.stdout.strip().splitlines()[-1])
                print(f"{side}: {json.dumps(result)}", file=sys.stderr, flush=True)
                runs[side].append(result)
    return compare(runs, AB_KEYS, args.baseline)


def _without_ab_options(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--baseline", "--ab-rounds"):
            skip = True
        elif not a.startswith(("--baseline=", "--ab-rounds=")):
            out.append(a)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--mb", type=int, default=200, help="MB per transfer")
    parser.add_argument("--repeats", type=int, default=3, help="transfers per path (best kept)")
    parser.add_argument("--prefix", default="bn-", help="LAB_PREFIX of the lab this run builds")
    parser.add_argument(
        "--baseline", help="A/B against this commit (or checkout): both codes, alternately"
    )
    parser.add_argument("--ab-rounds", type=int, default=3, help="A/B rounds (one run of each)")
    args = parser.parse_args()
    reason = lab_unavailable()
    if reason is not None:
        sys.exit(f"bench/nat.py: {reason}")
    if args.baseline:
        result = run_ab(args, _without_ab_options(sys.argv[1:]))
    else:
        result = asyncio.run(run(args))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
