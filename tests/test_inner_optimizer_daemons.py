"""End to end: a verified DiLoCo experiment hosted with `--inner-optimizer SGD`. A joiner
takes the optimizer from the manifest (it sets nothing), downloads the state, and the
two commit equal fingerprints while auditing each other's SGD steps without a failure;
the joiner, restarted, resumes from its checkpoint (its SGD momentum included) and its
work passes the host's audits again."""

from __future__ import annotations

from pathlib import Path

import pytest

from .daemon_harness import TINY_TASK, Daemon, wait_for

pytestmark = pytest.mark.slow  # two daemons

ROUNDS = {
    "SHOAL_INNER_STEPS": "10",
    "SHOAL_TASK_OPTIONS": TINY_TASK,
    "SHOAL_STRATEGY_OPTIONS": "matchmaking_time=3,round_timeout=15,stall_timeout=3",
}
SGD = "SGD:momentum=0.9,nesterov=true"


def audited_and_agreeing(host: Daemon, joiner: Daemon, passed: int, *, after: int = -1) -> bool:
    """A round after outer step `after` that both committed with one fingerprint, and
    more audits passed at the host than `passed`."""
    rounds = [d.committed_rounds() for d in (host, joiner)]
    common = {s for s in set(rounds[0]) & set(rounds[1]) if s > after}
    agree = any(rounds[0][s] == rounds[1][s] for s in common)
    return agree and host.status()["verification"]["audits_passed"] > passed


@pytest.mark.timeout(240)
def test_a_joiner_trains_and_audits_with_the_hosts_sgd_across_a_restart(tmp_path: Path) -> None:
    host = Daemon("host", tmp_path, ["--host-experiment", "sgd", "--inner-optimizer", SGD], ROUNDS)
    peers = [host]
    try:
        host.wait_ready()
        join = ["--join", host.join_ref, "--bootstrap", host.address]
        joiner = Daemon("joiner", tmp_path, join, {})
        peers.append(joiner)
        joiner.wait_ready()
        assert "inner optimizer SGD (momentum=0.9, nesterov=true)" in joiner.log()
        wait_for("an audited round both commit", lambda: audited_and_agreeing(host, joiner, 0),
                 120, debug=lambda: "\n".join(d.tail(40) for d in peers))  # fmt: skip

        code, _ = joiner.terminate()
        assert code == 0, joiner.tail()
        before = max(joiner.committed_rounds())
        logged = len(joiner.log())
        passed = host.status()["verification"]["audits_passed"]
        joiner = Daemon("joiner", tmp_path, join, {})
        peers[1] = joiner
        joiner.wait_ready()
        assert "resumed from checkpoint" in joiner.log()[logged:]
        # Rounds after the restart's, and audits of them: work from the resumed state.
        wait_for("the host to audit the resumed joiner's work",
                 lambda: audited_and_agreeing(host, joiner, passed + 1, after=before + 1), 120,
                 debug=lambda: "\n".join(d.tail(40) for d in peers))  # fmt: skip
        states = [d.status()["verification"] for d in peers]
        assert all(v["audits_failed"] == 0 and v["banned"] == [] for v in states), states
    finally:
        for d in peers:
            d.kill()
