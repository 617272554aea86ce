"""`shoal run` given bad input: one `shoal: error:` line saying what to do, never a traceback.

Each case runs the real daemon in a subprocess on loopback, with HOME in a
temporary directory, and checks the exit status (2 for a bad command line or
setting, 1 for a problem found while starting or running), that stderr has
exactly one error line, last, and no traceback, and that the line names the
culprit.

The one-shot cases do not depend on each other, so a module fixture starts
them all at once (most of their time is Python importing torch on a busy
machine) and each test reads its own outcome. The checkpoint tests, which
stop, damage and restart a host, run their own daemons one after the other.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from daemon_harness import TINY_TASK, Daemon, daemon_env, die_with_parent

# The daemon with short waits: the manifest search and the bootstrap retries
# would otherwise take 30 s each before failing. Only for the cases that wait:
# shoal.peer.session imports torch, which the others may never need.
SHORT_MANIFEST_WAIT = (
    "import sys; import shoal.peer.session as s; s.FIND_MANIFEST_TIMEOUT = 2.0; "
    "from shoal.peer.cli import main; sys.exit(main(sys.argv[1:]))"
)
SHORT_BOOTSTRAP_WAIT = (
    "import sys; import shoal.peer.daemon as d; d.BOOTSTRAP_ATTEMPTS = 2; "
    "d.BOOTSTRAP_BACKOFF = 0.05; from shoal.peer.cli import main; sys.exit(main(sys.argv[1:]))"
)
EXIT_RUNTIME = 1
EXIT_USAGE = 2
RUN_TIMEOUT = 120.0  # a loaded 2-core machine imports torch slowly; they end in seconds
NOBODY = "12D3KooWADf7hekRQXQ55CudbEHpoUS6EF5ffbxFgghynqtjpfrD"


@dataclass
class Outcome:
    returncode: int
    stdout: str
    stderr: str

    def error_line(self, status: int) -> str:
        """The one `shoal: error:` line, after checking the rest of the contract."""
        context = f"exit {self.returncode}\n--- stdout:\n{self.stdout}\n--- stderr:\n{self.stderr}"
        assert self.returncode == status, context
        assert "Traceback" not in self.stderr, context
        errors = [line for line in self.stderr.splitlines() if line.startswith("shoal: error: ")]
        assert len(errors) == 1, context
        assert self.stderr.rstrip("\n").splitlines()[-1] == errors[0], context  # the last word
        return errors[0]


class Run:
    """One `shoal run` subprocess, its output in files."""

    def __init__(
        self, home: Path, args: list[str], env: dict[str, str], *, code: str | None = None
    ) -> None:
        home.mkdir(parents=True, exist_ok=True)
        self.home = home
        self._stdout = home / "stdout.txt"
        self._stderr = home / "stderr.txt"
        launcher = ["-c", code] if code is not None else ["-m", "shoal.peer"]
        with self._stdout.open("wb") as out, self._stderr.open("wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, *launcher, "run", *args],
                stdout=out,
                stderr=err,
                stdin=subprocess.DEVNULL,
                env=daemon_env(home, **env),
                preexec_fn=die_with_parent,  # noqa: PLW1509 (prctl only: see its doc)
            )

    def outcome(self, timeout: float = RUN_TIMEOUT) -> Outcome:
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            log = self._stderr.read_text()
            raise AssertionError(f"still running after {timeout}s:\n{log}") from None
        return Outcome(code, self._stdout.read_text(), self._stderr.read_text())

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def busy_port() -> tuple[socket.socket, int]:
    """A port something else listens on."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock, sock.getsockname()[1]


def refusing_port() -> tuple[socket.socket, int]:
    """A port bound but never listening: connections to it are refused."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    return sock, sock.getsockname()[1]


@dataclass
class Cases:
    runs: dict[str, Run]
    workdir: Path
    status_port: int
    refusing_port: int

    def outcome(self, name: str) -> Outcome:
        return self.runs[name].outcome()


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cases]:
    workdir = tmp_path_factory.mktemp("bad-input")
    busy, status_port = busy_port()
    closed, closed_port = refusing_port()
    tiny = {"SHOAL_TASK_OPTIONS": TINY_TASK}
    runs: dict[str, Run] = {}
    # A network-only peer to join through: it knows no experiment at all.
    bootstrap = Daemon("bootstrap", workdir, [], {"SHOAL_NO_TRAIN": "1"})
    try:
        bootstrap.wait_ready()  # quick: a peer that does not train never loads torch
        # Files some cases need, in their own HOME.
        (workdir / "toml-unknown").mkdir()
        unknown_key = workdir / "toml-unknown" / "shoal.toml"
        unknown_key.write_text("inner_steps = 10\nfrobnicate = true\n")
        (workdir / "toml-invalid").mkdir()
        invalid = workdir / "toml-invalid" / "shoal.toml"
        invalid.write_text("inner_steps = = 10\n")
        blocked = workdir / "checkpoints-blocked" / ".shoal"
        blocked.mkdir(parents=True)
        (blocked / "checkpoints").write_text("a file where the checkpoints folder goes")
        saved = workdir / "saved-manifest" / ".shoal" / "experiments"
        saved.mkdir(parents=True)
        (saved / "mine.manifest").write_bytes(b"\x00 not a manifest")

        specs: dict[str, tuple[list[str], dict[str, str]]] = {
            "unknown-task": (["--task", "nosuch"], {}),
            "bad-task-option": (["--task-option", "d_model=32", "--task-option", "colour=7"], {}),
            "bad-strategy-option": (["--strategy-option", "colour=7"], tiny),
            "status-port-in-use": ([], {"SHOAL_STATUS_ADDR": f"127.0.0.1:{status_port}"}),
            "host-and-join": (["--host-experiment", "a", "--join", "b"], {}),
            "invalid-name": (["--host-experiment", "my experiment"], {}),
            "invalid-join-ref": (["--join", "x@12D3KooWtypo"], {}),
            "toml-unknown-key": (["--config", str(unknown_key)], {}),
            "toml-invalid": ([], {"SHOAL_CONFIG": str(invalid)}),
            "missing-data": (["--data", str(workdir / "no-such-corpus")], {}),
            "checkpoints-blocked": (["--host-experiment", "x"], tiny),
            "saved-manifest": (["--host-experiment", "mine"], tiny),
        }
        for name, (args, env) in specs.items():
            runs[name] = Run(workdir / name, args, env)
        unreachable = ["--join", "x", "--bootstrap", f"/ip4/127.0.0.1/tcp/{closed_port}"]
        runs["unreachable-bootstrap"] = Run(
            workdir / "unreachable-bootstrap", unreachable, {}, code=SHORT_BOOTSTRAP_WAIT
        )
        joining = ["--join", "nope", "--bootstrap", bootstrap.address]
        runs["unknown-experiment"] = Run(
            workdir / "unknown-experiment", joining, {}, code=SHORT_MANIFEST_WAIT
        )
        yield Cases(runs, workdir, status_port, closed_port)
    finally:
        for run in runs.values():
            run.kill()
        bootstrap.kill()
        busy.close()
        closed.close()


# --- the experiment ---------------------------------------------------------------------------


@pytest.mark.timeout(240)
def test_an_unknown_experiment(cases: Cases) -> None:
    line = cases.outcome("unknown-experiment").error_line(EXIT_RUNTIME)
    assert "unknown experiment 'nope'" in line
    assert "--bootstrap" in line and "--host-experiment nope" in line  # what to do


@pytest.mark.timeout(240)
def test_hosting_and_joining_at_once(cases: Cases) -> None:
    outcome = cases.outcome("host-and-join")
    line = outcome.error_line(EXIT_USAGE)
    assert "--host-experiment and --join exclude each other" in line
    assert outcome.stdout == ""


@pytest.mark.timeout(240)
def test_an_invalid_experiment_name(cases: Cases) -> None:
    line = cases.outcome("invalid-name").error_line(EXIT_USAGE)
    assert "--host-experiment: invalid experiment name 'my experiment'" in line
    assert "letters, digits" in line


@pytest.mark.timeout(240)
def test_an_invalid_host_in_the_join_argument(cases: Cases) -> None:
    line = cases.outcome("invalid-join-ref").error_line(EXIT_USAGE)
    assert "--join: invalid host peer ID '12D3KooWtypo'" in line


@pytest.mark.timeout(240)
def test_a_damaged_saved_manifest(cases: Cases) -> None:
    line = cases.outcome("saved-manifest").error_line(EXIT_RUNTIME)
    path = cases.workdir / "saved-manifest" / ".shoal" / "experiments" / "mine.manifest"
    assert f"cannot read the saved manifest {path}" in line
    assert "move it away" in line


# --- the task and the strategy ----------------------------------------------------------------


@pytest.mark.timeout(240)
def test_an_unknown_task(cases: Cases) -> None:
    line = cases.outcome("unknown-task").error_line(EXIT_RUNTIME)
    assert "unknown task 'nosuch'" in line
    assert "bytegpt" in line  # the tasks there are


@pytest.mark.timeout(240)
def test_an_unknown_task_option(cases: Cases) -> None:
    line = cases.outcome("bad-task-option").error_line(EXIT_RUNTIME)
    assert "unknown config key 'colour'" in line
    assert "d_model" in line  # the keys there are


@pytest.mark.timeout(240)
def test_an_unknown_strategy_option(cases: Cases) -> None:
    line = cases.outcome("bad-strategy-option").error_line(EXIT_RUNTIME)
    assert "--strategy-option" in line
    assert "unknown option 'colour' for diloco" in line
    assert "outer_lr" in line  # the options there are


@pytest.mark.timeout(240)
def test_missing_data(cases: Cases) -> None:
    line = cases.outcome("missing-data").error_line(EXIT_USAGE)
    assert f"--data: {cases.workdir / 'no-such-corpus'} does not exist" in line


# --- the network ------------------------------------------------------------------------------


@pytest.mark.timeout(240)
def test_a_status_port_in_use(cases: Cases) -> None:
    outcome = cases.outcome("status-port-in-use")
    line = outcome.error_line(EXIT_RUNTIME)
    assert f"status endpoint on 127.0.0.1:{cases.status_port}" in line
    assert "--status-addr" in line
    assert outcome.stdout == ""  # no addresses printed for a peer that did not start


@pytest.mark.timeout(240)
def test_an_unreachable_bootstrap_address(cases: Cases) -> None:
    line = cases.outcome("unreachable-bootstrap").error_line(EXIT_RUNTIME)
    assert f"/ip4/127.0.0.1/tcp/{cases.refusing_port}" in line
    assert "--bootstrap" in line


# --- the configuration file -------------------------------------------------------------------


@pytest.mark.timeout(240)
def test_a_config_file_with_an_unknown_key(cases: Cases) -> None:
    line = cases.outcome("toml-unknown-key").error_line(EXIT_USAGE)
    assert str(cases.workdir / "toml-unknown" / "shoal.toml") in line
    assert "unknown option 'frobnicate'" in line


@pytest.mark.timeout(240)
def test_a_config_file_that_is_not_toml(cases: Cases) -> None:
    line = cases.outcome("toml-invalid").error_line(EXIT_USAGE)
    assert str(cases.workdir / "toml-invalid" / "shoal.toml") in line
    assert "not valid TOML" in line and "line 1" in line


# --- checkpoints ------------------------------------------------------------------------------


@pytest.mark.timeout(240)
def test_a_checkpoint_folder_that_cannot_be_created_fails_at_start(cases: Cases) -> None:
    outcome = cases.outcome("checkpoints-blocked")
    line = outcome.error_line(EXIT_RUNTIME)
    assert "cannot write a checkpoint in" in line
    assert str(cases.workdir / "checkpoints-blocked" / ".shoal" / "checkpoints") in line
    assert "--data-dir" in line
    assert outcome.stdout == ""  # refused before training, not after hours of it


def started_host(workdir: Path) -> Daemon:
    host = Daemon("host", workdir, ["--host-experiment", "ck"], {"SHOAL_TASK_OPTIONS": TINY_TASK})
    try:
        host.wait_ready()
    except BaseException:
        host.kill()
        raise
    return host


def checkpoint_dir(host: Daemon) -> Path:
    (folder,) = (host.data_dir / "checkpoints").iterdir()
    return folder


@pytest.mark.timeout(240)
def test_corrupt_checkpoints_are_one_line_naming_the_file_and_what_to_do(tmp_path: Path) -> None:
    host = started_host(tmp_path)
    try:
        code, _ = host.terminate()
        assert code == 0, host.tail()
    finally:
        host.kill()
    folder = checkpoint_dir(host)
    latest = folder / "latest.pt"
    assert latest.stat().st_size > 0, "no checkpoint was written at shutdown"
    latest.write_bytes(latest.read_bytes()[:100])  # cut short, as by a full disk
    (folder / "previous.pt").write_bytes(b"")

    again = Run(host.home, ["--host-experiment", "ck"], {"SHOAL_TASK_OPTIONS": TINY_TASK})
    try:
        outcome = again.outcome()
    finally:
        again.kill()
    line = outcome.error_line(EXIT_RUNTIME)
    assert f"corrupt checkpoint ({latest}" in line
    assert f"move {folder} away to start this experiment afresh" in line
    assert "--data-dir" in line
    assert outcome.stdout == ""


@pytest.mark.timeout(240)
def test_a_checkpoint_that_cannot_be_written_at_shutdown_is_one_line(tmp_path: Path) -> None:
    host = started_host(tmp_path)
    try:
        folder = checkpoint_dir(host)  # made at start
        folder.rmdir()
        folder.write_text("the disk is gone")  # the folder is no longer one
        code, _ = host.terminate()
    finally:
        host.kill()
    line = Outcome(code, "", host.log()).error_line(EXIT_RUNTIME)
    assert f"cannot write a checkpoint in {folder}" in line
    assert "--data-dir" in line
