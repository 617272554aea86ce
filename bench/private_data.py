"""Peers that each bring their own text: does anybody get accused? `shoal run` daemons on loopback.

    python bench/private_data.py [--peers 4] [--seconds 300] [--verify auto|on|off] [--shared]

A host runs the built-in task on its own text file (`--data`) and every joiner on
a text of its own, for `--seconds` after they all started. A referee regenerates a
prover's batches from its own task and data, so it cannot re-execute work on text
it does not have: shoal hosts such an experiment unverified (`--verify auto`) and
refuses `--verify on`. With `--shared` every peer gets the host's text instead, and
the host pins its digest (`--task-option data_digest=...`): then referees can
regenerate anyone's batches and the experiment stays verified (the contrast).
Prints one JSON object:

    {"peers", "seconds", "verify", "shared", "refused": the host's error line or null,
     "verified": every peer's /status verification.enabled,
     "unverified_lines": how many times the host said it hosts unverified,
     "rounds": {peer: committed rounds}, "largest_group": {peer: largest group},
     "rounds_of_all": {peer: rounds committed by all the peers together},
     "audits_passed", "audits_failed", "accusations": disputes other than passed,
     "bans": peers banned (summed),
     "convicted_self": peers that think they were convicted}

What it showed (a shared 2-core machine, the tiny model, inner steps 10). Before
hosting such an experiment unverified, four honest peers on their own texts failed
20 of 20 audits in 3 minutes, were banned 8 times over and two were convicted. Now:
4 peers for 300 s: one unverified line, 239 to 247 rounds committed per peer, the
largest group 4, 0 audits, 0 accusations, 0 bans (60 s: 70 of 70 rounds by all 4).
`--verify on`: refused in one line. `--shared`, 4 peers for 90 s: verified, 94
rounds of all 4, 44 audits passed, 0 failed, 0 accusations, 0 bans.
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


def accusations(states: dict[str, dict[str, Any]]) -> int:
    """Disputes that were not a plain pass: each began with an accusation."""
    return sum(
        n for v in states.values() for k, n in v.get("disputes", {}).items() if k != "passed"
    )


def measure(
    peers: int, seconds: float, verify: str, workdir: Path, *, shared: bool = False
) -> dict[str, Any]:
    text = own_text(workdir, "host")
    args = ["--host-experiment", "own-words", "--data", text, "--verify", verify]
    settings = dict(ROUNDS)
    if shared:
        from shoal.peer.training.task import load_task

        task: Any = load_task("bytegpt", {"context": 32}, data=Path(text))
        settings["SHOAL_TASK_OPTIONS"] += f",data_digest={task.corpus.digest}"
    host = Daemon("host", workdir, args, settings)
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
            data = text if shared else own_text(workdir, name)
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
            "shared": shared,
            "refused": None,
            "verified": all(v["enabled"] for v in states.values()),
            "unverified_lines": host.log().count("hosted UNVERIFIED"),
            "rounds": {name: len(sizes) for name, sizes in rounds.items()},
            "largest_group": {name: max(sizes, default=0) for name, sizes in rounds.items()},
            "rounds_of_all": {n: sum(k == peers for k in sizes) for n, sizes in rounds.items()},
            "audits_passed": sum(v.get("audits_passed", 0) for v in states.values()),
            "audits_failed": sum(v.get("audits_failed", 0) for v in states.values()),
            "accusations": accusations(states),
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
    parser.add_argument("--shared", action="store_true", help="every peer on the host's text")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="shoal-private-data-") as tmp:
        print(
            json.dumps(
                measure(args.peers, args.seconds, args.verify, Path(tmp), shared=args.shared),
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
