"""The averaging scenario as real processes on loopback (tests/averaging_peer.py), for
comparison with the simulator: commits per peer per minute and group sizes.

    python sim/real_avg.py sim/scenarios/avg_6_loopback.json

Prints one JSON object: the real run's figures, the simulated run's, and `sim_vs_real`
(each simulated figure over the real one). Real peers pay for their CPU; simulated
ones do not, so the two agree only while the machine is not the bottleneck.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from run import simulate
from scenario import load

ROOT = Path(__file__).resolve().parent.parent
PEER = ROOT / "tests" / "averaging_peer.py"


def _args(w: dict[str, Any]) -> list[str]:
    return [
        "--size", str(w.get("size", 1000)),
        "--min-group", str(w.get("min_group_size", 2)),
        "--target-group", str(w.get("target_group_size", 16)),
        "--matchmaking-time", str(w.get("matchmaking_time", 1.0)),
        "--key", "sim/avg",
    ]  # fmt: skip


def real_run(peers: int, w: dict[str, Any], duration: float) -> dict[str, Any]:
    """`peers` processes; the steps they report over `duration` seconds once all are up."""
    procs: list[subprocess.Popen[str]] = []
    events: list[dict[str, Any]] = []
    lock = threading.Lock()

    def read(p: subprocess.Popen[str]) -> None:
        assert p.stdout is not None
        for line in p.stdout:
            with lock:
                events.append(json.loads(line))

    def start(bootstrap: str | None) -> subprocess.Popen[str]:
        cmd = [sys.executable, str(PEER), *_args(w)]
        if bootstrap:
            cmd += ["--bootstrap", bootstrap]
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        procs.append(p)
        threading.Thread(target=read, args=(p,), daemon=True).start()
        return p

    try:
        start(None)
        while not events:
            time.sleep(0.05)
        seed = events[0]["addr"]
        for _ in range(peers - 1):
            start(seed)
        while sum(1 for e in events if e["event"] == "ready") < peers:
            time.sleep(0.05)
        t0 = time.time()
        time.sleep(duration)
        t1 = time.time()
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(10)
    steps = [e for e in events if e["event"] == "step" and t0 <= e["t"] <= t1]
    committed = [e for e in steps if e["committed"]]
    sizes = [len(e["members"]) for e in committed]
    return {
        "commits_per_peer_per_min": round(len(committed) / peers / (duration / 60), 2),
        "group_size_mean": round(sum(sizes) / len(sizes), 2) if sizes else None,
        "group_sizes": dict(sorted(Counter(sizes).items())),
        "resyncs": sum(1 for e in steps if e.get("resynced")),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("scenario")
    args = parser.parse_args()
    scenario = load(args.scenario)
    duration = float(scenario.workload.get("duration_s", 60))
    simulated = simulate(scenario)
    real = real_run(scenario.peers, scenario.workload, duration)
    ratio = {
        k: round(simulated[k] / real[k], 3) if real.get(k) else None
        for k in ("commits_per_peer_per_min", "group_size_mean")
    }
    print(
        json.dumps({"peers": scenario.peers, "sim": simulated, "real": real, "sim_vs_real": ratio})
    )


if __name__ == "__main__":
    main()
