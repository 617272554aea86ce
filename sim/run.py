"""Run a scenario of the real shoal code over the simulated network in virtual time.

    python sim/run.py sim/scenarios/dht_small.json [--peers N] [--profile FILE]

Prints one JSON object on stdout (logs go to stderr): the scenario's figures, plus
`wall_s` (real seconds the run took) and `virtual_s` (simulated seconds it covered).
"""

from __future__ import annotations

import argparse
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
from vtime import VirtualTimeLoop, virtual_clocks

# workload -> (module, function): imported when used (averaging brings in torch)
WORKLOADS = {
    "dht": ("dht_scenario", "run_dht"),
    "averaging": ("avg_scenario", "run_averaging"),
    "moshpit": ("moshpit_scenario", "run_moshpit"),
    "bans": ("bans_scenario", "run_bans"),
}


def simulate(scenario: Scenario) -> dict[str, Any]:
    """Run `scenario` on a fresh virtual-time loop; its figures with wall and virtual time."""
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
    wall0 = time.perf_counter()
    try:
        with virtual_clocks(loop):
            module, function = WORKLOADS[kind]
            workload = getattr(importlib.import_module(module), function)
            result = loop.run_until_complete(workload(scenario, loop.network, rng))
    finally:
        loop.close()
    wall = time.perf_counter() - wall0
    out = {"scenario": scenario.name, **result}
    out["wall_s"] = round(wall, 3)
    out["virtual_over_wall"] = round(out["virtual_s"] / wall, 2) if wall else None
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "scenario", help="a scenario file (JSON), e.g. sim/scenarios/dht_small.json"
    )
    parser.add_argument("--peers", type=int, default=None, help="override the scenario's count")
    parser.add_argument("--profile", default=None, help="write cProfile stats to this file")
    parser.add_argument("--log", default="WARNING", help="log level (stderr)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log.upper(), stream=sys.stderr)
    scenario = load(args.scenario, peers=args.peers)
    if args.profile:
        import cProfile

        profiler = cProfile.Profile(time.perf_counter)
        result = profiler.runcall(simulate, scenario)
        profiler.dump_stats(args.profile)
    else:
        result = simulate(scenario)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
