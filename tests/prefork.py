"""A fork server for the Python processes the tests start: torch is imported once.

A daemon or averaging peer started with `subprocess` spends about 2.5 s of CPU
importing torch before it does anything; a swarm test starts six to ten of them
(more with restarts), all at once on a 2-core machine, and the one-at-a-time
group of the suite started about 200. Forked from a process that already
imported torch, a child starts in milliseconds and shares those pages.

`popen(argv, ...)` runs `[sys.executable, "-m", module, ...]` or
`[sys.executable, script.py, ...]` in a child of the fork server and returns a
`ForkedProcess` (pid, stdout, poll, wait, send_signal, kill, terminate,
returncode: what the tests use of `subprocess.Popen`). Any other command, or
`SHOAL_TEST_PREFORK=off`, gets a plain `subprocess.Popen`.

What a forked child has that an exec'd one would not: the server's imports
(torch and numpy only: no shoal module, whose import may read the environment
the child is given), its hash seed, and OpenMP's thread count read when torch
loaded (1, as every test child asks). Everything else is set per child: argv,
environment, working directory, standard streams, `random`'s seed, signal
dispositions, and SIGKILL when the server dies (the server gets it when the
pytest process that started it dies, as `die_with_parent` gives exec'd children).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import queue
import runpy
import selectors
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO, Any

ENV_SWITCH = "SHOAL_TEST_PREFORK"
PR_SET_PDEATHSIG = 1
_MAX_MESSAGE = 1 << 20


# ------------------------------------------------------------------ the client side


class ForkedProcess:
    """A child of the fork server, driven like a `subprocess.Popen`."""

    def __init__(self, server: _Server, pid: int, args: list[str], stdout: IO[bytes] | None):
        self._server = server
        self.pid = pid
        self.args = args
        self.stdout = stdout
        self.stdin = None
        self.stderr = None
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.exit_code(self.pid, timeout=0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            code = self._server.exit_code(self.pid, timeout=timeout)
            if code is None:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            self.returncode = code
        return self.returncode

    def send_signal(self, sig: int) -> None:
        # (Once its exit is known its pid may be another process's: never signal it then.)
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


# The fork server's environment: the pytest process's as it imported this module.
SERVER_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


class _Server:
    """The pytest process's handle on its fork server (one per process)."""

    def __init__(self) -> None:
        self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = SERVER_ENV
        started = threading.Event()
        failure: list[BaseException] = []

        def start_and_stay() -> None:
            # The server dies with the *thread* that forked it (PR_SET_PDEATHSIG): start it
            # from this one, which lives as long as the process, not from a test's thread.
            from daemon_harness import die_with_parent

            try:
                self._proc = subprocess.Popen(
                    [sys.executable, __file__, str(theirs.fileno())],
                    pass_fds=(theirs.fileno(),),
                    stdin=subprocess.DEVNULL,
                    env=env,
                    preexec_fn=die_with_parent,  # noqa: PLW1509 (prctl only)
                )
            except BaseException as e:  # (handed to the caller)
                failure.append(e)
            started.set()
            threading.Event().wait()

        threading.Thread(target=start_and_stay, daemon=True, name="prefork server").start()
        started.wait()
        theirs.close()
        if failure:
            raise failure[0]
        hello = json.loads(self._sock.recv(_MAX_MESSAGE) or b"{}")
        if not hello.get("ready"):
            raise RuntimeError("the fork server did not start")
        self._spawn_lock = threading.Lock()
        self._replies: queue.Queue[dict[str, Any]] = queue.Queue()
        self._exits: dict[int, int] = {}
        self._exited = threading.Condition()
        self._gone = False
        self.reaped_cpu_s = 0.0
        threading.Thread(target=self._read, daemon=True, name="prefork reader").start()

    def spawn(self, argv: list[str], env: dict[str, str], cwd: str, fds: list[int]) -> int:
        request = json.dumps({"argv": argv, "env": env, "cwd": cwd}).encode()
        with self._spawn_lock:
            socket.send_fds(self._sock, [request], fds)
            reply = self._replies.get(timeout=30.0)
        if "pid" not in reply:
            raise OSError(f"the fork server could not start {argv}: {reply}")
        return int(reply["pid"])

    def exit_code(self, pid: int, timeout: float | None) -> int | None:
        with self._exited:
            self._exited.wait_for(lambda: pid in self._exits or self._gone, timeout)
            if pid in self._exits:
                return self._exits[pid]
            # The server died: its children got SIGKILL with it (PR_SET_PDEATHSIG).
            return -signal.SIGKILL if self._gone else None

    def _read(self) -> None:
        while True:
            try:
                raw = self._sock.recv(_MAX_MESSAGE)
            except OSError:
                raw = b""
            if not raw:
                with self._exited:
                    self._gone = True
                    self._exited.notify_all()
                self._replies.put({"error": "the fork server exited"})
                return
            message = json.loads(raw)
            if "exit" in message:
                with self._exited:
                    self._exits[message["exit"]] = message["code"]
                    self.reaped_cpu_s += message["cpu_s"]
                    self._exited.notify_all()
            else:
                self._replies.put(message)


_servers: list[_Server] = []  # (this process's one, once started)
_servers_lock = threading.Lock()


def _the_server() -> _Server:
    with _servers_lock:
        if not _servers:
            _servers.append(_Server())
        return _servers[0]


def reaped_cpu_s() -> float:
    """CPU seconds of the forked children that exited (theirs are not this process's
    RUSAGE_CHILDREN: the server reaped them)."""
    return _servers[0].reaped_cpu_s if _servers else 0.0


# What a Python process reads from its environment as it starts (PYTHONPATH, for the
# tests' tampered peers: a sitecustomize.py runs at startup) and torch as it loads
# (OpenMP's thread count): a child that asks for other values than the server had is
# started afresh.
_READ_AT_START = ("PYTHON", "OMP_", "MKL_", "KMP_", "GOMP_", "TORCH", "LD_", "CUDA")


def _started_alike(env: dict[str, str], server_env: dict[str, str]) -> bool:
    def read_at_start(e: dict[str, str]) -> dict[str, str]:
        return {k: v for k, v in e.items() if k.startswith(_READ_AT_START)}

    return read_at_start(env) == read_at_start(server_env)


def _forkable(argv: list[str]) -> bool:
    if os.environ.get(ENV_SWITCH, "on") == "off" or len(argv) < 2 or argv[0] != sys.executable:
        return False
    if argv[1] == "-m":
        return len(argv) >= 3
    return argv[1].endswith(".py") and Path(argv[1]).is_file()


def popen(
    argv: list[str],
    *,
    stdout: int | IO[Any] | None = None,
    stderr: int | IO[Any] | None = None,
    env: dict[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    preexec_fn: Any = None,
) -> subprocess.Popen[bytes] | ForkedProcess:
    """`subprocess.Popen(argv, ...)` for a Python child, forked from the server when it
    can be (stdout: None, subprocess.PIPE or a file; stderr: None or a file)."""
    env = dict(os.environ if env is None else env)
    plain_stdout = stdout in (None, subprocess.PIPE) or hasattr(stdout, "fileno")
    if not (_forkable(argv) and plain_stdout and _started_alike(env, SERVER_ENV)):
        return subprocess.Popen(
            argv,
            stdout=stdout,
            stderr=stderr,
            env=env,
            cwd=cwd,
            preexec_fn=preexec_fn,  # noqa: PLW1509
        )
    server = _the_server()
    to_close: list[int] = []
    reader: IO[bytes] | None = None
    if stdout == subprocess.PIPE:
        read_end, write_end = os.pipe()
        reader, out_fd = os.fdopen(read_end, "rb"), write_end
        to_close.append(write_end)
    else:
        out_fd = stdout.fileno() if stdout is not None else 1  # type: ignore[union-attr]
    err_fd = stderr.fileno() if stderr is not None and not isinstance(stderr, int) else 2
    null = os.open(os.devnull, os.O_RDONLY)
    to_close.append(null)
    try:
        pid = server.spawn(
            argv,
            env,
            str(cwd if cwd is not None else os.getcwd()),
            [null, out_fd, err_fd],
        )
    except BaseException:
        if reader is not None:
            reader.close()
        raise
    finally:
        for fd in to_close:
            os.close(fd)
    return ForkedProcess(server, pid, argv, reader)


# ------------------------------------------------------------------ the server side


def _serve(sock: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """Forks a child per request and reports each one's exit; returns only in a child
    (its request and its standard streams)."""
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    selector = selectors.DefaultSelector()
    selector.register(sock, selectors.EVENT_READ)
    selector.register(wake_read, selectors.EVENT_READ)
    sock.send(json.dumps({"ready": True}).encode())
    while True:
        for key, _ in selector.select():
            if key.fileobj is not sock:
                os.read(wake_read, 4096)
                _reap(sock)
                continue
            message, fds, _, _ = socket.recv_fds(sock, _MAX_MESSAGE, 3)
            if not message:
                sys.exit(0)  # the pytest process closed its end
            pid = os.fork()
            if pid == 0:
                selector.close()
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                for fd in (wake_read, wake_write):
                    os.close(fd)
                sock.close()
                return json.loads(message), fds
            for fd in fds:
                os.close(fd)
            sock.send(json.dumps({"pid": pid}).encode())
        _reap(sock)


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        code = os.waitstatus_to_exitcode(status)
        cpu = usage.ru_utime + usage.ru_stime
        sock.send(json.dumps({"exit": pid, "code": code, "cpu_s": cpu}).encode())


def _become(request: dict[str, Any], fds: list[int], server_pid: int) -> None:
    """In the child: its death tied to the server's, its streams, environment, working
    directory and argv; then the module or script runs as __main__."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != server_pid:  # (the server died before the prctl)
        os._exit(1)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    import random

    random.seed()
    argv = request["argv"][1:]
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        sys.path[0] = str(Path(argv[0]).resolve().parent)
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    import numpy  # noqa: F401 (imported once here, by every child's fork)
    import torch  # noqa: F401

    server_pid = os.getpid()
    request, fds = _serve(socket.socket(fileno=int(sys.argv[1])))
    _become(request, fds, server_pid)
