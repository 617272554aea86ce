"""The `shoal` command line: identity, config precedence, errors, and the run lifecycle.

End-to-end tests run `python -m shoal.peer` in a subprocess with HOME pointed at
a temporary directory (so ~/.shoal is never the real one) and no SHOAL_*
variables inherited; they listen on 127.0.0.1 only.
"""

from __future__ import annotations

import asyncio
import os
import re
import select
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from shoal.peer.cli import parse_command_line
from shoal.peer.config import Config, ConfigError
from shoal.transport.host import DEFAULT_LISTEN, Host, HostConfig
from shoal.transport.identity import Identity, PeerID
from shoal.transport.multiaddr import Multiaddr

PEER_ID_RE = re.compile(r"12D3KooW[1-9A-HJ-NP-Za-km-z]+")
LOOPBACK_ANY_PORT = "/ip4/127.0.0.1/tcp/0"
START_TIMEOUT = 20.0  # generous: a loaded CI machine imports cryptography slowly
STOP_TIMEOUT = 5.0  # "exits within a few seconds"


# --- helpers ------------------------------------------------------------------------------------


def cli_env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")}
    env["HOME"] = str(home)
    env.update(extra)
    return env


def shoal(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shoal.peer", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("shoal: error: ")]


def assert_one_line_error(result: subprocess.CompletedProcess[str], status: int) -> str:
    assert result.returncode == status, result.stderr
    assert "Traceback" not in result.stderr
    errors = error_lines(result.stderr)
    assert len(errors) == 1, result.stderr
    return errors[0]


def wait_for_file_text(path: Path, text: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while text not in path.read_text():
        if time.monotonic() > deadline:
            raise AssertionError(f"{text!r} not in {path} after {timeout}s:\n{path.read_text()}")
        time.sleep(0.02)


class RunningPeer:
    """A `shoal run` subprocess; stdout is parsed, stderr goes to a file."""

    def __init__(self, proc: subprocess.Popen[bytes], stderr_path: Path) -> None:
        self.proc = proc
        self.stderr_path = stderr_path
        self.stdout = self._read_banner()
        self.addresses = [line for line in self.stdout.splitlines() if line.startswith("/")]

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text()

    def _read_banner(self) -> str:
        # Read until the "To connect" line that ends the address list, with a deadline.
        fd = self.proc.stdout.fileno()  # type: ignore[union-attr]
        buf = b""
        deadline = time.monotonic() + START_TIMEOUT
        while not (b"To connect" in buf and buf.endswith(b"\n")):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"no addresses after {START_TIMEOUT}s: {buf!r}\n{self.stderr}")
            ready, _, _ = select.select([fd], [], [], remaining)
            if ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    status = self.proc.wait(timeout=STOP_TIMEOUT)
                    raise AssertionError(f"shoal run exited ({status}) early:\n{self.stderr}")
                buf += chunk
        return buf.decode()

    def stop(self, sig: signal.Signals) -> tuple[int, float]:
        """Send `sig`; the exit status and how long the exit took."""
        started = time.monotonic()
        self.proc.send_signal(sig)
        status = self.proc.wait(timeout=STOP_TIMEOUT * 4)
        return status, time.monotonic() - started


@contextmanager
def running_peer(
    tmp_path: Path, *args: str, code: str | None = None, **env: str
) -> Iterator[RunningPeer]:
    """`shoal run ARGS` (or `python -c CODE run ARGS`), killed at the end if still running.

    A network-only peer (no training, no status endpoint) unless `env` says otherwise:
    these tests are about the process and the network (tests/test_daemon_e2e.py trains).
    """
    env = {"SHOAL_NO_TRAIN": "1", "SHOAL_STATUS_ADDR": "off", **env}
    stderr_path = tmp_path / f"stderr-{time.monotonic_ns()}.txt"
    launcher = ["-c", code] if code is not None else ["-m", "shoal.peer"]
    with stderr_path.open("wb") as stderr:
        proc = subprocess.Popen(
            [sys.executable, *launcher, "run", *args],
            stdout=subprocess.PIPE,
            stderr=stderr,
            env=cli_env(tmp_path, **env),
        )
    try:
        yield RunningPeer(proc, stderr_path)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=STOP_TIMEOUT)
        proc.stdout.close()  # type: ignore[union-attr]


# --- shoal id -----------------------------------------------------------------------------------


def test_id_creates_a_private_key_and_prints_the_same_id_again(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    first = shoal("id", "--data-dir", str(data_dir), env=cli_env(tmp_path))
    assert first.returncode == 0, first.stderr
    assert PEER_ID_RE.fullmatch(first.stdout.strip()), first.stdout
    assert first.stdout.count("\n") == 1  # just the ID, so `$(shoal id)` works

    key = data_dir / "identity.key"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert str(Identity.load_or_create(key).peer_id) == first.stdout.strip()

    second = shoal("id", "--data-dir", str(data_dir), env=cli_env(tmp_path))
    assert second.returncode == 0, second.stderr
    assert second.stdout == first.stdout


def test_id_defaults_to_home_and_the_flag_overrides_the_env(tmp_path: Path) -> None:
    default = shoal("id", env=cli_env(tmp_path))
    assert default.returncode == 0, default.stderr
    assert (tmp_path / ".shoal" / "identity.key").exists()

    from_env = tmp_path / "from-env"
    from_flag = tmp_path / "from-flag"
    env = cli_env(tmp_path, SHOAL_DATA_DIR=str(from_env))
    result = shoal("id", "--data-dir", str(from_flag), env=env)
    assert result.returncode == 0, result.stderr
    assert (from_flag / "identity.key").exists()
    assert not from_env.exists()
    assert result.stdout != default.stdout  # a new identity in the other directory
    only_env = shoal("id", env=env)
    assert only_env.returncode == 0 and (from_env / "identity.key").exists()


def test_id_refuses_a_key_readable_by_others(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    assert shoal("id", "--data-dir", str(data_dir), env=cli_env(tmp_path)).returncode == 0
    key = data_dir / "identity.key"
    key.chmod(0o644)

    result = shoal("id", "--data-dir", str(data_dir), env=cli_env(tmp_path))
    line = assert_one_line_error(result, 1)
    assert str(key) in line
    assert "0644" in line
    assert "chmod 600" in line
    assert result.stdout == ""


def test_unusable_data_dir_is_a_one_line_error(tmp_path: Path) -> None:
    # Under a regular file: fails for root too, unlike a chmod-ed directory.
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    result = shoal("id", "--data-dir", str(blocker / "data"), env=cli_env(tmp_path))
    line = assert_one_line_error(result, 1)
    assert "data directory" in line
    assert "--data-dir" in line


# --- configuration ------------------------------------------------------------------------------


def test_defaults() -> None:
    command, config = parse_command_line(["run"], {})
    assert command == "run"
    assert config == Config()
    assert [str(a) for a in config.listen] == list(DEFAULT_LISTEN)
    assert config.announce == ()
    assert config.data_dir == Path("~/.shoal").expanduser()
    assert config.identity_path == config.data_dir / "identity.key"
    assert config.log_level == "info"
    assert config.host_config() == HostConfig(reuse_port=True)  # NAT traversal punches from it


def test_flags_override_the_environment() -> None:
    argv = [
        "run",
        "--data-dir", "/flag/dir",
        "--listen", "/ip4/127.0.0.1/tcp/1",
        "--announce", "/dns/flag.example/tcp/1",
        "--log-level", "debug",
    ]  # fmt: skip
    environ = {
        "SHOAL_DATA_DIR": "/env/dir",
        "SHOAL_LISTEN": "/ip4/127.0.0.1/tcp/2, /ip6/::1/tcp/2",
        "SHOAL_LOG_LEVEL": "WARNING",
        "UNRELATED": "x",
    }
    _, config = parse_command_line(argv, environ)
    assert config.data_dir == Path("/flag/dir")
    assert config.listen == (Multiaddr("/ip4/127.0.0.1/tcp/1"),)
    assert config.log_level == "debug"
    assert config.announce == (Multiaddr("/dns/flag.example/tcp/1"),)
    assert config.sources["listen"] == "--listen, overriding SHOAL_LISTEN"
    assert config.sources["announce"] == "--announce"
    assert any("--listen, overriding SHOAL_LISTEN" in line for line in config.describe())
    # Without the flags, the environment applies.
    _, config = parse_command_line(["run"], environ)
    assert config.data_dir == Path("/env/dir")
    assert config.listen == (Multiaddr("/ip4/127.0.0.1/tcp/2"), Multiaddr("/ip6/::1/tcp/2"))
    assert config.sources["listen"] == "SHOAL_LISTEN"


def test_flags_apply_when_env_is_unset_or_blank() -> None:
    argv = ["run", "--listen", "/ip4/127.0.0.1/tcp/1", "--listen", "/ip4/127.0.0.2/tcp/1,"]
    _, config = parse_command_line(argv, {"SHOAL_LISTEN": "  ", "SHOAL_ANNOUNCE": ""})
    assert [str(a) for a in config.listen] == ["/ip4/127.0.0.1/tcp/1", "/ip4/127.0.0.2/tcp/1"]
    assert config.announce == ()
    assert "announce" not in config.sources


def test_env_alone_sets_values() -> None:
    _, config = parse_command_line(["run"], {"SHOAL_ANNOUNCE": "/ip4/203.0.113.5/tcp/31337"})
    assert config.announce == (Multiaddr("/ip4/203.0.113.5/tcp/31337"),)
    assert config.host_config().announce == ("/ip4/203.0.113.5/tcp/31337",)


@pytest.mark.parametrize(
    ("argv", "environ", "names"),
    [
        (["run", "--listen", "/ip4/1.2.3/tcp/1"], {}, ["--listen", "1.2.3"]),
        (["run"], {"SHOAL_LISTEN": "/ip4/1.2.3.4/tcp/99999"}, ["SHOAL_LISTEN", "99999"]),
        (["run", "--announce", "ip4/1.2.3.4"], {}, ["--announce", "ip4/1.2.3.4"]),
        (["run", "--listen", "/dns/x.example/tcp/1/p2p-circuit"], {}, ["--listen"]),
        (["run"], {"SHOAL_LISTEN": ","}, ["SHOAL_LISTEN", "no address"]),
        (["run", "--log-level", "loud"], {}, ["--log-level", "loud"]),
        (["id"], {"SHOAL_LOG_LEVEL": "verbose"}, ["SHOAL_LOG_LEVEL"]),
        (["run", "--frobnicate"], {}, ["--frobnicate"]),
    ],
)
def test_bad_settings_name_the_flag_or_variable(
    argv: list[str], environ: dict[str, str], names: list[str]
) -> None:
    with pytest.raises(ConfigError) as info:
        parse_command_line(argv, environ)
    message = str(info.value)
    assert "\n" not in message
    for name in names:
        assert name in message


def test_listen_needs_a_local_tcp_address() -> None:
    peer = str(Identity.from_seed(bytes(32)).peer_id)
    with pytest.raises(ConfigError, match="cannot listen"):
        parse_command_line(["run", "--listen", f"/ip4/127.0.0.1/tcp/1/p2p/{peer}"], {})
    with pytest.raises(ConfigError, match="cannot listen"):
        parse_command_line(["run", "--listen", f"/p2p/{peer}"], {})


def test_id_ignores_variables_it_does_not_use() -> None:
    command, config = parse_command_line(["id"], {"SHOAL_LISTEN": "garbage"})
    assert command == "id"
    assert config.listen == Config().listen


def test_announce_naming_another_peer_is_refused() -> None:
    me = Identity.from_seed(bytes([1]) * 32).peer_id
    other = Identity.from_seed(bytes([2]) * 32).peer_id
    _, config = parse_command_line(["run", "--announce", f"/ip4/203.0.113.5/tcp/1/p2p/{me}"], {})
    config.check_peer_id(me)
    _, config = parse_command_line(["run"], {"SHOAL_ANNOUNCE": f"/dns/a.example/tcp/1/p2p/{other}"})
    with pytest.raises(ConfigError, match="SHOAL_ANNOUNCE"):
        config.check_peer_id(me)
    # Through a relay, the /p2p/ before /p2p-circuit is the relay's: fine.
    relayed = f"/ip4/203.0.113.9/tcp/1/p2p/{other}/p2p-circuit"
    _, config = parse_command_line(["run", "--announce", relayed], {})
    config.check_peer_id(me)


@pytest.mark.parametrize(
    ("args", "env"),
    [
        (["run", "--listen", "/ip4/1.2.3/tcp/1"], {}),
        (["run"], {"SHOAL_ANNOUNCE": "ip4/1.2.3.4"}),
        (["run", "--frobnicate"], {}),
    ],
)
def test_bad_command_line_is_one_line_and_status_2(
    tmp_path: Path, args: list[str], env: dict[str, str]
) -> None:
    result = shoal(*args, env=cli_env(tmp_path, **env))
    assert_one_line_error(result, 2)
    assert result.stderr.count("\n") == 1  # nothing else either: it fails before logging starts
    assert result.stdout == ""


def test_help_documents_every_option_and_its_variable(tmp_path: Path) -> None:
    result = shoal("run", "--help", env=cli_env(tmp_path))
    assert result.returncode == 0
    text = " ".join(result.stdout.split())
    for flag, var in [
        ("--data-dir", "SHOAL_DATA_DIR"),
        ("--listen", "SHOAL_LISTEN"),
        ("--announce", "SHOAL_ANNOUNCE"),
        ("--log-level", "SHOAL_LOG_LEVEL"),
    ]:
        assert flag in text
        assert var in text
    assert "command-line flags, then SHOAL_* environment variables" in text


# --- shoal run ----------------------------------------------------------------------------------


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_run_prints_its_addresses_and_stops_on_signal(tmp_path: Path, sig: signal.Signals) -> None:
    peer_id = shoal("id", env=cli_env(tmp_path)).stdout.strip()
    with running_peer(tmp_path, "--listen", LOOPBACK_ANY_PORT) as peer:
        assert peer.addresses, peer.stdout
        for text in peer.addresses:
            addr = Multiaddr(text)
            assert str(addr.peer_id) == peer_id
            assert addr.tcp_endpoint() is not None
            assert addr.tcp_endpoint()[1] != 0  # the bound port, not the requested 0
        assert "To connect" in peer.stdout.splitlines()[-1]
        assert "config: listen = /ip4/127.0.0.1/tcp/0" in peer.stderr  # effective config logged

        status, took = peer.stop(sig)
        assert status == 0, peer.stderr
        assert took < STOP_TIMEOUT
        assert "stopped" in peer.stderr
        assert "Traceback" not in peer.stderr


def test_port_in_use_is_a_clear_error(tmp_path: Path) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = shoal("run", "--listen", f"/ip4/127.0.0.1/tcp/{port}", env=cli_env(tmp_path))
    line = assert_one_line_error(result, 1)
    assert f"/ip4/127.0.0.1/tcp/{port}" in line
    assert "--listen" in line
    suggested = line.split("e.g. --listen", 1)[1]
    assert f"/tcp/{port}" not in suggested  # never the port that is taken
    assert "/tcp/0" in suggested


def test_a_second_peer_on_the_same_data_directory_stops_naming_the_first(tmp_path: Path) -> None:
    with running_peer(tmp_path, "--listen", LOOPBACK_ANY_PORT) as first:
        assert first.addresses  # started: it holds the lock
        result = shoal("run", "--listen", LOOPBACK_ANY_PORT, env=cli_env(tmp_path))
        line = assert_one_line_error(result, 1)
        assert "in use by another shoal" in line and f"pid {first.proc.pid}" in line
        assert "--data-dir" in line
    # the first one stopped: the directory is free again
    with running_peer(tmp_path, "--listen", LOOPBACK_ANY_PORT) as again:
        assert again.addresses


async def test_another_process_connects_and_pings(tmp_path: Path) -> None:
    with running_peer(tmp_path, "--listen", LOOPBACK_ANY_PORT) as peer:
        target = Multiaddr(peer.addresses[0])
        assert isinstance(target.peer_id, PeerID)
        async with Host(Identity.generate(), HostConfig(listen=())) as host:
            conn = await host.connect(target, timeout=10)
            assert conn.remote_peer == target.peer_id
            rtt = await host.ping(target.peer_id, timeout=10)
            assert 0 <= rtt < 10

            # Graceful shutdown with a live connection: it closes it and exits 0.
            status, took = await asyncio.to_thread(peer.stop, signal.SIGTERM)
            assert status == 0, peer.stderr
            assert took < STOP_TIMEOUT
            await asyncio.wait_for(asyncio.shield(conn.closed), STOP_TIMEOUT)


def test_bootstrap_takes_several_addresses_after_one_flag_and_from_the_env() -> None:
    a = "/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWADf7hekRQXQ55CudbEHpoUS6EF5ffbxFgghynqtjpfrD"
    b = "/dns/boot.example/tcp/31337"
    _, config = parse_command_line(["run", "--bootstrap", a, b], {})
    assert config.bootstrap == (Multiaddr(a), Multiaddr(b))
    _, config = parse_command_line(["run"], {"SHOAL_BOOTSTRAP": f"{b}, {a}"})
    assert config.bootstrap == (Multiaddr(b), Multiaddr(a))
    assert config.sources["bootstrap"] == "SHOAL_BOOTSTRAP"
    _, config = parse_command_line(["run", "--bootstrap", a], {"SHOAL_BOOTSTRAP": f"{b}, {a}"})
    assert config.bootstrap == (Multiaddr(a),)
    assert config.sources["bootstrap"] == "--bootstrap, overriding SHOAL_BOOTSTRAP"
    _, config = parse_command_line(["run"], {})
    assert config.bootstrap == ()


@pytest.mark.parametrize(
    "bad", ["/ip4/1.2.3.4", "/p2p/12D3KooWADf7hekRQXQ55CudbEHpoUS6EF5ffbxFgghynqtjpfrD"]
)
def test_bootstrap_needs_a_dialable_address(bad: str) -> None:
    with pytest.raises(ConfigError, match="--bootstrap"):
        parse_command_line(["run", "--bootstrap", bad], {})


QUERY_DHT = """
import asyncio, sys, time
from shoal.dht.node import DHTNode
from shoal.transport.host import Host, HostConfig
from shoal.transport.identity import Identity

async def main():
    async with Host(Identity.generate(), HostConfig(listen=("/ip4/127.0.0.1/tcp/0",))) as host:
        dht = await DHTNode.create(host, bootstrap=[sys.argv[1]])
        await dht.store("cli-test", "hello", time.time() + 60)
        print(len(dht.routing_table), (await dht.get("cli-test")).value)
        await dht.aclose()

asyncio.run(main())
"""


def test_run_joins_the_network_of_its_bootstrap_peer(tmp_path: Path) -> None:
    first_home, second_home = tmp_path / "first", tmp_path / "second"
    first_home.mkdir()
    second_home.mkdir()
    with running_peer(first_home, "--listen", LOOPBACK_ANY_PORT) as first:
        assert "starting a new network" in first.stderr
        with running_peer(
            second_home, "--listen", LOOPBACK_ANY_PORT, SHOAL_BOOTSTRAP=first.addresses[0]
        ) as second:
            assert "joined the network: 1 peer known" in second.stderr
            # A third peer joining through the second one finds both in its table.
            out = subprocess.run(
                [sys.executable, "-c", QUERY_DHT, second.addresses[0]],
                capture_output=True, text=True, timeout=60, check=True,
            )  # fmt: skip
            assert out.stdout.split() == ["2", "hello"], out.stderr


def test_run_with_an_unreachable_bootstrap_peer_is_a_clear_error(tmp_path: Path) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # bound, never listening: connections are refused
        code = (
            "import sys; import shoal.peer.daemon as d; d.BOOTSTRAP_ATTEMPTS = 2; "
            "d.BOOTSTRAP_BACKOFF = 0.05; from shoal.peer.cli import main; "
            "sys.exit(main(sys.argv[1:]))"
        )
        result = subprocess.run(
            [sys.executable, "-c", code, "run", "--listen", LOOPBACK_ANY_PORT,
             "--bootstrap", f"/ip4/127.0.0.1/tcp/{port}"],
            capture_output=True, text=True, env=cli_env(tmp_path), timeout=60, check=False,
        )  # fmt: skip
    line = assert_one_line_error(result, 1)
    assert f"/ip4/127.0.0.1/tcp/{port}" in line
    assert "--bootstrap" in line
    # and while it tried, it said so
    assert "connection refused (nothing listens there yet?) (attempt 1 of 2, next in 0s)" in (
        result.stderr
    )
    assert "(attempt 2 of 2)" in result.stderr


# Replaces the host's shutdown with one that hangs, to see the second Ctrl+C cut it short.
STUCK_SHUTDOWN = """
import asyncio, sys
from shoal.transport.host import Host

async def stuck(self):
    await asyncio.sleep(60)

Host.aclose = stuck
from shoal.peer.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_second_ctrl_c_exits_at_once(tmp_path: Path) -> None:
    with running_peer(tmp_path, "--listen", LOOPBACK_ANY_PORT, code=STUCK_SHUTDOWN) as peer:
        peer.proc.send_signal(signal.SIGINT)
        wait_for_file_text(peer.stderr_path, "press Ctrl+C again", START_TIMEOUT)
        status, took = peer.stop(signal.SIGINT)
        assert status == -signal.SIGINT
        assert took < STOP_TIMEOUT
