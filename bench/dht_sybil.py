"""Sybil benchmark: 200 colluding Sybils in one /24 against 50 honest peers.

    python bench/dht_sybil.py [--lookups 500] [--rtt-ms 10] [--seeds 2]

The network is simulated in one event loop (tests/dht_sim.py: real routing
tables, storage and lookups, a fake transport that delays every answer by
`--rtt-ms`). Sybils have IDs ground next to the key (12 bits), answer lookups
with each other only and hide the record; an honest peer stored it first.

Prints one JSON object on stdout:

- ``attack.defended`` / ``attack.undefended``: the share of lookups from random
  honest peers that found the honest record, the honest replicas the writer
  reached, messages per lookup and lookup latency (p50/p99, ms), with the
  defences of `shoal.dht.admission` on and off;
- ``attack_fake_contacts``: the same, with half of every Sybil answer made-up
  contacts next to the key advertising addresses in other /24s (`--fakes` of
  them; a request to one fails after one RTT);
- ``no_attack.defended`` / ``no_attack.plain``: the same lookups in a network of
  honest peers only, i.e. what the defences cost in the common case;
- ``cost_ratio``: defended over plain, messages and p50 latency, without attack
  (the ratios come from the same run, so machine load cancels out).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from dht_sim import sybil_attack


async def _scenario(seeds: int, **kw: Any) -> dict[str, Any]:
    runs = [await sybil_attack(seed=seed, **kw) for seed in range(1, seeds + 1)]
    out: dict[str, Any] = {}
    for field in runs[0]:
        values = [r[field] for r in runs]
        out[field] = round(statistics.mean(values), 4)
    out["success_rate_min"] = min(r["success_rate"] for r in runs)
    return out


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lookups", type=int, default=500, help="lookups per network")
    ap.add_argument("--seeds", type=int, default=2, help="networks per scenario")
    ap.add_argument("--rtt-ms", type=float, default=10.0, help="simulated delay of each answer")
    ap.add_argument("--honest", type=int, default=50)
    ap.add_argument("--sybils", type=int, default=200)
    ap.add_argument("--fakes", type=int, default=1000, help="made-up contacts (0: skip)")
    args = ap.parse_args()
    common = {
        "lookups": args.lookups,
        "honest": args.honest,
        "rtt": args.rtt_ms / 1000,
        "concurrency": 16,
    }
    started = time.perf_counter()
    attack = {
        "defended": await _scenario(args.seeds, defended=True, sybils=args.sybils, **common),
        "undefended": await _scenario(args.seeds, defended=False, sybils=args.sybils, **common),
    }
    fake_contacts = None
    if args.fakes:
        fake_contacts = {
            name: await _scenario(
                args.seeds, defended=on, sybils=args.sybils, fakes=args.fakes, **common
            )
            for name, on in (("defended", True), ("undefended", False))
        }
    no_attack = {
        "defended": await _scenario(args.seeds, defended=True, sybils=0, **common),
        "plain": await _scenario(args.seeds, defended=False, sybils=0, **common),
    }
    d, p = no_attack["defended"], no_attack["plain"]
    print(
        json.dumps(
            {
                "honest": args.honest,
                "sybils": args.sybils,
                "sybil_net": "203.0.113.0/24",
                "lookups": args.lookups * args.seeds,
                "rtt_ms": args.rtt_ms,
                "attack": attack,
                "attack_fake_contacts": fake_contacts,
                "no_attack": no_attack,
                "cost_ratio": {
                    "messages": round(d["messages_per_lookup"] / p["messages_per_lookup"], 3),
                    "latency_p50": round(d["latency_p50_ms"] / p["latency_p50_ms"], 3),
                },
                "wall_s": round(time.perf_counter() - started, 1),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    asyncio.run(main())
