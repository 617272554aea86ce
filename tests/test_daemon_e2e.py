"""The daemon end to end: separate `shoal run` processes on loopback train one experiment.

The issue's acceptance run: a host and two joiners train with DiLoCo; at least
three outer rounds commit, and after each one every peer's fingerprint is the
same; /status, /peers and /metrics carry what they must, the validation loss
included; /swarm has every peer's series, and keeps a peer killed with kill -9,
which does not stop the others; a fourth peer joins and catches up; the
host leaves and the rest go on.
"""

from __future__ import annotations

import json
import shlex
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from daemon_harness import TINY_TASK, Daemon, cli_env_path, wait_for

from shoal.peer.status.round_ledger import LEDGER_FILE, audit_rounds, read_ledger

pytestmark = pytest.mark.slow

STATUS_KEYS = {
    "peer_id",
    "version",
    "addresses",
    "reachability",
    "reachability_detail",
    "connections",
    "connections_trimmed",
    "dht_peers",
    "experiment",
    "step",
    "loss",
    "val_loss",
    "tokens_per_s",
    "last_round",
    "bytes_sent",
    "bytes_received",
    "uptime_s",
}
FAST_ROUNDS = {
    "SHOAL_INNER_STEPS": "10",
    "SHOAL_TASK_OPTIONS": TINY_TASK,
    # Short deadlines so that a killed peer costs a few seconds, not the defaults' 30.
    "SHOAL_STRATEGY_OPTIONS": "matchmaking_time=3,round_timeout=15,stall_timeout=3",
}


def _debug(*daemons: Daemon) -> str:
    return "\n".join(d.tail() for d in daemons)


def _agree(daemons: list[Daemon], step: int) -> str | None:
    """The fingerprint every daemon logged for outer `step`, None if not all have it."""
    prints = {d.committed_rounds().get(step) for d in daemons}
    if None in prints:
        return None
    assert len(prints) == 1, f"fingerprints differ at outer step {step}: {prints}"
    return prints.pop()


@pytest.mark.timeout(420)
def test_host_and_joiners_train_survive_a_kill_a_join_and_the_host_leaving(
    tmp_path: Path,
) -> None:
    host = Daemon("host", tmp_path, ["--host-experiment", "e2e"], FAST_ROUNDS)
    daemons = [host]
    try:
        host.wait_ready()
        ref = host.join_ref
        assert ref.startswith("e2e@12D3KooW")
        join_args = ["--join", ref, "--bootstrap", host.address]
        a = Daemon("joiner-a", tmp_path, join_args, {})
        b = Daemon("joiner-b", tmp_path, join_args, {})
        daemons += [a, b]
        for d in (a, b):
            d.wait_ready()
        trio = [host, a, b]

        # Three outer rounds with all three peers, identical fingerprints after each.
        def three_full_rounds() -> list[int]:
            full = []
            for d in trio:
                for step, _ in d.committed_rounds().items():
                    full.append(step)
            steps = sorted({s for s in full if all(s in d.committed_rounds() for d in trio)})
            return steps if len(steps) >= 3 else []

        steps = wait_for("3 rounds on 3 peers", three_full_rounds, 180, debug=lambda: _debug(*trio))
        for step in steps:
            assert _agree(trio, step)

        # The status endpoint.
        status = host.status()
        assert set(status) >= STATUS_KEYS
        assert status["experiment"] == "e2e"
        assert status["step"] > 0 and status["loss"] > 0 and status["tokens_per_s"] > 0
        assert status["last_round"]["outcome"] == "committed"
        assert status["last_round"]["group_size"] >= 2
        assert len(status["last_round"]["fingerprint"]) == 64
        assert status["bytes_sent"] > 0 and status["bytes_received"] > 0
        # a committed round sent averaging payload, and the DHT carried its matchmaking
        by_protocol = status["bytes_sent_by_protocol"]
        assert by_protocol["/shoal/averaging/1.0.0"] > 0 and by_protocol["/shoal/dht/1.0.0"] > 0
        assert sum(by_protocol.values()) < status["bytes_sent"]
        assert status["dht_peers"] >= 2
        assert status["device"]["kind"] == "cpu" and status["device"]["memory_total_bytes"] > 0
        assert status["mfu"] is None  # a CPU's peak is not known
        lag = status["loop_lag_ms"]  # the event loop's ticker has run since the start
        assert lag["window_s"] > 0 and 0 <= lag["p50_ms"] <= lag["p99_ms"] <= lag["max_ms"]
        kinds = {c["kind"] for c in status["connections"]}
        assert kinds <= {"direct", "relayed", "holepunched"} and kinds
        for conn in status["connections"]:
            assert {"peer_id", "kind", "bytes_sent", "bytes_received"} <= set(conn)
        peer_ids = {d.status()["peer_id"] for d in trio}
        peers = wait_for(
            "all three in /peers",
            lambda: (p := host.get("/peers")) and {e["peer_id"] for e in p} >= peer_ids and p,
            30,
        )
        for entry in peers:
            assert {"peer_id", "step", "tokens_per_s", "addresses", "val_loss"} <= set(entry)
        # The validation loss: scored after the first commit, reported everywhere.
        assert isinstance(status["val_loss"], float) and 0 < status["val_loss"] < 10
        assert any(isinstance(h.get("val_loss"), float) for h in host.get("/history"))
        wait_for(
            "every peer's val_loss in /peers (reports every 10 s)",
            lambda: all(isinstance(e["val_loss"], float) for e in host.get("/peers")),
            30,
        )
        # The swarm's history: a series per peer, sampled from their reports.
        swarm = wait_for(
            "a point of every peer in /swarm (sampled every 15 s)",
            lambda: (w := host.get("/swarm")) and set(w["peers"]) >= peer_ids and w,
            40,
        )
        assert swarm["self"] == status["peer_id"]
        for series in swarm["peers"].values():
            assert series and all(p.keys() == {"t", "step", "loss", "val_loss"} for p in series)
            assert [p["t"] for p in series] == sorted(p["t"] for p in series)
        metrics = host.get("/metrics")
        assert "shoal_step " in metrics or "shoal_step{" in metrics
        assert "shoal_val_loss " in metrics
        assert 'shoal_rounds_total{outcome="committed"}' in metrics
        assert host.get("/healthz")["ok"] is True

        # kill -9 a joiner: the other two go on committing.
        killed = b.status()["peer_id"]
        b.kill()
        last = max(_common := set(host.committed_rounds()) & set(a.committed_rounds()))
        wait_for(
            "2 more rounds without the killed joiner",
            lambda: [
                s for s in set(host.committed_rounds()) & set(a.committed_rounds()) if s > last + 1
            ],
            120,
            debug=lambda: _debug(host, a),
        )
        for s in set(host.committed_rounds()) & set(a.committed_rounds()):
            assert _agree([host, a], s)
        assert killed in host.get("/swarm")["peers"]  # its curve stays on the page

        # A fourth peer joins (through the joiner, not the host) and catches up.
        c = Daemon("joiner-c", tmp_path, ["--join", ref, "--bootstrap", a.address], {})
        daemons.append(c)
        c.wait_ready()
        wait_for(
            "the new peer commits a round with the others",
            lambda: (
                set(c.committed_rounds()) & set(host.committed_rounds()) & set(a.committed_rounds())
            ),
            120,
            debug=lambda: _debug(host, a, c),
        )
        for s in set(c.committed_rounds()) & set(a.committed_rounds()):
            assert _agree([a, c], s)

        # The host leaves gracefully; the two others go on without it.
        code, took = host.terminate()
        assert code == 0, host.tail()
        assert took < 10, f"graceful shutdown took {took:.1f}s"
        assert (host.data_dir / "checkpoints").exists()
        after = max(set(a.committed_rounds()) & set(c.committed_rounds()))
        wait_for(
            "rounds after the host left",
            lambda: [
                s for s in set(a.committed_rounds()) & set(c.committed_rounds()) if s > after + 1
            ],
            120,
            debug=lambda: _debug(a, c),
        )
        for s in set(a.committed_rounds()) & set(c.committed_rounds()):
            assert _agree([a, c], s)
        for d in (a, c):
            code, _ = d.terminate()
            assert code == 0, d.tail()

        # The round ledgers of all four, the killed one's included, agree: every
        # committed round has one fingerprint and no input was counted twice.
        entries = [e for d in daemons for e in read_ledger(d.data_dir / LEDGER_FILE)]
        audit = audit_rounds(entries)
        assert audit["commits"] >= 6 and audit["fingerprint_mismatches"] == 0, audit
        assert audit["double_counted"] == 0, audit
        assert all(read_ledger(d.data_dir / LEDGER_FILE) for d in daemons)
    finally:
        for d in daemons:
            d.kill()


@pytest.mark.timeout(120)
def test_restart_resumes_from_the_checkpoint_with_the_same_identity(tmp_path: Path) -> None:
    first = Daemon("peer", tmp_path, ["--host-experiment", "resume"], FAST_ROUNDS)
    try:
        first.wait_ready()
        peer_id = first.status()["peer_id"]
        wait_for("some steps", lambda: (first.status()["step"] or 0) >= 5, 60)
        wait_for(
            "a history sample with a loss",
            lambda: any(h.get("loss") is not None for h in first.get("/history")),
            30,
        )
        first_history = first.get("/history")
        code, _ = first.proc.send_signal(signal.SIGINT) or (first.proc.wait(timeout=20), 0)
        assert code == 0, first.tail()
        step_before = max(
            int(line.rsplit("step ", 1)[1].rstrip(")"))
            for line in first.log().splitlines()
            if "checkpoint written" in line
        )
    finally:
        first.kill()
    second = Daemon("peer", tmp_path, ["--host-experiment", "resume"], FAST_ROUNDS)
    try:
        second.wait_ready()
        status = second.status()
        assert status["peer_id"] == peer_id
        assert status["experiment_id"] == first_experiment_id(first)
        assert "resumed from checkpoint" in second.log()
        assert status["step"] >= step_before
        # the page's loss history goes on from where it was, not from scratch
        history = second.get("/history")
        assert history[: len(first_history)] == first_history
    finally:
        second.kill()


def first_experiment_id(d: Daemon) -> str:
    for line in d.stdout_lines:
        if line.startswith("Experiment "):
            return line.split("(id ", 1)[1].rstrip(").")
    raise AssertionError(d.stdout_lines)


@pytest.mark.timeout(300)
def test_the_printed_terminal_command_runs_in_three_terminals_at_once(tmp_path: Path) -> None:
    """The host's "from another terminal" line, run three times: three identities, one round."""
    host = Daemon("host", tmp_path, ["--host-experiment", "terminals"], FAST_ROUNDS)
    daemons = [host]
    try:
        host.wait_ready()
        line = next(
            host.stdout_lines[i + 1]
            for i, text in enumerate(host.stdout_lines)
            if text.startswith("To join it from another terminal")
        )
        args = shlex.split(line.strip())
        assert args[:2] == ["shoal", "run"] and args[args.index("--data-dir") + 1] == "$(mktemp -d)"
        for i in range(3):
            # what the shell does with "$(mktemp -d)": a fresh directory per run
            fresh = tempfile.mkdtemp(dir=tmp_path)
            run_args = [fresh if a == "$(mktemp -d)" else a for a in args[2:]]
            daemons.append(Daemon(f"terminal-{i}", tmp_path, run_args, {}))
        for d in daemons[1:]:
            d.wait_ready()
        ids = {d.status()["peer_id"] for d in daemons}
        assert len(ids) == 4

        def a_round_of_four() -> int | None:
            common = set(host.committed_rounds())
            for d in daemons[1:]:
                common &= set(d.committed_rounds())
            full = [s for s in common if f"outer step {s}, 4 peers" in host.log()]
            return max(full) if full else None

        step = wait_for("a round of 4", a_round_of_four, 180, debug=lambda: _debug(*daemons))
        assert _agree(daemons, step)
    finally:
        for d in daemons:
            d.kill()


@pytest.mark.timeout(300)
def test_a_newcomer_lists_the_experiments_of_the_network_and_joins_one_by_name(
    tmp_path: Path,
) -> None:
    alpha = Daemon("alpha", tmp_path, ["--host-experiment", "alpha"], FAST_ROUNDS)
    daemons = [alpha]
    try:
        alpha.wait_ready()
        beta = Daemon(
            "beta",
            tmp_path,
            ["--host-experiment", "beta", "--bootstrap", alpha.address],
            FAST_ROUNDS,
        )
        daemons.append(beta)
        beta.wait_ready()
        joiner = Daemon("joiner", tmp_path, ["--join", "beta", "--bootstrap", alpha.address], {})
        daemons.append(joiner)
        joiner.wait_ready()  # found `beta` by its name alone

        def listing() -> list[dict]:
            out = subprocess.run(
                [sys.executable, "-m", "shoal.peer", "experiments", "--json",
                 "--bootstrap", alpha.address],
                capture_output=True, text=True, timeout=60, check=True,
                env=cli_env_path(tmp_path / "newcomer"),
            )  # fmt: skip
            rows = json.loads(out.stdout)
            found = {r["name"]: r for r in rows}
            ok = "alpha" in found and "beta" in found and found["beta"]["peers"] == 2
            return rows if ok else []

        rows = wait_for("both experiments listed", listing, 90, debug=lambda: _debug(*daemons))
        by_name = {r["name"]: r for r in rows}
        assert by_name["alpha"]["experiment"] == alpha.join_ref
        assert by_name["beta"]["experiment"] == beta.join_ref
        for r in rows:
            assert r["task"] == "bytegpt" and r["strategy"] == "diloco"
            assert r["task_config"]["d_model"] == 32 and r["step"] is not None
            assert r["age_s"] >= 0 and r["peers"] >= 1
    finally:
        for d in daemons:
            d.kill()
