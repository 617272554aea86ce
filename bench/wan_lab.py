"""Shaped internet links between peers, for bench/wan.py (root only).

One network namespace per peer (`{prefix}p0`, `{prefix}p1`, ...) and one for the
"internet" (`{prefix}inet`, a bridge). Each peer's access link is a userspace link
from the lab (../shared/lab/delaylink.py: this kernel has no netem) with a rate
limit and half the one-way delay in each direction, so between any two peers the
one-way delay is `delay_ms` (RTT 2 x delay_ms) and each peer uploads and downloads
at `rate_mbit` at most, as a home or cloud uplink would let it.

The links use 9000-byte frames: the userspace link handles one frame at a time,
and jumbo frames cut its CPU cost about six times (the training runs on the same
two cores); the rate and delay do not depend on the frame size.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

SUBNET = "10.77.0"  # peer k is SUBNET.(k+1)
MTU = 9000
# Reachability without `ping` (a fresh Debian has none): a TCP connect to a closed
# port of peer 0 comes back refused only if the packets went there and back.
REACH_PROBE = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], 9), timeout=1).close()
except ConnectionRefusedError:
    pass
"""


def _find_delaylink() -> Path:
    """SHOAL_DELAYLINK, else shared/lab/delaylink.py beside this checkout or above it."""
    if os.environ.get("SHOAL_DELAYLINK"):
        return Path(os.environ["SHOAL_DELAYLINK"])
    here = Path(__file__).resolve()
    candidates = [d / "shared" / "lab" / "delaylink.py" for d in here.parents]
    return next((c for c in candidates if c.exists()), candidates[0])


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


class WanLab:
    """`peers` namespaces behind shaped links; always torn down by `down` (or `with`)."""

    def __init__(
        self, peers: int, *, rate_mbit: float, delay_ms: float, prefix: str = "wan-"
    ) -> None:
        if os.geteuid() != 0:
            raise PermissionError("shaped links need root (network namespaces)")
        self.peers = peers
        self.rate_mbit = rate_mbit
        self.delay_ms = delay_ms
        self.prefix = prefix
        self.delaylink = _find_delaylink()
        self._links: list[subprocess.Popen[bytes]] = []

    def ns(self, rank: int) -> str:
        return f"{self.prefix}p{rank}"

    def address(self, rank: int) -> str:
        return f"{SUBNET}.{rank + 1}"

    @property
    def names(self) -> list[str]:
        return [f"{self.prefix}inet", *(self.ns(k) for k in range(self.peers))]

    def up(self) -> None:
        self.down()
        try:
            for name in self.names:
                _ip("netns", "add", name)
                _ip("-n", name, "link", "set", "lo", "up")
            inet = f"{self.prefix}inet"
            _ip("-n", inet, "link", "add", "br0", "type", "bridge")
            _ip("-n", inet, "link", "set", "br0", "mtu", str(MTU), "up")
            for k in range(self.peers):
                self._link(k)
        except BaseException:
            self.down()
            raise

    def _link(self, k: int) -> None:
        inet, port = f"{self.prefix}inet", f"wp{k}"
        proc = subprocess.Popen(
            [
                sys.executable, str(self.delaylink),
                "--ns1", inet, "--if1", port, "--ns2", self.ns(k), "--if2", "eth0",
                "--delay-ms", str(self.delay_ms / 2), "--rate-mbit", str(self.rate_mbit),
                "--lifetime", "86400",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        self._links.append(proc)
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()
        if not line.startswith("READY"):
            raise RuntimeError(f"delaylink for peer {k} did not start: {line!r}")
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, proc.pid, -10)  # a link, not a competitor
        _ip("-n", inet, "link", "set", port, "mtu", str(MTU))
        _ip("-n", inet, "link", "set", port, "master", "br0", "up")
        _ip("-n", self.ns(k), "link", "set", "eth0", "mtu", str(MTU))
        _ip("-n", self.ns(k), "addr", "add", f"{self.address(k)}/24", "dev", "eth0")
        _ip("-n", self.ns(k), "link", "set", "eth0", "up")

    def wait_reachable(self, timeout: float = 20.0) -> None:
        """Until peer 0 answers a TCP connect from every other peer (ARP and links settled)."""
        deadline = time.monotonic() + timeout
        for k in range(1, self.peers):
            probe = ["ip", "netns", "exec", self.ns(k), sys.executable, "-c", REACH_PROBE]
            while True:
                done = subprocess.run(
                    [*probe, self.address(0)], capture_output=True, timeout=10, check=False
                )
                if done.returncode == 0:
                    break
                if time.monotonic() > deadline:
                    detail = done.stderr.decode(errors="replace").strip().splitlines()[-1:]
                    raise TimeoutError(f"peer {k} cannot reach peer 0: {detail}")
                time.sleep(0.2)

    def down(self) -> None:
        for proc in self._links:
            proc.terminate()
        for proc in self._links:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
        self._links.clear()
        for name in self.names:
            subprocess.run(
                ["ip", "netns", "del", name], capture_output=True, timeout=30, check=False
            )

    def __enter__(self) -> WanLab:
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()
