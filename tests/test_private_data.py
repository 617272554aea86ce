"""End to end: experiments that strangers join, as `shoal run` daemons on loopback.

Each peer brings its own text (`--data`): the host says in one line that the
experiment is unverified (a referee cannot re-execute work on data it does not
have), refuses `--verify on`, and the peers train together with nobody accused.
A custom task runs on a joiner only when the joiner names it.
(`bench/private_data.py` runs the first with four peers for minutes.)
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from .daemon_harness import ROUND_RE, TINY_TASK, Daemon, cli_env_path, wait_for

pytestmark = pytest.mark.slow  # swarms of daemons

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "custom_task.py"
ROUNDS = {
    "SHOAL_INNER_STEPS": "10",
    "SHOAL_STRATEGY_OPTIONS": "matchmaking_time=3,round_timeout=20,stall_timeout=3",
}
UNVERIFIED = "hosted UNVERIFIED"


def own_text(tmp_path: Path, name: str) -> str:
    """A text file of this peer's own, different from every other peer's."""
    path = tmp_path / f"{name}.txt"
    path.write_text(f"{name} writes its own words, line after line. " * 300)
    return str(path)


def rounds_with(d: Daemon, peers: int) -> list[int]:
    """The outer steps `d` committed in a group of at least `peers`."""
    return [int(m.group(1)) for m in ROUND_RE.finditer(d.log()) if int(m.group(2)) >= peers]


def nobody_accused(d: Daemon) -> dict[str, Any]:
    v = d.status()["verification"]
    assert v["enabled"] is False, v
    assert v["banned"] == [] and v["convictions"] == [] and v["convicted_self"] is False, v
    return v  # type: ignore[no-any-return]


@pytest.mark.timeout(300)
def test_peers_each_on_their_own_text_train_unverified_and_nobody_is_accused(
    tmp_path: Path,
) -> None:
    args = ["--host-experiment", "own-words", "--data", own_text(tmp_path, "host")]
    host = Daemon("host", tmp_path, args, {**ROUNDS, "SHOAL_TASK_OPTIONS": TINY_TASK})
    peers = [host]
    try:
        host.wait_ready()
        join = ["--join", host.join_ref, "--bootstrap", host.address]
        for name in ("alice", "bob"):
            peers.append(Daemon(name, tmp_path, [*join, "--data", own_text(tmp_path, name)], {}))
        for d in peers:
            d.wait_ready()
        wait_for("two rounds of the three peers on every peer",
                 lambda: all(len(rounds_with(d, 3)) >= 2 for d in peers), 180,
                 debug=lambda: "\n".join(d.tail(30) for d in peers))  # fmt: skip
        for d in peers:
            nobody_accused(d)
            assert d.alive()
        said = [line for line in host.log().splitlines() if UNVERIFIED in line]
        assert len(said) == 1 and "'own-words'" in said[0], said
        assert all(UNVERIFIED not in d.log() for d in peers[1:])
    finally:
        for d in peers:
            d.kill()


@pytest.mark.timeout(120)
def test_verify_on_for_an_experiment_on_each_peers_own_text_is_refused_in_one_line(
    tmp_path: Path,
) -> None:
    argv = ["run", "--host-experiment", "own-words", "--data", own_text(tmp_path, "host")]
    argv += ["--verify", "on", "--status-addr", "off", "--task-option", TINY_TASK]
    daemon = subprocess.run(
        [sys.executable, "-m", "shoal.peer", *argv],
        check=False,
        capture_output=True,
        text=True,
        timeout=100,
        env={**cli_env_path(tmp_path), "SHOAL_LISTEN": "/ip4/127.0.0.1/tcp/0"},
    )
    assert daemon.returncode == 1, daemon.stderr[-2000:]
    last = daemon.stderr.strip().splitlines()[-1]
    assert last.startswith("shoal: error: --verify on: experiment 'own-words' trains on each "
                           "peer's own --data"), last  # fmt: skip
    assert "Traceback" not in daemon.stderr


@pytest.mark.timeout(300)
def test_a_custom_task_runs_only_on_the_joiners_that_name_it(tmp_path: Path) -> None:
    code = tmp_path / "code" / "custom_task.py"
    code.parent.mkdir()
    shutil.copy(EXAMPLE, code)
    spec = f"{code}:make_task"
    small = "context=4,embedding=4,hidden=16,batch_size=8"
    args = ["--host-experiment", "mlp", "--task", spec, "--data", own_text(tmp_path, "host")]
    host = Daemon("host", tmp_path, args, {**ROUNDS, "SHOAL_TASK_OPTIONS": small})
    peers = [host]
    try:
        host.wait_ready()
        assert any(f"--task {spec}" in line for line in host.stdout_lines), host.stdout_lines
        join = ["--join", host.join_ref, "--bootstrap", host.address]
        stranger = Daemon("stranger", tmp_path, [*join, "--data", own_text(tmp_path, "s")], {})
        peers.append(stranger)
        friend_args = [*join, "--allow-task", spec, "--data", own_text(tmp_path, "friend")]
        friend = Daemon("friend", tmp_path, friend_args, {})
        peers.append(friend)
        wait_for("the stranger to refuse the task", lambda: not stranger.alive(), 90)
        refusal = stranger.log().strip().splitlines()[-1]
        assert refusal.startswith(f"shoal: error: the experiment runs custom task {spec!r}")
        assert f"--allow-task {spec}" in refusal
        friend.wait_ready()
        wait_for("a round of the host and the friend",
                 lambda: all(rounds_with(d, 2) for d in (host, friend)), 120,
                 debug=lambda: "\n".join(d.tail(30) for d in peers))  # fmt: skip
        for d in (host, friend):
            nobody_accused(d)
    finally:
        for d in peers:
            d.kill()
