"""`shoal run` daemons as subprocesses on loopback, for the end-to-end tests.

Each daemon gets its own HOME and data directory, listens on 127.0.0.1 with
a random port, serves its status endpoint on a random port, and trains a
tiny model so that rounds come every few seconds. Its stdout (the banner) is
read in a thread; its stderr (the log) goes to a file the test can search.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import prefork

# Small enough that an inner step takes milliseconds on a loaded 2-core machine.
TINY_TASK = "d_model=32,n_layers=1,n_heads=2,context=32,batch_size=4"
START_TIMEOUT = 60.0
ROUND_RE = re.compile(r"round committed: outer step (\d+), (\d+) peers, [\d.]+s, fingerprint (\w+)")


PR_SET_PDEATHSIG = 1
# Resolved here, in the parent: the child between fork and exec only calls it (a
# dlopen there could wait on a loader lock another thread held at the fork).
_prctl = ctypes.CDLL(None, use_errno=True).prctl


def die_with_parent() -> None:
    """(preexec_fn) SIGKILL this child when the process that started it dies: a test
    run killed mid-test (pytest-timeout ends it with os._exit, no cleanup) must not
    leave daemons training on, slowing every test after it on a 2-core machine.
    Linux fires it when the *thread* that forked exits: start children from a thread
    that outlives them (the test's own). It only calls prctl, async-signal-safe."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def daemon_env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")}
    env.update(
        HOME=str(home),
        SHOAL_LISTEN="/ip4/127.0.0.1/tcp/0",
        SHOAL_STATUS_ADDR="127.0.0.1:0",
        SHOAL_THREADS="1",
        OMP_NUM_THREADS="1",
        # No LAN discovery unless a test asks: parallel tests must not find each other.
        SHOAL_MDNS="off",
    )
    env.update(extra)
    return env


def cli_env_path(home: Path) -> dict[str, str]:
    """The environment of a one-off `shoal` command with its own HOME."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")}
    env["HOME"] = str(home)
    env["SHOAL_MDNS"] = "off"  # `doctor` and `experiments` would listen on every interface
    return env


class Daemon:
    """One `shoal run` process."""

    def __init__(
        self,
        name: str,
        workdir: Path,
        args: list[str],
        env: dict[str, str],
        *,
        netns: str | None = None,
    ) -> None:
        """`netns`: run in that network namespace (the NAT lab's), as root."""
        self.name = name
        self.netns = netns
        self._in_ns = ["ip", "netns", "exec", netns] if netns else []
        self.home = workdir / name
        self.home.mkdir(parents=True, exist_ok=True)
        self.data_dir = self.home / ".shoal"
        self.log_path = self.home / "stderr.log"
        self.stdout_lines: list[str] = []
        self._ready = threading.Event()
        with self.log_path.open("ab") as log:
            # (forked from a process that imported torch, unless in a namespace)
            self.proc = prefork.popen(
                [*self._in_ns, sys.executable, "-m", "shoal.peer", "run", *args],
                stdout=subprocess.PIPE,
                stderr=log,
                env=daemon_env(self.home, **env),
                preexec_fn=die_with_parent,
            )
        self._reader = threading.Thread(target=self._read_stdout, daemon=True)
        self._reader.start()

    def _read_stdout(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            self.stdout_lines.append(line)
            if line.startswith("Status: "):
                self._ready.set()
        self._ready.set()  # exited: wake the waiter, which then sees it

    def wait_ready(self, timeout: float = START_TIMEOUT) -> None:
        if not self._ready.wait(timeout) or self.status_url is None:
            raise AssertionError(f"{self.name} did not start:\n{self.tail()}")

    @property
    def status_url(self) -> str | None:
        for line in self.stdout_lines:
            if line.startswith("Status: "):
                return line.split(" ", 1)[1].strip()
        return None

    @property
    def address(self) -> str:
        return self.address_on("127.0.0.1")

    def address_on(self, ip: str) -> str:
        for line in self.stdout_lines:
            if line.strip().startswith(f"/ip4/{ip}/"):
                return line.strip()
        raise AssertionError(f"{self.name} printed no address on {ip}: {self.stdout_lines}")

    @property
    def join_ref(self) -> str:
        for line in self.stdout_lines:
            m = re.search(r"--join (\S+)", line)
            if m:
                return m.group(1)
        raise AssertionError(f"{self.name} printed no join command: {self.stdout_lines}")

    def get(self, path: str, timeout: float = 5.0) -> Any:
        assert self.status_url is not None
        if self.netns:  # the endpoint is on the namespace's loopback
            fetch = (
                "import sys, urllib.request as u; "
                "sys.stdout.buffer.write(u.urlopen(sys.argv[1]).read())"
            )
            body = subprocess.run(
                [*self._in_ns, sys.executable, "-c", fetch, self.status_url + path],
                capture_output=True,
                timeout=timeout + 10,
                check=True,
            ).stdout
        else:
            with urllib.request.urlopen(self.status_url + path, timeout=timeout) as resp:
                body = resp.read()
        return json.loads(body) if path != "/metrics" else body.decode()

    def status(self) -> dict[str, Any]:
        return self.get("/status")  # type: ignore[no-any-return]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def tail(self, lines: int = 40) -> str:
        return f"--- {self.name} log tail:\n" + "\n".join(self.log().splitlines()[-lines:])

    def committed_rounds(self) -> dict[int, str]:
        """outer step -> fingerprint, from the log."""
        return {int(m.group(1)): m.group(3) for m in ROUND_RE.finditer(self.log())}

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.alive():
            self.proc.kill()
        self.proc.wait(timeout=10)

    def terminate(self, timeout: float = 20.0) -> tuple[int, float]:
        started = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout=timeout)
        return code, time.monotonic() - started


class SlowWait(UserWarning):
    """A wait that succeeded after more than half its timeout: pytest lists it in
    the warnings summary, so a passing run still says which wait made it slow."""


def wait_for(
    what: str, check: Callable[[], Any], timeout: float, *, every: float = 0.5, debug: Any = None
) -> Any:
    """Poll `check` until it returns something truthy; AssertionError after `timeout`
    (SlowWait when it took more than half of it)."""
    started = time.monotonic()
    deadline = started + timeout
    last_error: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            value = check()
            if value:
                took = time.monotonic() - started
                if took > timeout / 2:
                    warnings.warn(f"{what}: {took:.0f} s of {timeout:.0f}", SlowWait, stacklevel=2)
                return value
        except (OSError, urllib.error.URLError, ValueError, KeyError) as e:
            last_error = e
        time.sleep(every)
    extra = debug() if callable(debug) else ""
    raise AssertionError(f"timed out after {timeout}s waiting for {what} ({last_error!r})\n{extra}")
