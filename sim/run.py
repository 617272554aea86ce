"""Run a scenario of the real shoal code over the simulated network in virtual time.

    python sim/run.py sim/scenarios/dht_small.json [--peers N] [--profile FILE] [--trace FILE]
    python sim/run.py sim/scenarios/moshpit_small.json --trace-matchmaking FILE
    python sim/trace_report.py FILE

Prints one JSON object on stdout (logs go to stderr): the scenario's figures, plus
`wall_s` (real seconds the run took) and `virtual_s` (simulated seconds it covered).
One scenario with one seed gives the same figures on every run, but for those measured
in real time or memory (and, with `cpu_scale`, whatever its CPU charge moves).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import json
import logging
import os
import random
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from scenario import Scenario, load
from simnet import CURRENT_HOST, SimNetwork
from vtime import VirtualTimeLoop, seeded_entropy, traced_callbacks, virtual_clocks

# workload -> (module, function): imported when used (averaging brings in torch)
WORKLOADS = {
    "dht": ("dht_scenario", "run_dht"),
    "averaging": ("avg_scenario", "run_averaging"),
    "moshpit": ("moshpit_scenario", "run_moshpit"),
    "bans": ("bans_scenario", "run_bans"),
}


# The garbage collector, tuned for a heap of millions of long-lived objects (hundreds
# of hosts, their tables and connections): Python's defaults run a full collection
# each time a quarter of the heap's size has been promoted, and with several GB of
# heap `gc_collect_main` was most of a 754-peer burst's wall time (py-spy, 5 samples
# of 6). Tuned: young collections 100x rarer, and everything built before the
# workload's main phase frozen out of every collection (`vtime.freeze_setup`).
GC_THRESHOLDS = {"tuned": (70_000, 50, 100), "python": None}


def simulate(
    scenario: Scenario, *, gc_policy: str = "tuned", trace: str | None = None
) -> dict[str, Any]:
    """Run `scenario` on a fresh virtual-time loop; its figures with wall and virtual time.
    `gc_policy`: "tuned" (see GC_THRESHOLDS) or "python" (the interpreter's defaults).
    `trace`: a file (gzip) to write every callback the loop runs to
    (`vtime.traced_callbacks`).

    The figures are a function of the scenario and its seed (not `wall_s`,
    `virtual_over_wall`, nor what is measured in real time or memory, nor anything
    a `cpu_scale` charges from real CPU time) where the process's str and bytes
    hashes are fixed (`PYTHONHASHSEED`: `fix_hash_seed` sees to it for run.py)."""
    kind = scenario.workload.get("kind", "dht")
    if kind not in WORKLOADS:
        raise ValueError(f"unknown workload {kind!r} (known: {', '.join(WORKLOADS)})")
    loop = VirtualTimeLoop()
    rng = random.Random(scenario.seed)
    random.seed(scenario.seed)  # (the code under test draws jitter from the global one)
    loop.network = SimNetwork(loop, rng)
    loop.cpu_scale = float(scenario.workload.get("cpu_scale", 0.0))
    if scenario.workload.get("cores"):
        background = float(scenario.workload.get("background_load", 0.0))
        loop.share_cores(int(scenario.workload["cores"]), CURRENT_HOST, background)
    thresholds, saved = GC_THRESHOLDS[gc_policy], gc.get_threshold()
    loop.freeze_gc = thresholds is not None
    if thresholds is not None:
        gc.set_threshold(*thresholds)
    wall0 = time.perf_counter()
    try:
        with virtual_clocks(loop):
            # (Imported before the seeding: importing torch draws from os.urandom and
            # an unseeded random.Random, so in a process that had imported it already
            # the run would see other draws than in a fresh one.)
            module, function = WORKLOADS[kind]
            workload = getattr(importlib.import_module(module), function)
            tracing = traced_callbacks(trace) if trace else contextlib.nullcontext()
            with seeded_entropy(scenario.seed), tracing:
                result = loop.run_until_complete(workload(scenario, loop.network, rng))
    finally:
        loop.close()
        gc.set_threshold(*saved)
        gc.unfreeze()
    wall = time.perf_counter() - wall0
    out = {"scenario": scenario.name, **result}
    out["wall_s"] = round(wall, 3)
    out["virtual_over_wall"] = round(out["virtual_s"] / wall, 2) if wall else None
    return out


def fix_hash_seed() -> None:
    """Re-run this process with `PYTHONHASHSEED=0` unless it is set (then as set):
    Python salts str and bytes hashes per process, and the order of a set of them (or
    of peer IDs, which hash as bytes) follows the salt, and the product iterates such
    sets somewhere (moshpit_small's one-key arm gave other figures under other salts).
    Set it to `random` to keep a salt per process."""
    if os.environ.get("PYTHONHASHSEED") is None:
        os.execve(sys.executable, sys.orig_argv, {**os.environ, "PYTHONHASHSEED": "0"})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "scenario", help="a scenario file (JSON), e.g. sim/scenarios/dht_small.json"
    )
    parser.add_argument("--peers", type=int, default=None, help="override the scenario's count")
    parser.add_argument("--profile", default=None, help="write cProfile stats to this file")
    parser.add_argument("--log", default="WARNING", help="log level (stderr)")
    parser.add_argument("--gc", default="tuned", choices=sorted(GC_THRESHOLDS),
                        help="the garbage collector's settings (python: its defaults)")  # fmt: skip
    parser.add_argument("--trace", default=None,
                        help="write every callback the loop runs to this file (gzip): two "
                        "runs that should agree part where their traces first differ")  # fmt: skip
    parser.add_argument("--trace-matchmaking", default=None, metavar="FILE",
                        help="moshpit: write every peer's steps, with each try's joins, "
                        "group and left-outs, to FILE (one JSON line per arm; read it "
                        "with sim/trace_report.py)")  # fmt: skip
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log.upper(), stream=sys.stderr)
    scenario = load(args.scenario, peers=args.peers)
    if args.trace_matchmaking:
        if scenario.workload.get("kind") != "moshpit":
            parser.error("--trace-matchmaking: for moshpit scenarios")
        open(args.trace_matchmaking, "w").close()  # (each arm appends its line)
        scenario.workload["trace_matchmaking"] = args.trace_matchmaking
    if args.profile:
        import cProfile

        profiler = cProfile.Profile(time.perf_counter)
        result = profiler.runcall(simulate, scenario, gc_policy=args.gc, trace=args.trace)
        profiler.dump_stats(args.profile)
    else:
        result = simulate(scenario, gc_policy=args.gc, trace=args.trace)
    print(json.dumps(result))


if __name__ == "__main__":
    fix_hash_seed()
    main()
