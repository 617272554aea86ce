"""A private swarm of separate `shoal run` processes on loopback: two peers with the
swarm key train together; a peer without it, and one with another key, cannot dial
them, cannot be dialed by them, and `shoal doctor` with the wrong key says so."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from daemon_harness import TINY_TASK, Daemon, cli_env_path, wait_for

pytestmark = pytest.mark.slow

FAST_ROUNDS = {
    "SHOAL_INNER_STEPS": "10",
    "SHOAL_TASK_OPTIONS": TINY_TASK,
    "SHOAL_STRATEGY_OPTIONS": "matchmaking_time=3,round_timeout=15,stall_timeout=3",
}


def _shoal(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shoal.peer", *args],
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
        env=cli_env_path(tmp_path),
    )


def _debug(*daemons: Daemon) -> str:
    return "\n".join(d.tail() for d in daemons)


def _peer_ids(daemon: Daemon) -> set[str]:
    return {c["peer_id"] for c in daemon.status()["connections"]}


@pytest.mark.timeout(360)
def test_keyed_peers_train_while_outsiders_cannot_dial_or_be_dialed(tmp_path: Path) -> None:
    key, other_key = tmp_path / "swarm.key", tmp_path / "other.key"
    for path in (key, other_key):
        made = _shoal(tmp_path, "swarm-key", "new", str(path))
        assert made.returncode == 0 and "fingerprint" in made.stdout, made.stderr
    keyed = ["--swarm-key", str(key)]
    host = Daemon("host", tmp_path, ["--host-experiment", "private", *keyed], FAST_ROUNDS)
    # Outsiders that listen, for the keyed peers to dial: no key, and another key.
    no_key = Daemon("no-key", tmp_path, ["--no-train"], {})
    wrong_key = Daemon("wrong-key", tmp_path, ["--no-train", "--swarm-key", str(other_key)], {})
    daemons = [host, no_key, wrong_key]
    try:
        for d in daemons:
            d.wait_ready()
        # The member dials both outsiders (given as bootstrap peers beside the host)...
        member_args = ["--join", host.join_ref, *keyed, "--bootstrap", host.address]
        member_args += [no_key.address, wrong_key.address]
        member = Daemon("member", tmp_path, member_args, {})
        daemons.append(member)
        # ...and outsiders, each a `shoal run` of its own, dial the host.
        intruders = [
            Daemon("intruder-no-key", tmp_path, ["--no-train", "--bootstrap", host.address], {}),
            Daemon(
                "intruder-wrong-key",
                tmp_path,
                ["--no-train", "--swarm-key", str(other_key), "--bootstrap", host.address],
                {},
            ),
        ]
        daemons += intruders
        for intruder in intruders:
            # A first start whose bootstrap peers all refuse it stops with an error.
            assert intruder.proc.wait(timeout=120) != 0, intruder.tail()
            assert "closed by peer" in intruder.log(), intruder.tail()
        member.wait_ready()

        def a_round_of_two() -> int | None:
            common = set(host.committed_rounds()) & set(member.committed_rounds())
            both = [s for s in common if f"outer step {s}, 2 peers" in host.log()]
            return max(both) if both else None

        step = wait_for(
            "a round of the keyed pair", a_round_of_two, 180, debug=lambda: _debug(*daemons)
        )
        assert host.committed_rounds()[step] == member.committed_rounds()[step]

        access = host.status()["access"]
        assert access["mode"] == "swarm-key" and access["swarm_key_fingerprint"]
        assert access["refusals_by_reason"]["swarm_key"] >= 2  # one per intruder at least
        assert str(key.read_text()).split()[-1] not in str(host.status())  # never the key
        assert 'shoal_access_refusals_total{reason="swarm_key"}' in host.get("/metrics")
        # The member's dials to the outsiders went unanswered; the keyed outsider counted
        # its refusal; nobody connected across the key.
        assert member.status()["access"]["unanswered_handshakes"] >= 2
        assert wrong_key.status()["access"]["refusals_by_reason"]["swarm_key"] >= 1
        members = {host.status()["peer_id"], member.status()["peer_id"]}
        outsiders = {no_key.status()["peer_id"], wrong_key.status()["peer_id"]}
        assert _peer_ids(host) <= members and _peer_ids(member) <= members
        assert not _peer_ids(no_key) and not _peer_ids(wrong_key)
        assert not outsiders & (_peer_ids(host) | _peer_ids(member))

        doctor = _shoal(
            tmp_path, "doctor", "--swarm-key", str(other_key), "--bootstrap", host.address
        )
        assert doctor.returncode == 1, doctor.stdout + doctor.stderr
        assert "the swarm key probably differs" in doctor.stdout
    finally:
        for d in daemons:
            d.kill()
