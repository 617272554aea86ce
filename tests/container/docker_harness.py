"""Containers for the tests: the docker CLI driven by subprocess, nothing left behind.

`Engine` runs `docker` (or `podman`, which takes the same commands) with a
deadline on every call; `ContainerSet` creates containers, networks and
volumes under one unique prefix and removes all of them at the end, whatever
happened; `wait_for` polls a condition until a deadline and says what it was
waiting for when it gives up. Status pages are reached through ports
published on 127.0.0.1 only.

The image is built from the checkout with docker/Dockerfile (the classic
builder: podman's Docker API has no BuildKit); a torch wheel found by
`pip download --no-index` (this machine's local wheel) is put in docker/wheels
first, so the build does not need the PyTorch index.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "docker" / "Dockerfile"
COMPOSE_FILE = REPO / "docker" / "compose.yaml"
WHEELS_DIR = REPO / "docker" / "wheels"
# SHOAL_TEST_IMAGE names an image built beforehand, used as it is; without it the
# tests build this tag from the checkout.
PREBUILT_IMAGE = os.environ.get("SHOAL_TEST_IMAGE")
IMAGE = PREBUILT_IMAGE or "localhost/shoal:test"
STATUS_PORT = 8080
P2P_PORT = 31337

# Every docker call has a deadline; a build gets longer (a cold one installs torch).
CALL_TIMEOUT = 60.0
BUILD_TIMEOUT = 900.0
HTTP_TIMEOUT = 3.0

T = TypeVar("T")

# Rounds every few seconds on a tiny model; deadlines short enough that a killed
# peer costs seconds. Only the host's values matter (they go into the experiment).
QUICK_ROUNDS = {
    "SHOAL_INNER_STEPS": "10",
    "SHOAL_TASK_OPTIONS": "d_model=32,n_layers=1,n_heads=2,context=32,batch_size=4",
    "SHOAL_STRATEGY_OPTIONS": "matchmaking_time=3,round_timeout=15,stall_timeout=3",
}
# Peers share two cores with the rest of the suite.
PEER_ENV = {"SHOAL_THREADS": "1", "OMP_NUM_THREADS": "1"}


class EngineError(Exception):
    """A docker command failed; the message has the command and its stderr."""


def _engine_cli() -> str | None:
    """SHOAL_DOCKER, else `docker`, else `podman` (same commands, no daemon needed)."""
    if os.environ.get("SHOAL_DOCKER"):
        return shutil.which(os.environ["SHOAL_DOCKER"])
    return shutil.which("docker") or shutil.which("podman")


def engine_unavailable() -> str | None:
    """Why containers cannot run here (the skip reason), or None."""
    cli = _engine_cli()
    if cli is None and os.environ.get("SHOAL_DOCKER"):
        return f"SHOAL_DOCKER={os.environ['SHOAL_DOCKER']}: no such command"
    if cli is None:
        return "no docker or podman command (SHOAL_DOCKER names another CLI)"
    try:
        probe = subprocess.run(
            [cli, "version", "--format", "{{.Server.Version}}"],
            check=False,
            capture_output=True,
            text=True,
            timeout=20,
        )
    except subprocess.TimeoutExpired:
        return f"`{cli} version` did not answer in 20 s"
    if probe.returncode != 0:
        why = (probe.stderr.strip().splitlines() or ["no answer"])[-1]
        return (
            f"no container engine answers `{Path(cli).name}` ({why}); as root, "
            "../shared/lab/containers.sh up serves one through podman"
        )
    return None


def compose_unavailable() -> str | None:
    """Why `docker-compose` cannot run here, or None."""
    if compose_command() is None:
        return "neither docker-compose nor the `docker compose` plugin is installed"
    return engine_unavailable()


def compose_command() -> list[str] | None:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    docker = shutil.which("docker")
    if docker:
        plugin = subprocess.run(
            [docker, "compose", "version"], check=False, capture_output=True, timeout=20
        )
        if plugin.returncode == 0:
            return [docker, "compose"]
    return None


class Engine:
    """The docker CLI; every call has a deadline, a failure raises EngineError."""

    def __init__(self) -> None:
        cli = _engine_cli()
        assert cli is not None, engine_unavailable()
        self.cli = cli

    def run(
        self,
        *args: str,
        timeout: float = CALL_TIMEOUT,
        check: bool = True,
        env: Mapping[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        command = [self.cli, *args]
        try:
            done = subprocess.run(
                command,
                check=False,
                capture_output=True,
                text=True,
                timeout=timeout,
                env={**os.environ, **env} if env else None,
            )
        except subprocess.TimeoutExpired as e:
            raise EngineError(f"{' '.join(command)}: no answer in {timeout:.0f}s") from e
        if check and done.returncode != 0:
            raise EngineError(
                f"{' '.join(command)} exited with {done.returncode}:\n{done.stderr.strip()}"
            )
        return done

    def out(self, *args: str, timeout: float = CALL_TIMEOUT) -> str:
        return self.run(*args, timeout=timeout).stdout.strip()

    def inspect(self, kind: str, name: str) -> dict[str, Any]:
        return json.loads(self.out(kind, "inspect", name))[0]  # type: ignore[no-any-return]

    def build_image(self, tag: str = IMAGE) -> float:
        """docker build of docker/Dockerfile from the checkout; returns the seconds it took."""
        fetch_torch_wheel()
        started = time.monotonic()
        done = self.run(
            "build",
            "--force-rm",  # a failed build leaves no container behind
            "--file",
            str(DOCKERFILE),
            "--tag",
            tag,
            str(REPO),
            timeout=BUILD_TIMEOUT,
            check=False,
            env={"DOCKER_BUILDKIT": "0"},
        )
        if done.returncode != 0:
            tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-40:])
            raise EngineError(f"docker build failed:\n{tail}")
        return time.monotonic() - started

    def image_size(self, tag: str = IMAGE) -> int:
        return int(self.inspect("image", tag)["Size"])


def dockerfile_arg(name: str) -> str:
    """The default of `ARG name=...` in docker/Dockerfile."""
    match = re.search(rf"^ARG {name}=(\S*)", DOCKERFILE.read_text(), re.MULTILINE)
    assert match, f"no ARG {name} in {DOCKERFILE}"
    return match.group(1)


def fetch_torch_wheel() -> None:
    """Put the CPU torch wheel the Dockerfile asks for in docker/wheels, when pip has it
    locally (find-links); otherwise leave it to the build, which uses the PyTorch index."""
    version = dockerfile_arg("TORCH_VERSION")
    if any(WHEELS_DIR.glob(f"torch-{version}+cpu-*.whl")):
        return
    subprocess.run(
        [
            *(sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-index"),
            *("--dest", str(WHEELS_DIR), f"torch=={version}"),
        ],
        capture_output=True,
        timeout=300,
        check=False,
    )


# --- polling ------------------------------------------------------------------------------------


def wait_for(
    what: str,
    condition: Callable[[], T | None],
    timeout: float,
    interval: float = 0.5,
    debug: Callable[[], str] | None = None,
) -> T:
    """Poll `condition` until it returns something truthy (returned) or `timeout` passes.

    Polling is the only way to learn what a container's HTTP endpoint says; every
    exception the condition raises counts as "not yet" and the last one is reported.
    """
    deadline = time.monotonic() + timeout
    last_error: BaseException | None = None
    while True:
        try:
            value = condition()
        except (OSError, ValueError, KeyError, TypeError, EngineError) as e:
            last_error, value = e, None
        if value:
            return value
        if time.monotonic() >= deadline:
            detail = f" (last error: {last_error!r})" if last_error else ""
            extra = f"\n{debug()}" if debug else ""
            raise AssertionError(f"timed out after {timeout:.0f}s: {what}{detail}{extra}")
        time.sleep(interval)


def committed(status: dict[str, Any], group_size: int | None = None) -> dict[str, Any] | None:
    """The last round of `status` when it committed (with `group_size` peers, when given)."""
    last = status.get("last_round")
    if not last or last["outcome"] != "committed":
        return None
    if group_size is None or last["group_size"] == group_size:
        return last  # type: ignore[no-any-return]
    return None


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=HTTP_TIMEOUT) as response:
        return json.load(response)


# --- containers -----------------------------------------------------------------------------------


class Container:
    """A container this test started; `status()` is its /status through the published port."""

    def __init__(self, engine: Engine, name: str) -> None:
        self.engine = engine
        self.name = name

    def status_url(self) -> str:
        # Looked up each time: a restarted container may get another host port.
        published = self.engine.out("port", self.name, f"{STATUS_PORT}/tcp").splitlines()[0]
        host, _, port = published.rpartition(":")
        assert host in ("127.0.0.1", "0.0.0.0"), f"status port published on {host}"
        return f"http://127.0.0.1:{port}"

    def get(self, path: str) -> Any:
        return get_json(self.status_url() + path)

    def status(self) -> dict[str, Any]:
        return self.get("/status")  # type: ignore[no-any-return]

    def state(self) -> dict[str, Any]:
        return self.engine.inspect("container", self.name)["State"]  # type: ignore[no-any-return]

    def logs(self) -> str:
        done = self.engine.run("logs", self.name, check=False)
        return done.stdout + done.stderr

    def tail(self, lines: int = 30) -> str:
        text = "\n".join(self.logs().splitlines()[-lines:])
        return f"--- {self.name} (last {lines} lines) ---\n{text}"

    def exec(
        self, *command: str, timeout: float = CALL_TIMEOUT
    ) -> subprocess.CompletedProcess[str]:
        """docker exec; the result, whatever the exit status."""
        return self.engine.run("exec", self.name, *command, timeout=timeout, check=False)

    def stop(self, grace: float = 10.0) -> float:
        """docker stop with docker's default grace period spelled out (podman's Docker
        API otherwise uses 0 s, a SIGKILL); returns the seconds it took."""
        started = time.monotonic()
        self.engine.run("stop", "--time", str(int(grace)), self.name, timeout=grace + 30)
        return time.monotonic() - started

    def kill(self) -> None:
        self.engine.run("kill", self.name)

    def start(self) -> None:
        self.engine.run("start", self.name)


class ContainerSet:
    """Containers, networks and volumes under one unique name prefix, all removed by close()."""

    def __init__(self, engine: Engine, label: str) -> None:
        self.engine = engine
        self.prefix = f"shoal-test-{label}-{uuid.uuid4().hex[:6]}"
        self.containers: list[Container] = []
        self.networks: list[str] = []
        self.volumes: list[str] = []

    def network(self, name: str) -> str:
        full = f"{self.prefix}-{name}"
        self.networks.append(full)
        self.engine.run("network", "create", full)
        return full

    def volume(self, name: str) -> str:
        full = f"{self.prefix}-{name}"
        self.volumes.append(full)
        self.engine.run("volume", "create", full)
        return full

    def container_name(self, name: str) -> str:
        return f"{self.prefix}-{name}"

    def run(
        self,
        name: str,
        *,
        env: Mapping[str, str] = {},
        network: str | None = None,
        volume: str | None = None,
        image: str = IMAGE,
        args: Sequence[str] = (),
    ) -> Container:
        """docker run -d: the image's entry point (`shoal run`), status port on a port of
        127.0.0.1 drawn below the kernel's ephemeral range, as `ComposeProject` does and
        for its reason; a port taken meanwhile is drawn again (the container that failed
        to start on it removed first), twice at most."""
        full = self.container_name(name)
        container = Container(self.engine, full)
        self.containers.append(container)
        options = ["--name", full]
        if network:
            options += ["--network", network]
        if volume:
            options += ["--volume", f"{volume}:/data"]
        for key, value in env.items():
            options += ["--env", f"{key}={value}"]
        for attempt in range(3):
            (port,) = _unephemeral_ports(1)
            publish = ["--publish", f"127.0.0.1:{port}:{STATUS_PORT}"]
            try:
                self.engine.run("run", "--detach", *publish, *options, image, *args)
                return container
            except EngineError as e:
                if not _port_taken(e) or attempt == 2:
                    raise
                self.engine.run("rm", "--force", full, check=False)
        raise AssertionError("unreachable")

    def one_off(self, *command: str, volume: str, image: str = IMAGE) -> str:
        """Run `command` in a throw-away container of the image with `volume` on /data."""
        entrypoint, *rest = command
        return self.engine.out(
            "run",
            "--rm",
            "--volume",
            f"{volume}:/data",
            "--entrypoint",
            entrypoint,
            image,
            *rest,
        )

    def debug(self) -> str:
        return "\n".join(c.tail() for c in self.containers)

    def close(self) -> None:
        """Remove everything, each step on its own: one failure must not leave the rest."""
        for container in self.containers:
            self.engine.run("rm", "--force", "--volumes", container.name, check=False)
        for network in self.networks:
            self.engine.run("network", "rm", network, check=False)
        for volume in self.volumes:
            self.engine.run("volume", "rm", "--force", volume, check=False)


@contextmanager
def container_set(engine: Engine, label: str) -> Iterator[ContainerSet]:
    containers = ContainerSet(engine, label)
    try:
        yield containers
    finally:
        containers.close()


# --- compose --------------------------------------------------------------------------------------


def _unephemeral_ports(count: int, floor: int = 20000) -> list[int]:
    """`count` distinct ports drawn at random from [floor, the kernel's ephemeral range):
    no socket bound to port 0 is given one of them."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # (Linux's default)
    if low - floor < 4 * count:
        floor = max(1024, low - 8192)
    return random.sample(range(floor, low), count)


def _port_taken(error: EngineError) -> bool:
    return "already in use" in str(error) or "already allocated" in str(error)


class ComposeProject:
    """docker-compose on docker/compose.yaml with `profile`, under a unique project name;
    each service of `status_ports` (service -> the variable setting its published status
    port) publishes its status port on a port of 127.0.0.1 drawn below the kernel's
    ephemeral range (`_unephemeral_ports`), read back with `compose port`. Not one the
    engine chooses (0): it draws from the ephemeral range too, where another test's
    socket bound to port 0 could hold it, and the engine's forwarding rule for the port
    then refused that test's connections (CI ci38: both tests failed). A port another
    project drew meanwhile fails `up`, which draws again (`up`)."""

    def __init__(
        self,
        engine: Engine,
        profile: str,
        status_ports: Mapping[str, str],
        env: Mapping[str, str],
    ) -> None:
        self.engine = engine
        self.profile = profile
        self.name = f"shoal-test-{uuid.uuid4().hex[:6]}"
        self.published = set(status_ports)
        self._ports: dict[str, int] = {}  # service -> its status port, as last read back
        self._variables = list(status_ports.values())
        self.env = {**env, **self._drawn_ports()}

    def _drawn_ports(self) -> dict[str, str]:
        return {
            v: str(p)
            for v, p in zip(self._variables, _unephemeral_ports(len(self._variables)), strict=True)
        }

    def up(self, *services: str, timeout: float = 180) -> None:
        """`up --detach --no-build` of `services` (none: the profile's); a published port
        taken meanwhile (by another project) is drawn again, twice at most."""
        for attempt in range(3):
            try:
                self.run("up", "--detach", "--no-build", *services, timeout=timeout)
                return
            except EngineError as e:
                if not _port_taken(e) or attempt == 2:
                    raise
                self.env = {**self.env, **self._drawn_ports()}
                self._ports.clear()

    def run(self, *args: str, timeout: float = CALL_TIMEOUT, check: bool = True) -> str:
        command = [*(compose_command() or []), "--project-name", self.name]
        command += ["--file", str(COMPOSE_FILE), "--profile", self.profile, *args]
        done = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**_without_shoal_variables(), **self.env},
            check=False,
        )
        if check and done.returncode != 0:
            raise EngineError(f"{' '.join(command)}: {done.returncode}\n{done.stderr.strip()}")
        return done.stdout.strip()

    def container(self, service: str) -> str:
        return self.run("ps", "--quiet", service).splitlines()[0]

    def status(self, service: str) -> dict[str, Any]:
        if service in self.published:
            try:
                return get_json(f"http://127.0.0.1:{self.port(service)}/status")  # type: ignore[no-any-return]
            except OSError:
                # (A container created again, by `up` or a restart, has another port.)
                self._ports.pop(service, None)
                return get_json(f"http://127.0.0.1:{self.port(service)}/status")  # type: ignore[no-any-return]
        # Behind the NAT nothing is published: ask from inside its network namespace.
        fetch = (
            "import sys, urllib.request; "
            "sys.stdout.write(urllib.request.urlopen('http://127.0.0.1:8080/status', "
            "timeout=3).read().decode())"
        )
        out = self.engine.out("exec", self.container(service), "python3", "-c", fetch)
        return json.loads(out)  # type: ignore[no-any-return]

    def port(self, service: str) -> int:
        """The host port of `service`'s published status port."""
        if service not in self._ports:
            address = self.run("port", service, str(STATUS_PORT)).splitlines()[0]
            self._ports[service] = int(address.rsplit(":", 1)[1])
        return self._ports[service]

    def logs(self) -> str:
        return self.run("logs", "--no-color", "--tail", "40", check=False)

    def down(self) -> None:
        """Remove the project's containers, networks and volumes, whatever state they are in."""
        self.run("down", "--volumes", "--timeout", "10", timeout=120, check=False)
        # A container sharing another's network namespace can make the first `down`
        # fail to remove that other one (podman); clear what is left by label.
        label = f"label=com.docker.compose.project={self.name}"
        left = self.engine.out("ps", "--all", "--quiet", "--filter", label).split()
        if left:
            self.engine.run("rm", "--force", "--volumes", *left, check=False)
            self.run("down", "--volumes", "--timeout", "10", timeout=120, check=False)


def _without_shoal_variables() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")}
