"""shoal as a library: scripts that train their own loop average with `shoal run` peers.

The scripts (tests/library_peer.py, the async and the sync variant of the API) and
CLI peers train one experiment whose task is the script's own file; their commits
carry equal fingerprints; a script killed with kill -9 leaves the others committing;
the sync script shuts down cleanly on Ctrl+C; a `transformers.Trainer` with shoal's
callback averages a tiny Llama with a CLI peer. In-process: what a library peer
refuses, and what it starts from.
"""

from __future__ import annotations

import logging
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import aiohttp
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from daemon_harness import ROUND_RE, Daemon, daemon_env, die_with_parent, wait_for

SCRIPT = Path(__file__).parent / "library_peer.py"
TASK = f"{SCRIPT.resolve()}:make_task"
COMMIT_RE = re.compile(r"^COMMIT (\d+) (\d+) (\w+)$")


class Script:
    """One `python tests/library_peer.py` process; its stdout lines read in a thread."""

    def __init__(self, workdir: Path, name: str, args: list[str]) -> None:
        self.home = workdir / name
        self.home.mkdir(parents=True)
        self.lines: list[str] = []
        self.log_path = self.home / "stderr.log"
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, str(SCRIPT), *args[:1], str(self.home / "data"), *args[1:]],
                stdout=subprocess.PIPE,
                stderr=log,
                env=daemon_env(self.home),
                preexec_fn=die_with_parent,  # noqa: PLW1509 (prctl only)
            )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            self.lines.append(raw.decode(errors="replace").strip())

    def ready(self) -> tuple[str, str] | None:
        for line in self.lines:
            if line.startswith("READY "):
                _, ref, addr = line.split()
                return ref, addr
        if self.proc.poll() is not None:
            raise AssertionError(f"the script exited {self.proc.returncode}:\n{self.tail()}")
        return None

    def commits(self) -> dict[int, tuple[int, str]]:
        """outer step -> (group size, fingerprint)."""
        found = (COMMIT_RE.match(line) for line in list(self.lines))
        return {int(m[1]): (int(m[2]), m[3]) for m in found if m}

    def tail(self) -> str:
        log = self.log_path.read_text(errors="replace").splitlines()[-30:]
        return "\n".join([f"--- {self.home.name}:", *self.lines[-5:], *log])


def cli_commits(daemon: Daemon) -> dict[int, tuple[int, str]]:
    found = ROUND_RE.finditer(daemon.log())
    return {int(m[1]): (int(m[2]), m[3]) for m in found}


def shared_step(peers: dict[str, dict[int, tuple[int, str]]], size: int, after: int = 0) -> int:
    """An outer step past `after` that every peer committed in a group of `size`, their
    fingerprints equal (the CLI logs a prefix of 16 hex digits); 0 if none yet."""
    for step in sorted(set.intersection(*(set(c) for c in peers.values()))):
        rows = [c[step] for c in peers.values()]
        prints = {fp[:16] for _, fp in rows}
        assert len(prints) == 1, f"fingerprints differ at outer step {step}: {peers}"
        if step > after and all(group == size for group, _ in rows):
            return step
    return 0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_library_scripts_and_cli_peers_average_then_survive_a_killed_script(
    tmp_path: Path,
) -> None:
    """The async script hosts; two CLI peers and the sync script join; all four commit
    rounds with equal fingerprints; the host script killed with kill -9 (mid-round or
    between rounds), the others commit on; Ctrl+C closes the sync script cleanly."""
    host = Script(tmp_path, "async-host", ["async", "--host", "lib"])
    procs: list[Script | Daemon] = [host]
    try:
        ref, addr = wait_for("the async script ready", host.ready, 60, debug=host.tail)
        joining = ["--join", ref, "--bootstrap", addr, "--task", TASK]
        clis = [Daemon(f"cli-{i}", tmp_path, joining, {}) for i in range(2)]
        sync = Script(tmp_path, "sync-joiner", ["sync", "--join", ref, "--bootstrap", addr])
        procs += [*clis, sync]

        def debug() -> str:
            return "\n".join(p.tail() for p in procs)

        def commits(with_host: bool) -> dict[str, dict[int, tuple[int, str]]]:
            found = {"sync": sync.commits(), **{d.name: cli_commits(d) for d in clis}}
            return {"async": host.commits(), **found} if with_host else found

        together = wait_for(
            "a round of all four with equal fingerprints",
            lambda: shared_step(commits(with_host=True), 4),
            90,
            debug=debug,
        )
        host.proc.kill()
        host.proc.wait(timeout=10)
        wait_for(
            "the CLI peers and the sync script committing on without the killed script",
            lambda: shared_step(commits(with_host=False), 3, after=together),
            60,
            debug=debug,
        )
        sync.proc.send_signal(signal.SIGINT)
        try:  # (bounded by the sync API's CLOSE_TIMEOUT_S and the round in flight)
            code = sync.proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the sync script did not close in 90 s\n{debug()}") from None
        assert code == 0, debug()
        wait_for("the sync script's clean close", lambda: "CLOSED" in sync.lines, 5, debug=debug)
        assert all(d.alive() for d in clis), debug()
    finally:
        for p in procs:
            if isinstance(p, Daemon):
                p.kill()
            elif p.proc.poll() is None:
                p.proc.kill()
                p.proc.wait(timeout=10)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_transformers_trainer_with_the_callback_averages_a_tiny_llama_with_a_cli_peer(
    tmp_path: Path,
) -> None:
    for extra in ("transformers", "tokenizers", "accelerate"):
        pytest.importorskip(extra, reason="the hf extra is not installed (pip install shoal[hf])")
    from hf_texts import write_texts

    texts = write_texts(tmp_path / "texts")
    args = ["hf", "--host", "tl", "--texts", str(texts), "--rounds", "2"]
    script = Script(tmp_path, "hf-trainer", args)
    procs: list[Script | Daemon] = [script]
    try:
        ref, addr = wait_for("the hf script ready", script.ready, 90, debug=script.tail)
        joining = ["--join", ref, "--bootstrap", addr, "--data", str(texts)]
        cli = Daemon("cli", tmp_path, joining, {})
        procs.append(cli)

        def debug() -> str:
            return "\n".join(p.tail() for p in procs)

        wait_for(
            "a round of the Trainer's script and the CLI peer with equal fingerprints",
            lambda: shared_step({"hf": script.commits(), "cli": cli_commits(cli)}, 2),
            90,
            debug=debug,
        )
        assert script.proc.wait(timeout=60) == 0, debug()  # it stops after 2 shared rounds
        assert "CLOSED" in script.lines, debug()
        logged = "\n".join(script.lines)
        losses = [float(m[1]) for m in re.finditer(r"'loss': '([\d.]+)'", logged)]
        assert losses[-1] < losses[0], f"the Trainer's loss did not fall: {losses}"
    finally:
        for p in procs:
            if isinstance(p, Daemon):
                p.kill()
            elif p.proc.poll() is None:
                p.proc.kill()
                p.proc.wait(timeout=10)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_library_task_trainer_in_a_verified_experiment_passes_the_cli_hosts_audits(
    tmp_path: Path,
) -> None:
    """Verification for a library peer whose batches are shoal's: a `shoal run` host of a
    verified experiment (every contribution audited) and a script training it through
    `task_trainer` commit rounds with equal fingerprints, and the host's referee
    re-executes the script's work and passes it."""
    audited = {
        "SHOAL_INNER_STEPS": "10",
        "SHOAL_STRATEGY_OPTIONS": "matchmaking_time=3,round_timeout=15,stall_timeout=3,"
        "audit_rate=1",
    }
    cli = Daemon("cli-host", tmp_path, ["--host-experiment", "checked", "--task", TASK,
                                        "--verify", "on"], audited)  # fmt: skip
    procs: list[Script | Daemon] = [cli]
    try:
        cli.wait_ready()
        args = ["task", "--join", cli.join_ref, "--bootstrap", cli.address]
        script = Script(tmp_path, "task-trainer", args)
        procs.append(script)

        def debug() -> str:
            return "\n".join(p.tail() for p in procs)

        wait_for(
            "a round of the CLI host and the script with equal fingerprints",
            lambda: shared_step({"script": script.commits(), "cli": cli_commits(cli)}, 2),
            90,
            debug=debug,
        )
        verification = wait_for(
            "the host's referee passing an audit of the script's work",
            lambda: (v := cli.status()["verification"])["audits_passed"] >= 1 and v,
            90,
            debug=debug,
        )
        assert verification["enabled"] is True and verification["convictions"] == [], debug()
        assert verification["audits_failed"] == 0, verification
    finally:
        for p in procs:
            if isinstance(p, Daemon):
                p.kill()
            elif p.proc.poll() is None:
                p.proc.kill()
                p.proc.wait(timeout=10)


# ---------------------------------------------------------------------- in-process

LOOPBACK = "/ip4/127.0.0.1/tcp/0"


def test_import_shoal_loads_no_layer_until_the_api_is_used() -> None:
    probe = (
        "import sys, shoal; assert 'torch' not in sys.modules and 'shoal.peer' not in "
        "sys.modules, sorted(sys.modules); print(*shoal.__all__)"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [
        "LibraryError", "Outer", "Peer", "ShoalCallback", "host", "join", "sync"
    ]  # fmt: skip


@pytest.mark.timeout(60)
async def test_a_library_host_is_unverified_and_starts_your_model_from_its_initial_weights(
    tmp_path: Path,
) -> None:
    import torch
    from torch import nn

    import shoal
    from shoal.averaging.fingerprint import state_fingerprint

    with pytest.raises(shoal.LibraryError, match="unknown option 'colour'"):
        await shoal.host("v", task=TASK, data_dir=tmp_path / "v", colour="blue")

    async with await shoal.host(
        "lib", task=TASK, data_dir=tmp_path / "a", listen=LOOPBACK, mdns="off", status="127.0.0.1:0"
    ) as peer:
        assert peer.hosting and peer.manifest.strategy_options["verify"] is False
        unlike = r"parameter '0.bias' is \(3,\) in yours, \(16,\)"
        with pytest.raises(shoal.LibraryError, match=unlike):
            await peer.outer(nn.Sequential(nn.Linear(3, 3)))
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))  # its own init
        outer = await peer.outer(model, torch.optim.SGD(model.parameters(), lr=0.1))
        params = [p.detach() for p in model.parameters()]
        assert state_fingerprint(params, {}) == peer.manifest.initial_fingerprint
        assert peer.join_command is not None and f"--join {peer.ref}" in peer.join_command
        model(torch.ones(2, 8)).sum().backward()
        await outer.step(tokens=2, loss=1.5)
        assert outer.stats.step == 1 and outer.stats.last_loss == 1.5
        async with aiohttp.ClientSession() as http, http.get(f"{peer.status_url}/status") as r:
            status = await r.json()
        assert status["experiment"] == "lib" and status["step"] == 1
        assert all(p.grad is None for p in model.parameters())  # the step zeroed them
        with pytest.raises(shoal.LibraryError, match="already trains"):
            await peer.outer(model)
    with pytest.raises(RuntimeError, match="shut down"):
        await outer.step()


@pytest.mark.timeout(60)
async def test_a_script_started_again_hosts_the_same_experiment_warned_only_of_what_changed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import shoal

    kwargs = {"task": TASK, "data_dir": tmp_path, "listen": LOOPBACK, "mdns": "off"}
    async with await shoal.host("lib", inner_steps=10, **kwargs) as first:
        experiment = first.manifest.experiment_id
    caplog.set_level(logging.WARNING, "shoal.session")
    async with await shoal.host("lib", inner_steps=10, **kwargs) as again:
        assert again.manifest.experiment_id == experiment
        outer = await again.outer()  # nobody serves a newer state: its initial weights
        assert outer.outer_steps == 0
    assert "keeps its own settings" not in caplog.text
    async with await shoal.host("lib", inner_steps=20, **kwargs) as changed:
        assert changed.manifest.strategy_options["inner_steps"] == 10
    assert "ignoring --inner-steps (host a new name" in caplog.text


@pytest.mark.timeout(60)
async def test_a_library_joiner_refuses_a_round_zero_state_that_is_not_the_initial_model(
    tmp_path: Path,
) -> None:
    """The lying peer: before the first round, the state a peer serves (here the host's,
    changed after it signed the manifest) is not the model the manifest pins; the
    joiner's `outer` refuses it in one line instead of training from it."""
    import torch

    import shoal

    options = {"task": TASK, "listen": LOOPBACK, "mdns": "off"}
    async with await shoal.host("lib", data_dir=tmp_path / "host", **options) as host:
        outer = await host.outer()
        strategy: Any = outer.strategy
        with torch.no_grad():
            for g in strategy.globals:
                g.add_(0.01)
        await strategy.averager.publish_state()  # (served as round 0's state from now on)
        async with await shoal.join(
            host.ref, bootstrap=host.addresses, data_dir=tmp_path / "joiner", **options
        ) as joiner:
            with pytest.raises(shoal.LibraryError, match="not the experiment's initial model"):
                await joiner.outer()


@pytest.mark.timeout(60)
async def test_in_a_verified_experiment_a_library_peer_trains_the_tasks_steps_not_its_own(
    tmp_path: Path,
) -> None:
    """A verified experiment (hosted by `shoal run`, or by the library with verify='on'):
    `outer` (the user's own batches, which no referee can re-execute) is refused in one
    line; `task_trainer` trains the task's steps, logged for audits as the daemon's."""
    import shoal
    from shoal.dht.node import DHTNode
    from shoal.peer.cli import parse_command_line
    from shoal.peer.daemon import load_identity
    from shoal.peer.session import open_session
    from shoal.transport.host import Host, HostConfig

    _, config = parse_command_line(
        ["run", "--data-dir", str(tmp_path / "cli"), "--host-experiment", "checked",
         "--task", TASK, "--verify", "on"],
        {},
    )  # fmt: skip
    host = Host(load_identity(config), HostConfig(listen=(LOOPBACK,)))
    await host.start()
    try:
        dht = await DHTNode.create(host)
        session = await open_session(config, host.identity, dht)
        try:
            assert session.manifest.strategy_options["verify"] is True
            address = f"{host.listen_addrs[0]}/p2p/{host.peer_id}"
            async with await shoal.join(
                str(session.manifest.ref),
                bootstrap=[address],
                task=TASK,
                data_dir=tmp_path / "lib",
                listen=LOOPBACK,
                mdns="off",
            ) as peer:
                with pytest.raises(shoal.LibraryError, match=r"verifies work.*task_trainer"):
                    await peer.outer()
                trainer = await peer.task_trainer()
                assert trainer.verified and peer.model is trainer.model
                for _ in range(3):
                    await trainer.step()
                assert trainer.stats.step == 3
                work = trainer.session.trainer.work
                assert work is not None and work.log.current is not None
                assert work.log.current.steps == 3  # logged for the referees
        finally:
            await session.strategy.aclose()
            session.trainer.close()
            await dht.aclose()
    finally:
        await host.aclose()
    async with await shoal.host(
        "own", task=TASK, data_dir=tmp_path / "own", listen=LOOPBACK, mdns="off", verify="on"
    ) as verified:
        assert verified.manifest.strategy_options["verify"] is True
        with pytest.raises(shoal.LibraryError, match="verifies work"):
            await verified.outer()
