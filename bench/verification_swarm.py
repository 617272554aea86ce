"""What verification costs a real swarm: `shoal run` daemons on loopback, verification
on and then off (same experiment settings, one arm after the other on the same
machine), training throughput and bytes sent per committed round compared.

Used by `bench/verification.py --overhead-seconds S`; runnable alone:

    python bench/verification_swarm.py [--seconds 180] [--peers 4]

Every daemon trains the built-in task at its default size with one CPU thread. The
audit rate is the default one and new peers are not put on probation (the
probation rate is set to the default rate), so the figure is the steady state.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

START_TIMEOUT = 120.0


class Daemon:
    def __init__(self, name: str, home: Path, args: list[str], env: dict[str, str]) -> None:
        self.name = name
        home.mkdir(parents=True, exist_ok=True)
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")}
        full_env.update(
            HOME=str(home),
            SHOAL_LISTEN="/ip4/127.0.0.1/tcp/0",
            SHOAL_STATUS_ADDR="127.0.0.1:0",
            SHOAL_THREADS="1",
            OMP_NUM_THREADS="1",
            **env,
        )
        self.lines: list[str] = []
        self.ready = threading.Event()
        self.log = (home / "stderr.log").open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "shoal.peer", "run", *args],
            stdout=subprocess.PIPE,
            stderr=self.log,
            env=full_env,
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            self.lines.append(line)
            if line.startswith("Status: "):
                self.ready.set()
        self.ready.set()

    def line(self, pattern: str) -> str:
        for line in self.lines:
            m = re.search(pattern, line)
            if m:
                return m.group(1)
        raise RuntimeError(f"{self.name} printed no {pattern!r}")

    def status(self) -> dict[str, Any]:
        url = self.line(r"^Status: (\S+)").rstrip("/") + "/status"
        with urllib.request.urlopen(url, timeout=10) as response:
            return json.loads(response.read())  # type: ignore[no-any-return]

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=30)
        self.log.close()


def _wait(check: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except OSError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"timed out waiting for {what}")


def run_arm(verify: bool, peers: int, seconds: float, workdir: Path) -> dict[str, Any]:
    """Tokens/s of the swarm and bytes sent per committed round, over `seconds`."""
    arm = "on" if verify else "off"
    options = "audit_probation_rate=0.05" if verify else ""
    env = {"SHOAL_STRATEGY_OPTIONS": options} if options else {}
    host = Daemon("host", workdir / arm / "host", ["--host-experiment", f"bench-{arm}",
                                                   "--verify", arm], env)  # fmt: skip
    daemons = [host]
    try:
        host.ready.wait(START_TIMEOUT)
        join = ["--join", host.line(r"--join (\S+)"), "--bootstrap",
                host.line(r"^\s*(/ip4/127\.0\.0\.1/\S+)")]  # fmt: skip
        daemons += [Daemon(f"peer{i}", workdir / arm / f"peer{i}", join, {})
                    for i in range(1, peers)]  # fmt: skip
        for d in daemons:
            d.ready.wait(START_TIMEOUT)
        # Measured from the first round every peer took part in (joins and loads done).
        _wait(lambda: all((d.status().get("outer_step") or 0) >= 2 for d in daemons),
              START_TIMEOUT * 2, "every peer past its second round")  # fmt: skip
        before = [d.status() for d in daemons]
        t0 = time.monotonic()
        time.sleep(seconds)
        after = [d.status() for d in daemons]
        elapsed = time.monotonic() - t0
    finally:
        for d in daemons:
            d.stop()
    tokens = sum(a["tokens"] - b["tokens"] for a, b in zip(after, before, strict=True))
    sent = sum(a["bytes_sent"] - b["bytes_sent"] for a, b in zip(after, before, strict=True))
    rounds = max(a["outer_step"] for a in after) - min(b["outer_step"] for b in before)
    audits = sum(((a.get("verification") or {}).get("audits_done") or 0) for a in after)
    return {
        "tokens_per_s": tokens / elapsed,
        "bytes_sent": sent,
        "rounds": rounds,
        "bytes_per_round": sent / max(1, rounds),
        "audits": audits,
        "seconds": elapsed,
    }


def reveal_bytes() -> int:
    """What one audit's reveal moves: the segment's start parameters and the two Adam
    moments, its end parameters and the run's final parameters (float32)."""
    from shoal.peer.training.tasks.bytegpt import make_task

    params = sum(p.numel() for p in make_task({}).make_model(0).parameters())
    return 5 * 4 * params


def measure(seconds: float, peers: int, rate: float = 0.05) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="shoal-verify-bench-"))
    try:
        on = run_arm(True, peers, seconds, workdir)
        off = run_arm(False, peers, seconds, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    # How many audits fall in a window is a matter of luck (Poisson, about rate x peers
    # per round): the expectation replaces the audits seen by the audits expected.
    per_audit = reveal_bytes()
    rest = (
        on["bytes_per_round"]
        - off["bytes_per_round"]
        - on["audits"] * per_audit / max(1, on["rounds"])
    )
    expected = rest + rate * peers * per_audit
    return {
        "compute_overhead": 1 - on["tokens_per_s"] / off["tokens_per_s"],
        "bytes_overhead": on["bytes_per_round"] / off["bytes_per_round"] - 1,
        "bytes_overhead_expected": expected / off["bytes_per_round"],
        "reveal_bytes": per_audit,
        "on": on,
        "off": off,
        "peers": peers,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=180.0, help="measured time per arm")
    parser.add_argument("--peers", type=int, default=4)
    args = parser.parse_args()
    print(json.dumps(measure(args.seconds, args.peers)))


if __name__ == "__main__":
    main()
