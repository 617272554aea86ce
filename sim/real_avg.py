"""The averaging scenario as real processes on loopback (tests/averaging_peer.py), for
comparison with the simulator: commits per peer per minute, group sizes, re-syncs.

    python sim/real_avg.py sim/scenarios/avg_6_loopback.json [--background N]

Runs the real processes first, then the simulation. Prints one JSON object: the real
run's figures, the simulated run's, and `sim_vs_real` (each simulated figure over the
real one); for both, the mean step and its matchmaking and averaging seconds and the
CPU per commit. The real run also reports its peers' run delay per commit (seconds
ready to run but waiting for a core) and `background_load`, the other runnable tasks
on the machine (other work shares its cores): the simulation of a scenario with
"cores" is given that measured load unless `--background` says otherwise, so that
both describe the same machine. `cpu_over_sim` (a real peer's CPU per commit over a
simulated one's) is what the scenario's "cpu_scale" stands for.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
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

from avg_scenario import phases
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


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds the processes have used so far (Linux /proc)."""
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15)
    return total / os.sysconf("SC_CLK_TCK")


def machine_busy_seconds() -> float:
    """CPU seconds every process on the machine has used (all cores, Linux /proc/stat)."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _wait, irq, softirq, steal = map(int, f.readline().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def run_delay_seconds(pids: list[int]) -> float:
    """Seconds the processes' threads were ready to run but waited for a core (Linux
    schedstat: the scheduling latency that CPU time alone does not show)."""
    total = 0
    for pid in pids:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[1])
    return total / 1e9


def _running_threads(pid: int) -> int:
    """How many of the process's threads are running or ready to run."""
    count = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{task}/stat") as f:
            count += f.read().rsplit(")", 1)[1].split()[0] == "R"
    return count


class BackgroundLoad:
    """Samples how many tasks of other work were runnable next to the peers: the
    machine's runnable count (/proc/stat procs_running) less the peers' and this one."""

    def __init__(self, pids: list[int], period_s: float = 0.02) -> None:
        self.pids, self.period_s = pids, period_s
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            with open("/proc/stat") as f:
                line = next(x for x in f if x.startswith("procs_running"))
            ours = sum(_running_threads(pid) for pid in self.pids)
            self.samples.append(max(0, int(line.split()[1]) - ours - 1))

    def stop(self) -> float:
        """The mean number of other runnable tasks while sampling."""
        self._stop.set()
        self._thread.join()
        return sum(self.samples) / len(self.samples) if self.samples else 0.0


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
        pids = [p.pid for p in procs]
        cpu0, all0, t0 = cpu_seconds(pids), machine_busy_seconds(), time.time()
        wait0 = run_delay_seconds(pids)
        background = BackgroundLoad(pids)
        time.sleep(duration)
        load = background.stop()
        cpu1, all1, t1 = cpu_seconds(pids), machine_busy_seconds(), time.time()
        wait1 = run_delay_seconds(pids)
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
        **phases(committed),
        "cpu_s_per_commit": round((cpu1 - cpu0) / len(committed), 4) if committed else None,
        # the share of the machine's cores the peers used (1.0: all of them, all the time)
        "run_delay_s_per_commit": round((wait1 - wait0) / len(committed), 4) if committed else None,
        "background_load": round(load, 2),
        "cpu_busy": round((cpu1 - cpu0) / (t1 - t0) / (os.cpu_count() or 1), 3),
        # the same for every process on the machine (other work shares it too)
        "machine_busy": round((all1 - all0) / (t1 - t0) / (os.cpu_count() or 1), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("scenario")
    parser.add_argument(
        "--background",
        default="measured",
        help='the simulated machine\'s other runnable tasks (with "cores"): a number, '
        'the scenario\'s ("scenario"), or the real run\'s ("measured", the default)',
    )
    args = parser.parse_args()
    scenario = load(args.scenario)
    duration = float(scenario.workload.get("duration_s", 60))
    real = real_run(scenario.peers, scenario.workload, duration)
    if args.background != "scenario":
        background = real["background_load"] if args.background == "measured" else args.background
        workload = {**scenario.workload, "background_load": float(background)}
        scenario = dataclasses.replace(scenario, workload=workload)
    simulated = simulate(scenario)
    simulated["background_load"] = scenario.workload.get("background_load", 0.0)
    ratio = {
        k: round(simulated[k] / real[k], 3) if real.get(k) else None
        for k in ("commits_per_peer_per_min", "group_size_mean", "resyncs")
    }
    # what "cpu_scale" stands for: a real peer's CPU per commit over the simulator's
    sim_cpu = simulated.get("peer_cpu_s_per_commit") or simulated.get("cpu_s_per_commit")
    real_cpu = real["cpu_s_per_commit"]
    real["cpu_over_sim"] = round(real_cpu / sim_cpu, 2) if real_cpu and sim_cpu else None
    print(
        json.dumps({"peers": scenario.peers, "sim": simulated, "real": real, "sim_vs_real": ratio})
    )


if __name__ == "__main__":
    main()
