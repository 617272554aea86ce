"""Rounds commit over a slow, far link with the default settings (issue 20).

A public host and a joiner behind NAT router A, whose uplink is shaped to
5 Mbit/s with 150 ms one-way delay each way (../shared/lab: delaylink.py), train the
default strategy with no averaging option set. The deadlines must come from what
the peers measure (round times, link rates), not from constants tuned on loopback:
the rounds commit, both peers hold the same parameters, and none is aborted for a
stall that was only the link being slow.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from daemon_harness import ROUND_RE, TINY_TASK, Daemon
from lab import PUB_IP, Lab, lab_unavailable
from lab_swarm import _identity

pytestmark = [
    pytest.mark.lab,
    pytest.mark.slow,
    pytest.mark.skipif(lab_unavailable() is not None, reason=str(lab_unavailable())),
]

PORT = 4001


def two_peer_rounds(d: Daemon) -> dict[int, str]:
    return {int(m[1]): m[3] for m in ROUND_RE.finditer(d.log()) if m[2] == "2"}


@pytest.mark.timeout(240)
def test_rounds_commit_over_a_5_mbit_150_ms_link_with_default_settings(tmp_path: Path) -> None:
    env = {
        "SHOAL_LISTEN": f"/ip4/0.0.0.0/tcp/{PORT}",
        "SHOAL_STATUS_ADDR": "127.0.0.1:8080",
        "SHOAL_INNER_STEPS": "20",  # (how often rounds come, not how they are timed)
        "SHOAL_TASK_OPTIONS": TINY_TASK,
    }
    lab = Lab("sl-")
    lab.sh("up")
    daemons: list[Daemon] = []
    try:
        lab.sh("delay", "natA", "150", "0", "5")
        host_id = _identity(tmp_path, "pub")
        pub = Daemon("pub", tmp_path, ["--host-experiment", "slow"], env, netns=lab.ns("pub"))
        daemons.append(pub)
        pub.wait_ready()
        boot = f"/ip4/{PUB_IP}/tcp/{PORT}/p2p/{host_id}"
        joiner = Daemon(
            "a1", tmp_path, ["--bootstrap", boot, "--join", f"slow@{host_id}"], env,
            netns=lab.ns("a1"),
        )  # fmt: skip
        daemons.append(joiner)
        deadline = time.monotonic() + 200
        while time.monotonic() < deadline:
            assert all(d.alive() for d in daemons), "\n".join(d.tail(60) for d in daemons)
            common = set(two_peer_rounds(pub)) & set(two_peer_rounds(joiner))
            if len(common) >= 3:
                break
            time.sleep(1.0)
        logs = "\n".join(d.tail(30) for d in daemons)
        a, b = two_peer_rounds(pub), two_peer_rounds(joiner)
        common = sorted(set(a) & set(b))
        assert len(common) >= 3, logs
        assert all(a[s] == b[s] for s in common), logs
        assert "round aborted" not in pub.log() + joiner.log(), logs
    finally:
        for d in daemons:
            d.kill()
        lab.sh("down")
