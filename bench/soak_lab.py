"""The world of bench/soak.py (root only): the NAT lab, peers as `shoal run`
processes in its namespaces, and the faults the soak injects.

The lab (../shared/lab/lab.sh, with its own prefix) has one public host and
three hosts behind NAT routers (A and C: MASQUERADE; B: --random-fully, which
no hole punch gets through). Several peers share a namespace on distinct ports:
three public, and seven behind the NATs (3 + 2 + 2).

Faults between namespaces are iptables rules inside them, tagged with a comment
and removed when the fault ends (and with the namespaces by `lab.sh down`):

- a partition between two namespaces drops every packet between their public
  addresses (as seen after NAT), both ways; relayed paths through a third one
  still work, as they would on the internet;
- packet loss drops a share of the packets a namespace receives at random
  (the `statistic` match: this kernel has no netem).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["PUBLIC_IP", "LabError", "PeerProcess", "SoakLab", "find_lab_sh"]

# What the other namespaces see of each one: its own address, or its NAT's.
PUBLIC_IP = {
    "pub": "198.51.100.10",
    "a1": "198.51.100.11",
    "b1": "198.51.100.12",
    "c1": "198.51.100.13",
}
TAG = "shoal-soak"
CLOCK_SHIM = Path(__file__).resolve().with_name("soak_clock")


class LabError(Exception):
    pass


# Resolved here, in the parent: between fork and exec the child only calls it.
_prctl = ctypes.CDLL(None, use_errno=True).prctl
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """(preexec_fn) SIGKILL the peer when the soak's thread that started it dies: an
    interrupted soak must not leave ten daemons training. Peers are started from the
    soak's main thread, which outlives them."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def find_lab_sh() -> Path:
    """SHOAL_LAB_SH, else shared/lab/lab.sh beside this checkout or above it."""
    if os.environ.get("SHOAL_LAB_SH"):
        return Path(os.environ["SHOAL_LAB_SH"])
    here = Path(__file__).resolve()
    candidates = [d / "shared" / "lab" / "lab.sh" for d in here.parents]
    return next((c for c in candidates if c.exists()), candidates[0])


class SoakLab:
    """The lab under `prefix`; `down` removes everything it made."""

    def __init__(self, prefix: str = "soak-") -> None:
        if os.geteuid() != 0:
            raise PermissionError("the soak needs root (network namespaces and iptables)")
        self.prefix = prefix
        self.lab_sh = find_lab_sh()
        self.env = {**os.environ, "LAB_PREFIX": prefix}

    def ns(self, name: str) -> str:
        return f"{self.prefix}{name}"

    def sh(self, *args: str, timeout: float = 180.0) -> str:
        res = subprocess.run(
            [str(self.lab_sh), *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if res.returncode != 0:
            raise LabError(f"lab.sh {' '.join(args)}: {res.stderr.strip()[-500:]}")
        return res.stdout

    def up(self) -> None:
        self.sh("up")

    def down(self) -> None:
        self.sh("down")

    def iptables(self, ns: str, *rule: str) -> None:
        cmd = ["ip", "netns", "exec", self.ns(ns), "iptables", "-w", *rule]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)
        if res.returncode != 0:
            raise LabError(f"{' '.join(cmd)}: {res.stderr.strip()}")

    def _rules(self, ns: str, rules: list[list[str]]) -> Callable[[], None]:
        for rule in rules:
            self.iptables(ns, "-I", *rule, "-m", "comment", "--comment", TAG, "-j", "DROP")

        def undo() -> None:
            for rule in rules:
                try:
                    self.iptables(ns, "-D", *rule, "-m", "comment", "--comment", TAG, "-j", "DROP")
                except LabError:
                    pass  # (gone with the lab already)

        return undo

    def partition(self, a: str, b: str) -> Callable[[], None]:
        """Drop everything between namespaces `a` and `b`; returns the undo."""
        undo_a = self._rules(a, [["OUTPUT", "-d", PUBLIC_IP[b]], ["INPUT", "-s", PUBLIC_IP[b]]])
        undo_b = self._rules(b, [["OUTPUT", "-d", PUBLIC_IP[a]], ["INPUT", "-s", PUBLIC_IP[a]]])

        def undo() -> None:
            undo_a()
            undo_b()

        return undo

    def loss(self, ns: str, probability: float) -> Callable[[], None]:
        """Drop `probability` of what `ns` receives from other namespaces; the undo."""
        match = ["-m", "statistic", "--mode", "random", "--probability", f"{probability:.3f}"]
        return self._rules(ns, [["INPUT", "!", "-i", "lo", *match]])


@dataclass
class PeerProcess:
    """One `shoal run` in a namespace; its data directory outlives its processes."""

    name: str
    ns: str  # the lab's name for it ("pub", "a1", ...)
    netns: str  # the namespace's full name
    port: int
    status_port: int
    home: Path
    args: list[str]
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0
    clock_offset_s: float = 0.0
    stopped: bool = False
    lifetimes: list[list[tuple[float, float, int]]] = field(default_factory=list)
    started_at: list[tuple[float, float]] = field(default_factory=list)  # (time, clock offset)

    @property
    def data_dir(self) -> Path:
        return self.home / ".shoal"

    @property
    def log_path(self) -> Path:
        return self.home / "daemon.log"

    def start(self, *, clock_offset_s: float = 0.0) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")}
        env.update(self.env)
        env.update(
            HOME=str(self.home),
            SHOAL_DATA_DIR=str(self.data_dir),
            SHOAL_LISTEN=f"/ip4/0.0.0.0/tcp/{self.port}",
            SHOAL_STATUS_ADDR=f"127.0.0.1:{self.status_port}",
        )
        self.clock_offset_s = clock_offset_s
        if clock_offset_s:
            # bench/soak_clock/sitecustomize.py moves time.time by this much.
            env["SHOAL_SOAK_CLOCK_OFFSET_S"] = str(clock_offset_s)
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(CLOCK_SHIM),
                                                              env.get("PYTHONPATH")]))  # fmt: skip
        self.home.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            log.write(f"--- start {self.starts + 1} (clock {clock_offset_s:+.0f} s)\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                ["ip", "netns", "exec", self.netns, sys.executable, "-m", "shoal.peer", "run",
                 *self.args],
                stdout=subprocess.DEVNULL, stderr=log, env=env,
                preexec_fn=_die_with_parent,  # noqa: PLW1509 (prctl only)
            )  # fmt: skip
        self.starts += 1
        self.started_at.append((time.time(), clock_offset_s))
        self.stopped = False
        self.lifetimes.append([])

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive:
            assert self.proc is not None
            self.proc.send_signal(sig)

    def kill(self) -> None:
        if self.proc is not None:
            if self.stopped:
                self.signal(signal.SIGCONT)
            self.signal(signal.SIGKILL)
            self.proc.wait(timeout=30)
        self.stopped = False

    def terminate(self, timeout: float = 30.0) -> int | None:
        """Graceful: SIGTERM, then SIGKILL after `timeout`; the exit code."""
        if self.proc is None:
            return None
        if self.stopped:
            self.signal(signal.SIGCONT)
            self.stopped = False
        self.signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return None

    def sample(self, now: float) -> None:
        """RSS and open descriptors of the running process, into its lifetime's series."""
        if not self.alive or self.stopped:
            return
        assert self.proc is not None
        try:
            status = Path(f"/proc/{self.proc.pid}/status").read_text()
            fds = len(os.listdir(f"/proc/{self.proc.pid}/fd"))
        except OSError:
            return
        rss_kb = next(
            (int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), 0
        )
        self.lifetimes[-1].append((now, rss_kb / 1024, fds))


def wait_until(check: Callable[[], bool], timeout: float, every: float = 0.5) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(every)
    return True
