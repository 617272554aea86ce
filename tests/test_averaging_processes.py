"""Averaging across separate OS processes, where a crash (kill -9, SIGSTOP) is the point.

Each peer is `tests/averaging_peer.py`; it reports every step as a JSON line.
Inputs are seeded by (peer, round), so a result can be checked against the
float64 mean of exactly the inputs of the members that committed it.
"""

from __future__ import annotations

import json
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import prefork
import pytest
from daemon_harness import die_with_parent

pytestmark = pytest.mark.slow  # swarms of processes

PEER_SCRIPT = str(Path(__file__).with_name("averaging_peer.py"))


class Peer:
    """One averaging process; its reports are read with deadlines, never blocking forever."""

    def __init__(self, args: list[str], log_dir: Path, name: str, *, wait: bool = True) -> None:
        """Starts the process; with `wait`, returns once it is ready (else call
        `ready`: processes started together import torch on both cores at once)."""
        self.name = name
        self.stderr_path = log_dir / f"{name}.stderr"
        with self.stderr_path.open("wb") as err:
            self.proc = prefork.popen(  # (forked from a process that imported torch)
                [sys.executable, PEER_SCRIPT, *args],
                stdout=subprocess.PIPE,
                stderr=err,
                env={**os.environ, "OMP_NUM_THREADS": "1"},
                preexec_fn=die_with_parent,
            )
        # Its lines are read as they come, by a thread: a peer whose pipe filled while
        # the test waited on another would block in `print`, its event loop with it
        # (rounds of a settled swarm take a fifth of a second: 64 KB in about 15 s).
        self._lines: queue.Queue[bytes | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True, name=f"{name} stdout")
        self._reader.start()
        self.reports: list[dict[str, Any]] = []
        self.peer_id = self.addr = ""
        if wait:
            self.ready()

    def ready(self, timeout: float = 60) -> None:
        """Waits for the process's first report, which says it listens (and where)."""
        hello = self.next(timeout)
        assert hello["event"] == "ready", hello
        self.peer_id, self.addr = hello["peer"], hello["addr"]

    def _read(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            self._lines.put(line)
        self._lines.put(None)  # (the process closed its stdout: it exited)

    def _poll(self, timeout: float) -> dict[str, Any] | None:
        try:
            line = self._lines.get(timeout=timeout) if timeout > 0 else self._lines.get_nowait()
        except queue.Empty:
            return None
        if line is None:
            self._lines.put(None)  # (for every later call too)
            raise AssertionError(f"{self.name} exited:\n{self.stderr_path.read_text()[-3000:]}")
        report = json.loads(line)
        self.reports.append(report)
        return report

    def next(self, timeout: float) -> dict[str, Any]:
        report = self._poll(timeout)
        if report is None:
            raise AssertionError(
                f"{self.name}: no report for {timeout}s:\n{self.stderr_path.read_text()[-3000:]}"
            )
        return report

    def drain(self) -> list[dict[str, Any]]:
        out = []
        while (r := self._poll(0)) is not None:
            out.append(r)
        return out

    def next_commit(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            r = self.next(max(0.01, deadline - time.monotonic()))
            if r["event"] == "step" and r["committed"]:
                return r

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(timeout=10)
        self._reader.join(timeout=10)  # (at the end of its output, the process gone)
        self.proc.stdout.close()  # type: ignore[union-attr]


@contextmanager
def swarm(tmp_path: Path, n: int, *extra: str, checkers: int = 0) -> Iterator[list[Peer]]:
    """`n` peers; the first `checkers` check each result against float64 (costs CPU)."""
    peers: list[Peer] = []
    try:
        for i in range(n):
            # Every peer but the first bootstraps from the first: they start together.
            boot = ["--bootstrap", peers[0].addr] if peers else []
            check = ["--check"] if i < checkers else []
            peers.append(Peer([*boot, *check, *extra], tmp_path, f"peer{i}", wait=not peers))
        for p in peers[1:]:
            p.ready()
        yield peers
    finally:
        for p in peers:
            p.close()


def full_round(peers: list[Peer], timeout: float = 60) -> list[dict[str, Any]]:
    """Each peer's first commit of a round with all of `peers` (the first rounds may
    have formed while the last peers were still starting)."""
    out = []
    for p in peers:
        while len((r := p.next_commit(timeout))["members"]) != len(peers):
            pass
        out.append(r)
    assert len({r["round_id"] for r in out}) == 1
    return out


def _first_commit_without(peer: Peer, member: str, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while member in (r := peer.next_commit(max(0.1, deadline - time.monotonic())))["members"]:
        pass
    return r


def spawn(tmp_path: Path, peers: list[Peer], name: str, *extra: str) -> Peer:
    alive = [p for p in peers if p.proc.poll() is None]
    return Peer(["--bootstrap", random.choice(alive).addr, *extra], tmp_path, name)


def commits_by_round(peers: list[Peer]) -> dict[str, list[dict[str, Any]]]:
    by_round: dict[str, list[dict[str, Any]]] = {}
    for p in peers:
        for r in p.reports:
            if r.get("event") == "step" and r["committed"]:
                by_round.setdefault(r["round_id"], []).append({**r, "peer": p.peer_id})
    return by_round


def assert_rounds_consistent(peers: list[Peer]) -> dict[str, list[dict[str, Any]]]:
    """Every member of every committed round reports it, with identical bits."""
    by_round = commits_by_round(peers)
    for round_id, reports in by_round.items():
        assert len({r["sha"] for r in reports}) == 1, f"round {round_id[:12]} diverged"
        assert len({r["fingerprint"] for r in reports}) == 1
        members = set(reports[0]["members"])
        assert all(set(r["members"]) == members for r in reports)
    return by_round


# --- A1, A2 -------------------------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_a1_eight_peers_twenty_rounds_bit_identical_and_exact(tmp_path: Path) -> None:
    size, rounds = 2_000_000, 20
    args = ["--size", str(size), "--rounds", str(rounds), "--min-group", "8", "--target-group", "8"]
    # one peer checks every result against the float64 mean of the members' inputs
    with swarm(tmp_path, 8, *args, checkers=1) as peers:
        for _ in range(rounds):
            reports = [p.next_commit(timeout=60) for p in peers]
            assert len({r["round_id"] for r in reports}) == 1
            assert len({r["sha"] for r in reports}) == 1
            assert all(len(r["members"]) == 8 for r in reports)
            # the butterfly's volume: every peer sends all but its own part, twice
            assert 1.0 <= sum(r["bytes"] for r in reports) / (8 * 2 * (7 / 8) * size * 4) < 1.01
    checked = [r["err"] for r in peers[0].reports if "err" in r]
    assert len(checked) == rounds
    assert max(checked) <= 1e-6


@pytest.mark.timeout(300)
def test_a2_eight_peers_int8_bit_identical_and_a_quarter_of_the_bytes(tmp_path: Path) -> None:
    size, rounds = 2_000_000, 20
    args = ["--size", str(size), "--rounds", str(rounds), "--min-group", "8", "--target-group", "8"]
    with swarm(tmp_path, 8, *args, "--codec", "int8") as peers:
        sent = []
        for _ in range(rounds):
            reports = [p.next_commit(timeout=60) for p in peers]
            assert len({r["round_id"] for r in reports}) == 1
            assert len({r["sha"] for r in reports}) == 1
            sent.append(sum(r["bytes"] for r in reports))
    # What the float32 run puts on the wire (measured equal to this, plus headers):
    # each peer sends all but its own part twice (reduce-scatter, then all-gather).
    float32_bytes = 8 * 2 * (7 / 8) * size * 4
    assert max(sent) <= 0.3 * float32_bytes


# --- A3 -----------------------------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_a3_kill_one_of_eight_mid_round_survivors_commit_their_mean(tmp_path: Path) -> None:
    size = 4_000_000
    args = ["--size", str(size), "--min-group", "7", "--target-group", "8"]
    with swarm(tmp_path, 8, *args, checkers=1) as peers:
        first = full_round(peers)
        victim, survivors = peers[3], [p for p in peers if p is not peers[3]]
        # Rounds went on while the peers were read: reports queued so far are history.
        # Time the kill from a round that ends now, to land inside the next one
        # (rounds take about this long).
        for p in peers:
            p.drain()
        peers[0].next_commit(timeout=60)
        time.sleep(random.uniform(0.05, max(0.1, first[0]["seconds"] * 0.8)))
        victim.kill()
        killed_at = time.time()
        # A survivor's first commits may be rounds that completed (for it) just before
        # the kill: its first round without the victim is the one that must be shared.
        after = [_first_commit_without(p, victim.peer_id, timeout=60) for p in survivors]
        assert len({r["round_id"] for r in after}) == 1
        assert len({r["sha"] for r in after}) == 1
        assert all(victim.peer_id not in r["members"] for r in after)
        assert all(len(r["members"]) == 7 for r in after)
        assert max(r["t"] for r in after) - killed_at < 5 + first[0]["seconds"] + 2
        assert after[0]["err"] <= 1e-6  # peers[0], the checker, is a survivor


# --- A5 -----------------------------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_a5_a_stopped_peer_is_left_behind_and_must_resync(tmp_path: Path) -> None:
    args = ["--size", "2000000", "--min-group", "2", "--target-group", "6", "--stall-timeout", "5"]
    with swarm(tmp_path, 6, *args) as peers:
        full_round(peers)
        stopped, others = peers[2], [p for p in peers if p is not peers[2]]
        time.sleep(0.2)
        stopped.kill(signal.SIGSTOP)
        stopped_at = time.time()
        # The others commit without it within the heartbeat deadline plus a round.
        deadline = stopped_at + 15 + 10
        while True:
            after = [p.next_commit(timeout=max(0.1, deadline - time.time())) for p in others]
            if all(stopped.peer_id not in r["members"] for r in after):
                break
        assert max(r["t"] for r in after) - stopped_at < 25
        for p in others:
            p.next_commit(timeout=30)
        stopped.kill(signal.SIGCONT)
        # It may finish the round it was in: aborting, or committing where the others
        # committed that round with it (stopped after it had sent its part, with rounds
        # a fifth of a second long). Then it must re-sync before its next commit, and
        # from then on it matches the others bit for bit.
        rejoined = stopped.next_commit(timeout=60)
        if any(r["event"] == "step" and r["committed"] and r["round_id"] == rejoined["round_id"]
               and stopped.peer_id in r["members"] for p in others for r in p.reports):  # fmt: skip
            rejoined = stopped.next_commit(timeout=60)
        before = [r for r in stopped.reports if r["event"] == "step"]
        since_stop = before[before.index(rejoined) - 1 :: -1]
        assert any(r["resynced"] for r in since_stop), since_stop
        for p in others:
            p.drain()
    by_round = assert_rounds_consistent(peers)
    assert rejoined["round_id"] in by_round


# --- A6 -----------------------------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_a6_a_newcomer_is_admitted_at_the_next_round_and_matches(tmp_path: Path) -> None:
    args = ["--size", "100000", "--min-group", "2", "--target-group", "8", "--keep-state"]
    with swarm(tmp_path, 4, *args) as peers:
        full_round(peers)
        newcomer = spawn(tmp_path, peers, "newcomer", *args)
        peers.append(newcomer)
        joined = newcomer.next_commit(timeout=60)
        steps = [r for r in newcomer.reports if r["event"] == "step"]
        assert steps[0]["resynced"], "the newcomer must load the state before averaging"
        assert len(steps) <= 3, "admitted at the next round, not later"
        assert len(joined["members"]) == 5
        for p in peers[:4]:
            while True:
                r = p.next_commit(timeout=60)
                if r["round_id"] == joined["round_id"]:
                    assert r["fingerprint"] == joined["fingerprint"]
                    break
    assert_rounds_consistent(peers)


# --- A7 -----------------------------------------------------------------------------------------


@pytest.mark.timeout(400)
def test_a7_churn_of_peers_joining_and_dying_every_second(tmp_path: Path) -> None:
    # A long run only (SHOAL_CHURN_SECONDS=3600): in CI the daemon soak
    # (tests/test_soak_lab.py) covers churn, with the rest of the daemon.
    if "SHOAL_CHURN_SECONDS" not in os.environ:
        pytest.skip("a soak: SHOAL_CHURN_SECONDS=N runs it (CI runs tests/test_soak_lab.py)")
    duration = float(os.environ["SHOAL_CHURN_SECONDS"])
    args = ["--size", "200000", "--min-group", "2", "--target-group", "10", "--stall-timeout", "3"]
    rng = random.Random(7)
    with swarm(tmp_path, 4, *args) as peers:
        all_peers = list(peers)
        start = last_commit = time.time()
        longest_gap = 0.0
        n = 4
        while time.time() - start < duration:
            time.sleep(rng.uniform(0.5, 2.0))
            alive = [p for p in peers if p.proc.poll() is None]
            if len(alive) < 10 and (len(alive) <= 2 or rng.random() < 0.5):
                p = spawn(tmp_path, alive, f"churn{n}", *args)
                n += 1
                peers.append(p)
                all_peers.append(p)
            else:
                rng.choice(alive).kill()
            for p in all_peers:
                for r in p.drain() if p.proc.poll() is None else []:
                    if r.get("event") == "step" and r["committed"]:
                        longest_gap = max(longest_gap, r["t"] - last_commit)
                        last_commit = max(last_commit, r["t"])
            longest_gap = max(longest_gap, time.time() - last_commit)
            assert longest_gap < 30, f"no committed round for {longest_gap:.1f}s"
        rss = []
        for p in peers:
            if p.proc.poll() is None:
                with open(f"/proc/{p.proc.pid}/status") as f:
                    rss += [int(x.split()[1]) for x in f if x.startswith("VmRSS")]
        assert max(rss) < 400_000, f"RSS {max(rss)} kB"
    assert_rounds_consistent(all_peers)


# --- A8 -----------------------------------------------------------------------------------------


@pytest.mark.timeout(400)
def test_a8_killing_the_assembler_ten_times(tmp_path: Path) -> None:
    args = ["--size", "200000", "--min-group", "2", "--target-group", "10", "--stall-timeout", "3"]
    with swarm(tmp_path, 6, *args) as peers:
        spawned = 6
        for _ in range(10):
            alive = [p for p in peers if p.proc.poll() is None]
            # Reports queued before now are history: a peer read for the first time
            # (the one before it was the victim) still holds commits led by earlier,
            # dead victims.
            for p in alive:
                p.drain()
            last = alive[0].next_commit(timeout=60)
            leader = last.get("leader") or last["members"][0]
            victim = next((p for p in alive if p.peer_id == leader), None)
            assert victim is not None, (
                f"the assembler must be one of us: {alive[0].name}'s commit {last}, alive "
                f"{[(p.name, p.peer_id) for p in alive]}, dead "
                f"{[(p.name, p.peer_id) for p in peers if p not in alive]}"
            )
            victim.kill()
            killed_at = time.time()
            survivors = [p for p in alive if p is not victim]
            while True:
                r = survivors[0].next_commit(timeout=15)
                if r["t"] >= killed_at and leader not in r["members"]:
                    break
            assert r["t"] - killed_at <= 10, f"next commit {r['t'] - killed_at:.1f}s after kill"
            peers.append(spawn(tmp_path, survivors, f"late{spawned}", *args))
            spawned += 1
    assert_rounds_consistent(peers)
