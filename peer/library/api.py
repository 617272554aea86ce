"""The asynchronous library API: a peer started in-process that averages the user's model.

    import shoal

    peer = await shoal.host("myexp", task="mytask.py:make_task", data_dir="./peer-a")
    # or: peer = await shoal.join("myexp@12D3KooW...", bootstrap=[...], data_dir=...)
    outer = await peer.outer(model, optimizer)
    for batch in loader:
        model(batch).backward()
        await outer.step(tokens=len(batch))  # optimizer step; a round every H steps
    await peer.aclose()

The peer is started by the daemon's own start-up (`daemon.start_node`: identity,
transport, NAT traversal, DHT, the optional status endpoint) and finds or hosts
its experiment as `shoal run` does (`session.find_experiment`: the manifest, the
task's code pinned by digest); the outer part of each step is the daemon trainer's
(`training.outer_loop.OuterLoop`). The experiment is a task's (`--task file.py:attr`), so
that a `shoal run` peer builds the same model; the user's model must have the
task model's parameters (names and shapes), and starts from the experiment's
weights: the swarm's state when a peer serves it, else the initial ones the
manifest pins. Its batches come from the user's loop, which a referee cannot
re-execute: a library peer hosts its experiment unverified unless told otherwise
(the manifest says `verify: false`), and in a verified experiment it trains the
task's own steps instead (`Peer.task_trainer`, `task_trainer.py`: the daemon's
`Trainer`, a step per call). `shoal.sync` runs the same on a background event loop
for plain scripts.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from shoal.averaging.fingerprint import state_fingerprint
from shoal.averaging.outer import OuterStrategy, RoundReport
from shoal.averaging.registry import is_pipeline

from ..config import OPTIONS, Config, ConfigError, build_config
from ..daemon import StartedNode, StartupError, print_join_command, start_node
from ..experiment import Manifest
from ..session import (
    MANIFESTS_DIR,
    Session,
    SessionError,
    find_experiment,
    make_outer_strategy,
    start_strategy,
)
from ..status.progress import Progress
from ..training.device import DeviceInventory
from ..training.outer_loop import OuterLoop, TrainerStats
from ..training.task import Task
from ..verify.ban_watch import BanWatcher
from .task_trainer import TaskTrainer, open_task_trainer

__all__ = ["LibraryError", "Outer", "Peer", "TaskTrainer", "host", "join"]

log = logging.getLogger("shoal.library")

# Any free port on every interface: a script beside a `shoal run` (port 4001) starts too.
LISTEN = "/ip4/0.0.0.0/tcp/0"


class LibraryError(Exception):
    """The peer cannot start or train as asked; the message is one line for the user."""


async def host(
    name: str,
    *,
    task: str,
    data_dir: str | Path,
    bootstrap: Iterable[str] = (),
    listen: str | Iterable[str] = LISTEN,
    status: str | None = None,
    strategy: str = "diloco",
    inner_steps: int | None = None,
    task_options: Mapping[str, Any] | None = None,
    strategy_options: Mapping[str, Any] | None = None,
    **options: Any,
) -> Peer:
    """Start a peer hosting experiment `name` of `task` (a built-in name, ``file.py:attr``
    or ``package.module:attr``): created on first use and kept in `data_dir`, as
    ``shoal run --host-experiment NAME`` does. `status`: ``"HOST:PORT"`` to serve the
    status endpoint (None: none). `options`: any other ``shoal run`` option by its name
    (``mdns="off"``, ``network=...``). `verify` is ``"off"`` unless given: the batches of
    your own loop (`Peer.outer`) cannot be re-executed; a verified experiment
    (``verify="on"``) trains through `Peer.task_trainer`. LibraryError when anything
    cannot start."""
    flags = {
        "verify": "off",
        **options,
        "host_experiment": name,
        "task": task,
        "strategy": strategy,
        "task_option": task_options or {},
        "strategy_option": strategy_options or {},
    }
    if inner_steps is not None:  # (None: the strategy's default for a new experiment)
        flags["inner_steps"] = inner_steps
    config = _config(flags, data_dir, bootstrap, listen, status)
    # A restarted script hosts its saved experiment: it takes the swarm's state.
    existed = (config.data_dir / MANIFESTS_DIR / f"{name}.manifest").exists()
    return await _start(config, join_swarm=existed)


async def join(
    ref: str,
    *,
    data_dir: str | Path,
    bootstrap: Iterable[str] = (),
    task: str | None = None,
    listen: str | Iterable[str] = LISTEN,
    status: str | None = None,
    **options: Any,
) -> Peer:
    """Start a peer joining experiment `ref` (``NAME@PEERID``, as ``shoal run --join``)
    through `bootstrap` (multiaddrs; none: the --network's peers or mDNS). `task`: the
    custom task's spec, which you consent to run (its code must have the digest the
    manifest pins). LibraryError when anything cannot start."""
    flags = {**options, "join": ref}
    if task is not None:
        flags["task"] = task
    config = _config(flags, data_dir, bootstrap, listen, status)
    return await _start(config, join_swarm=True)


class Peer:
    """A running peer in one experiment (`host`, `join`); `outer` trains a model in it."""

    def __init__(
        self,
        started: StartedNode,
        stack: contextlib.AsyncExitStack,
        experiment: tuple[Manifest, Task, torch.nn.Module | None, bool],
        *,
        join_swarm: bool,
    ) -> None:
        self.node = started.node
        self.config = started.config
        self.manifest, self.task, model, self.hosting = experiment
        # The experiment's model at its initial weights, for a user who brings none.
        self.model: torch.nn.Module | None = model
        self._stack = stack
        self._join_swarm = join_swarm or not self.hosting
        self._training: Outer | TaskTrainer | None = None  # (one per peer)

    @property
    def peer_id(self) -> str:
        return str(self.node.identity.peer_id)

    @property
    def ref(self) -> str:
        """What ``shoal run --join`` and `join` take: NAME@PEERID."""
        return str(self.manifest.ref)

    @property
    def addresses(self) -> list[str]:
        """The addresses another peer bootstraps through (listening ones included)."""
        host = self.node.host
        return [str(a) for a in (host.addresses() or host.interface_addresses())]

    @property
    def join_command(self) -> str | None:
        """The ``shoal run`` command line that joins this experiment from elsewhere
        (once `outer` started the training; None before)."""
        return self.node.join_command

    @property
    def status_url(self) -> str | None:
        return self.node.status_url

    async def outer(
        self, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None
    ) -> Outer:
        """Averaging for `model` (default: `self.model`, the task's), trained by your loop.

        `model` must have the task model's parameters (names and shapes); they are set to
        the experiment's current state: the swarm's when a peer serves it, else the
        manifest's initial weights. `optimizer`: the inner optimizer that `Outer.step`
        steps (and zeroes); None when your loop steps its own (a `transformers.Trainer`).
        """
        self._check_trainable()
        manifest = self.manifest
        assert self.model is not None
        if manifest.strategy_options.get("verify"):
            raise LibraryError(
                f"{manifest.describe()} verifies work: its batches must be drawn by shoal "
                "(a referee re-executes them), not by your loop; train it with "
                "peer.task_trainer() (or `shoal run`)"
            )
        if model is not None and model is not self.model:
            await asyncio.to_thread(_take_initial_weights, model, self.model, manifest)
            self.model = model
        model = self.model
        # (Off the loop, as the daemon hashes: a large model takes a while.)
        params = [p.detach() for p in model.parameters()]
        initial = await asyncio.to_thread(state_fingerprint, params, {})
        try:
            strategy = make_outer_strategy(manifest, self.node.dht, list(model.parameters()))
            loaded = await start_strategy(
                strategy, model, manifest, join=self._join_swarm, initial=initial
            )
        except SessionError as e:
            raise LibraryError(str(e)) from None
        loop = OuterLoop(strategy)
        device = next(model.parameters()).device
        session = Session(
            manifest,
            self.task,
            loop,  # type: ignore[arg-type]  # the node reads stats and on_round of a trainer
            strategy,
            self.hosting,
            False,
            loaded,
            device,
            DeviceInventory(),
            "fp32",
            BanWatcher(self.node.dht, manifest.namespace),
        )
        outer = Outer(loop, strategy, optimizer)
        self._training = outer
        self._attach(session)
        return outer

    async def task_trainer(self) -> TaskTrainer:
        """The experiment's own training, one `await trainer.step()` per call in your loop:
        `shoal run`'s steps (the task's batches and loss, the manifest's inner optimizer,
        checkpoints in `data_dir`, on the device the `device` option names), which a
        verified experiment's referees can re-execute. `trainer.model` is the model."""
        self._check_trainable()
        experiment = (self.manifest, self.task, self.model, self.hosting)
        try:
            trainer = await open_task_trainer(self.node, self.config, experiment)
        except (SessionError, ConfigError) as e:
            raise LibraryError(str(e)) from None
        self.model = trainer.model
        self._training = trainer
        self._attach(trainer.session)
        return trainer

    def _check_trainable(self) -> None:
        if self._training is not None:
            raise LibraryError("this peer already trains a model (one per peer)")
        if is_pipeline(self.manifest.strategy) or self.model is None:
            raise LibraryError(
                f"{self.manifest.describe()} is pipelined: its stages run in `shoal run` peers"
            )

    def _attach(self, session: Session) -> None:
        """The node reports, serves and records this training as the daemon's."""
        self.node.attach(session)
        self.node.start_background(Progress(live=False))
        text = io.StringIO()
        print_join_command(self.node, self.config, text)
        log.info("%s", text.getvalue().strip())

    async def aclose(self) -> None:
        """Shut down: the round in flight ends (commit or abort; a task trainer then writes
        a checkpoint), then the strategy, the status endpoint, the DHT, NAT traversal and
        the transport close in turn."""
        if self._training is not None:
            await self._training.finish()
        await self._stack.aclose()

    async def __aenter__(self) -> Peer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class Outer:
    """The outer part of your training loop: `step` after each backward pass."""

    def __init__(
        self,
        loop: OuterLoop,
        strategy: OuterStrategy,
        optimizer: torch.optim.Optimizer | None,
    ) -> None:
        self._loop = loop
        self.strategy = strategy
        self.optimizer = optimizer

    def optimizer_step(self) -> None:
        """The inner optimizer's step and zero_grad (nothing without an optimizer)."""
        if self.optimizer is not None:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)

    async def step(
        self, *, tokens: int = 1, loss: float | torch.Tensor | None = None
    ) -> list[RoundReport]:
        """An inner step ends: the optimizer's step, then the strategy's turn (every H
        steps a round: averaged, committed exactly, or a re-sync when this peer fell
        behind). `tokens`: what the step trained on (tokens or samples), which weighs
        this peer's contribution; `loss`: for the status and `stats`. The reports of
        the rounds that ended."""
        self.optimizer_step()
        return await self.after_step(tokens=tokens, loss=loss)

    async def after_step(
        self, *, tokens: int = 1, loss: float | torch.Tensor | None = None
    ) -> list[RoundReport]:
        """`step` without the optimizer's step (your loop stepped it)."""
        value = math.nan if loss is None else float(torch.as_tensor(loss).detach())
        reports = await self._loop.after_step(value, int(tokens))
        # A turn for the network (heartbeats, state requests) even when the strategy
        # had nothing to wait for: the user's computing holds this loop between steps.
        await asyncio.sleep(0)
        return reports

    @property
    def outer_steps(self) -> int:
        """Outer steps applied so far (the swarm's commits this peer took part in or loaded)."""
        return self.strategy.outer_steps

    @property
    def fingerprint(self) -> str | None:
        """The fingerprint of the last committed state (equal on every peer of a round)."""
        return self.strategy.committed_fingerprint

    @property
    def stats(self) -> TrainerStats:
        return self._loop.stats

    async def finish(self) -> None:
        """No new rounds; the one in flight commits or aborts within a bounded time."""
        await self._loop.finish()


def _config(
    flags: dict[str, Any],
    data_dir: str | Path,
    bootstrap: Iterable[str],
    listen: str | Iterable[str],
    status: str | None,
) -> Config:
    """The `Config` of a library peer: the arguments as ``shoal run`` flags, parsed by the
    daemon's own parsers (the environment and config files are not read)."""
    flags = {
        **flags,
        "data_dir": str(data_dir),
        "listen": [listen] if isinstance(listen, str) else list(listen),
        "status_addr": status or "off",
    }
    bootstrap = [str(a) for a in bootstrap]
    if bootstrap:
        flags["bootstrap"] = bootstrap
    unknown = sorted(set(flags) - set(OPTIONS))
    if unknown:
        raise LibraryError(f"unknown option {unknown[0]!r} (the names of `shoal run`'s flags)")
    raw = {name: _flag_text(value) for name, value in flags.items()}
    try:
        return build_config(list(raw), raw, {})
    except ConfigError as e:
        raise LibraryError(str(e)) from None


def _flag_text(value: Any) -> str | list[str]:
    """A value as its command-line text (a mapping: KEY=VALUE items, values as JSON)."""
    if isinstance(value, Mapping):
        return [f"{k}={v if isinstance(v, str) else json.dumps(v)}" for k, v in value.items()]
    if isinstance(value, list | tuple):
        return [str(v) for v in value]
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


async def _start(config: Config, *, join_swarm: bool) -> Peer:
    stack = contextlib.AsyncExitStack()
    try:
        started = await start_node(config, stack)
        experiment = await find_experiment(started.config, started.node.identity, started.node.dht)
        return Peer(started, stack, experiment, join_swarm=join_swarm)
    except (StartupError, ConfigError, SessionError) as e:
        await stack.aclose()
        raise LibraryError(str(e)) from None
    except BaseException:
        await stack.aclose()
        raise


def _take_initial_weights(
    model: torch.nn.Module, built: torch.nn.Module, manifest: Manifest
) -> None:
    """Load the experiment's initial weights (`built`, the task's model) into the user's
    `model`; LibraryError naming the first parameter that differs in name or shape."""
    ours, theirs = built.state_dict(), model.state_dict()
    for name in sorted(set(ours) | set(theirs)):
        a, b = ours.get(name), theirs.get(name)
        if a is None or b is None or a.shape != b.shape:
            raise LibraryError(
                f"your model does not fit {manifest.describe()}: parameter {name!r} is "
                f"{_shape(b)} in yours, {_shape(a)} in its task's model"
            )
    with torch.no_grad():
        model.load_state_dict(ours)


def _shape(tensor: torch.Tensor | None) -> str:
    return "missing" if tensor is None else str(tuple(tensor.shape))
