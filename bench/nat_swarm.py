"""A public host and three NATed joiners started at once on a loaded machine, many times.

    sudo python bench/nat_swarm.py [--runs 20] [--load 2] [--default-task]
        [--stalls N] [--slow-dialbacks S]

Each run builds the namespace lab, starts the public host (hosting an
experiment) and three joiners behind NAT A (MASQUERADE), B (--random-fully)
and C (MASQUERADE) at the same moment, with two busy processes on both cores
during start-up (`--load N`; 0 for none), training a tiny model or, with
`--default-task`, the default experiment; `--stalls N` freezes the public host
for 2 s (then 0.5 s running), N times, from when it listens; `--slow-dialbacks S`
makes the dial-backs of joiners A and C time out for the first S seconds
(tests/lab_swarm.py has the details). It
counts the runs where the public host concluded it was private, and the runs
that fully succeeded: the host public, A and C hole-punched, B relayed, equal
fingerprints in a round of four. Prints one JSON object:

    {"runs": N, "load": 2, "default_task": false, "ok": n, "pub_went_private": n, "failures": [...],
     "seconds": {"median": s, "max": s}}
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from lab import lab_unavailable
from lab_swarm import run_swarm


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--load", type=int, default=2, help="busy processes at start-up")
    parser.add_argument(
        "--default-task", action="store_true", help="the default model, not a tiny one"
    )
    parser.add_argument("--timeout", type=float, default=180.0)
    parser.add_argument(
        "--stalls", type=int, default=0, help="times the public host is frozen for 2 s"
    )
    parser.add_argument(
        "--slow-dialbacks",
        type=float,
        default=0.0,
        help="seconds during which joiners A and C cannot complete dial-backs",
    )
    parser.add_argument("--prefix", default="sw-")
    args = parser.parse_args()
    why = lab_unavailable()
    if why:
        print(json.dumps({"error": why}))
        return 1
    results = []
    for i in range(args.runs):
        with tempfile.TemporaryDirectory() as tmp:
            r = run_swarm(
                args.prefix,
                Path(tmp),
                load=args.load,
                timeout=args.timeout,
                default_task=args.default_task,
                stalls=args.stalls,
                slow_dialbacks=args.slow_dialbacks,
            )
        summary = {k: v for k, v in r.items() if k != "logs"}
        print(f"run {i + 1}/{args.runs}: {summary}", file=sys.stderr, flush=True)
        results.append(r)
    seconds = [r["seconds"] for r in results]
    print(
        json.dumps(
            {
                "runs": args.runs,
                "load": args.load,
                "default_task": args.default_task,
                "stalls": args.stalls,
                "slow_dialbacks": args.slow_dialbacks,
                "ok": sum(r["ok"] for r in results),
                "pub_went_private": sum(r["pub_went_private"] for r in results),
                "failures": [
                    {k: v for k, v in r.items() if k != "logs"} for r in results if not r["ok"]
                ],
                "seconds": {"median": statistics.median(seconds), "max": max(seconds)},
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
