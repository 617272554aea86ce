"""Peers that each bring their own text: does anybody get accused? `shoal run` daemons on loopback.

    python bench/private_data.py [--peers 4] [--seconds 300] [--verify auto|on|off]

A host runs the built-in task on its own text file (`--data`) and every joiner on
a text of its own, for `--seconds` after they all started. A referee regenerates a
prover's batches from its own task and data, so it cannot re-execute work on text
it does not have: shoal hosts such an experiment unverified (`--verify auto`) and
refuses `--verify on`. Prints one JSON object:

    {"peers", "seconds", "verify", "refused": the host's error line or null,
     "unverified_lines": how many times the host said it hosts unverified,
     "rounds": {peer: committed rounds}, "largest_group": {peer: largest group},
     "audits_failed", "accusations": disputes seen, "bans": peers banned (summed),
     "convicted_self": peers that think they were convicted}

What it showed (this 2-core machine, tiny model, inner steps 10; before this
change the issue saw 20 of 20 audits fail in 3 minutes, 8 bans, 2 convictions):
see the commit that added this script.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from daemon_harness import ROUND_RE, TINY_TASK, Daemon

ROUNDS = {
    "SHOAL_INNER_STEPS": "10",
    "SHOAL_TASK_OPTIONS": TINY_TASK,
    "SHOAL_STRATEGY_OPTIONS": "matchmaking_time=3,round_timeout=20,stall_timeout=3",
}


def own_text(directory: Path, name: str) -> str:
    path = directory / f"{name}.txt"
    words = " ".join(f"{name}{i % 97}" for i in range(400))
    path.write_text(f"{words}. {name} writes its own words, line after line.\n" * 40)
    return str(path)


def measure(peers: int, seconds: float, verify: str, workdir: Path) -> dict[str, Any]:
    args = ["--host-experiment", "own-words", "--data", own_text(workdir, "host")]
    host = Daemon("host", workdir, [*args, "--verify", verify], ROUNDS)
    daemons = [host]
    if verify == "on":  # refused at start, or running
        with contextlib.suppress(subprocess.TimeoutExpired):
            host.proc.wait(timeout=60)
    if not host.alive():
        lines = host.log().strip().splitlines()
        return {"peers": 1, "seconds": 0, "verify": verify, "refused": lines[-1] if lines else ""}
    try:
        host.wait_ready()
        join = ["--join", host.join_ref, "--bootstrap", host.address]
        for i in range(1, peers):
            name = f"peer{i}"
            data = own_text(workdir, name)
            daemons.append(Daemon(name, workdir, [*join, "--data", data], {}))
        for d in daemons:
            d.wait_ready()
        time.sleep(seconds)  # a measurement window, not a wait for a condition
        states = {d.name: d.status()["verification"] for d in daemons}
        rounds = {d.name: [int(m.group(2)) for m in ROUND_RE.finditer(d.log())] for d in daemons}
        return {
            "peers": peers,
            "seconds": seconds,
            "verify": verify,
            "refused": None,
            "unverified_lines": host.log().count("hosted UNVERIFIED"),
            "rounds": {name: len(sizes) for name, sizes in rounds.items()},
            "largest_group": {name: max(sizes, default=0) for name, sizes in rounds.items()},
            "audits_failed": sum(v.get("audits_failed", 0) for v in states.values()),
            "accusations": sum(sum(v.get("disputes", {}).values()) for v in states.values()),
            "bans": sum(len(v["banned"]) for v in states.values()),
            "convicted_self": sum(bool(v["convicted_self"]) for v in states.values()),
            "alive": all(d.alive() for d in daemons),
        }
    finally:
        for d in daemons:
            d.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=300.0)
    parser.add_argument("--verify", choices=("auto", "on", "off"), default="auto")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="shoal-private-data-") as tmp:
        print(json.dumps(measure(args.peers, args.seconds, args.verify, Path(tmp)), indent=1))


if __name__ == "__main__":
    main()
