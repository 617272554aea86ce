"""Training tasks: what a shoal experiment trains (a model, its data, its loss).

A *task* is an object with the methods of `Task` below. The trainer asks it for
a model, for endless training batches from this peer's shard of the data, for a
loss, and for a fixed validation set; everything else (averaging, checkpoints,
verification) is the daemon's business. shoal has two built-in tasks,
``bytegpt`` (a small byte-level GPT on the Python standard library's source, or
on your own text with ``--data``) and ``hf`` (a Hugging Face ``transformers``
causal LM built from a config, `shoal.peer.training.tasks.hf`: ``pip install
'shoal[hf]'``), and loads any other task from your code.

Writing a custom task
---------------------
Write a *factory*: a function that takes the task's configuration (a dict) and
returns the task. A minimal one, in ``mytask.py``::

    import torch
    from shoal.peer.training.task import TaskError

    class MyTask:
        name = "mytask"

        def __init__(self, config: dict, data=None):
            unknown = set(config) - {"hidden", "batch_size"}
            if unknown:
                raise TaskError(f"mytask: unknown config key {sorted(unknown)[0]!r}")
            self.hidden = int(config.get("hidden", 64))
            self.batch_size = int(config.get("batch_size", 32))
            ...  # read `data` (a Path, or None) here, once

        def config(self) -> dict:
            return {"hidden": self.hidden, "batch_size": self.batch_size}

        def make_model(self, seed: int) -> torch.nn.Module:
            torch.manual_seed(seed)
            return torch.nn.Sequential(...)

        def batches(self, shard: int, num_shards: int, seed: int):
            generator = torch.Generator().manual_seed(seed)
            while True:
                yield ...  # a batch drawn from shard `shard` of `num_shards`

        def loss(self, model, batch) -> torch.Tensor:
            return torch.nn.functional.mse_loss(model(batch[0]), batch[1])

        def batch_tokens(self, batch) -> int:
            return len(batch[0])

        def eval_batches(self, count: int) -> list:
            return [...]  # the same held-out batches on every peer, every call

    def make_task(config: dict, data=None) -> MyTask:
        return MyTask(config, data)

and host an experiment with it::

    shoal run --host-experiment NAME --task mytask.py:make_task [--data PATH]
    shoal run --host-experiment NAME --task mypackage.mytask:make_task --task-option hidden=128

(``--task-option KEY=VALUE`` entries become the factory's ``config``.)

``--task`` takes a built-in name (``bytegpt``, ``hf``), ``package.module:factory``
(an importable module: installed, or on PYTHONPATH) or
``path/to/file.py:factory`` (a relative path is resolved against the working
directory, the host's and each joiner's alike). Every peer that joins the
experiment loads the same spec with the host's ``config()``, so each of them
needs the same task code (and, for a task that reads ``--data``, data of its
own). The manifest pins a digest of the host's code (`shoal.peer.training.task_code`:
the file, or every .py file of the top-level package), and a joiner runs a
custom task only when it names it and its copy has that digest::

    shoal run --join NAME@PEERID --task mypackage.mytask:make_task [--data PATH]
    shoal run --join NAME@PEERID --allow-task mypackage.mytask:make_task
`examples/custom_task.py` in the repository is a complete example that reuses
the corpus helpers of `shoal.peer.training.tasks.corpus`.

The rules a task must keep:

- ``config()`` is msgpack-able (str keys; str, int, float, bool, None, lists,
  dicts) and holds *everything* another peer needs to build the same model and
  data format: it goes into the experiment's signed manifest, and a joiner's
  factory receives it back as ``config``. The factory fills in defaults for
  missing keys and should reject unknown keys with a `TaskError`.
- ``make_model(seed)`` is deterministic: the same seed gives bit-identical
  initial parameters (seed torch inside, or use a `torch.Generator`).
- ``batches(shard, num_shards, seed)`` is an endless iterator over this
  peer's shard only; the same arguments give the same batches.
- ``loss(model, batch)`` returns a scalar tensor: the *mean* loss of the batch,
  which the trainer backpropagates.
- ``batch_tokens(batch)`` counts the tokens (or samples) in a batch: the
  trainer reports tokens/s with it and weighs peers' contributions by it.
- ``eval_batches(count)`` returns the same held-out batches on every peer and
  every call, so validation losses of different peers can be compared.
- Devices: the trainer moves the model to the peer's device before training
  and hands ``loss`` batches already copied there (every tensor of a batch
  that is a tensor, list, tuple or dict); ``batches`` should yield CPU
  tensors (the trainer pins and copies them) and ``loss`` should not assume a
  device (use the model's, as ``bytegpt`` does). Forward passes run under
  autocast at the experiment's ``--precision``.
- Optional: ``private_data()`` says whether this peer trains on data of its
  own, which another peer cannot regenerate (a verified experiment's referees
  re-execute a prover's batches from their own task, so such an experiment is
  hosted unverified). Without it: exactly when the peer was given ``--data``.
  A task whose config pins the data by a digest its factory checks (every
  peer then holds the same bytes) returns False.
- Optional: ``flops_per_token()`` gives the training FLOPs per token
  (forward + backward), for the model FLOPs utilization (MFU) that /status
  reports; without it MFU is null.
- Optional, for pipelined experiments (a model split across peers, see
  `shoal.pipeline`): ``make_stages(seed, count)`` returns the model as
  `count` modules applied in turn (deterministic like ``make_model``; the
  first takes what ``stage_inputs(batch)`` gives, the last returns what
  ``stage_loss(outputs, batch)`` scores). ``bytegpt`` splits its blocks
  evenly, with the embeddings on the first stage and an untied output layer
  on the last. Better, ``make_stage(seed, count, k)`` builds stage `k`
  alone, equal to ``make_stages(seed, count)[k]`` (a peer then never builds
  the stages it does not serve; without it, the whole model is built and
  sliced), and ``stage_size(count, k)`` counts its parameter elements from
  the config, without building it (`shoal.pipeline.stage_build`).
- Mistakes of the user (bad config, missing or too little data) raise
  `TaskError` with a one-line message; the daemon shows it as is.
- The factory may take a while (reading data): the daemon calls `load_task`
  in a worker thread, not on its event loop.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable, Iterator
from functools import reduce
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import msgpack

from .task_code import is_file_target
from .task_error import TaskError

if TYPE_CHECKING:  # torch is imported by the tasks themselves, not by whoever imports this
    import torch

__all__ = [
    "BUILTIN_TASKS",
    "Task",
    "TaskError",
    "TaskFactory",
    "load_task",
    "shard_of",
    "trains_on_private_data",
]


@runtime_checkable
class Task(Protocol):
    """What the trainer trains: a model factory, a data iterator and a loss.

    See the module docstring for the rules each method keeps.
    """

    name: str
    """A short name for logs and the status page, e.g. ``"bytegpt"``."""

    def config(self) -> dict[str, Any]:
        """Everything another peer needs to build the same task (msgpack-able)."""
        ...

    def make_model(self, seed: int) -> torch.nn.Module:
        """A fresh model; the same seed gives bit-identical parameters."""
        ...

    def batches(self, shard: int, num_shards: int, seed: int) -> Iterator[Any]:
        """Endless training batches from shard `shard` of `num_shards`, determined by `seed`."""
        ...

    def loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        """The scalar mean loss of `model` on `batch`."""
        ...

    def batch_tokens(self, batch: Any) -> int:
        """The number of tokens (or samples) in `batch`."""
        ...

    def eval_batches(self, count: int) -> list[Any]:
        """`count` held-out validation batches, the same on every peer and every call."""
        ...


class TaskFactory(Protocol):
    """``factory(config)``, or ``factory(config, data=PATH)`` when the user gave ``--data``."""

    def __call__(self, config: dict[str, Any], /) -> Task: ...


def _make_bytegpt(config: dict[str, Any], data: Path | None = None) -> Task:
    # Imported on use: importing this module must not load torch (the daemon
    # imports it long before it trains, and `shoal id` never trains).
    from shoal.peer.training.tasks.bytegpt import make_task

    return make_task(config, data=data)


def _make_hf(config: dict[str, Any], data: Path | None = None) -> Task:
    # transformers is imported on use too: a shoal without the `hf` extra still runs.
    from shoal.peer.training.tasks.hf import make_task

    return make_task(config, data=data)


BUILTIN_TASKS: dict[str, Callable[..., Task]] = {"bytegpt": _make_bytegpt, "hf": _make_hf}

_SPEC_FORMS = "a built-in name, package.module:factory or path/to/file.py:factory"


def load_task(spec: str, config: dict[str, Any] | None = None, *, data: Path | None = None) -> Task:
    """The task named by `spec`, built with `config` (and the user's `data` path).

    spec: a built-in name (``"bytegpt"``), ``"package.module:factory"`` or
    ``"path/to/file.py:factory"``. The factory gets `config` (overrides of its
    defaults; when joining, the host's ``config()`` from the manifest) and, if
    `data` is given, ``data=data`` (the user's ``--data``: a file or a folder).
    Raises `TaskError` for every user mistake. Blocking (reads data): call it
    from a worker thread in async code.
    """
    factory = _resolve_factory(spec)
    if data is not None:
        if not data.exists():
            raise TaskError(f"--data {data}: no such file or directory")
        if not _accepts_data(factory):
            raise TaskError(
                f"task {spec!r} does not read --data (its factory has no `data` argument)"
            )
    try:
        task = (
            factory(dict(config or {})) if data is None else factory(dict(config or {}), data=data)
        )
    except TaskError:
        raise
    except Exception as exc:  # the user's code: one line here, the traceback stays chained
        raise TaskError(f"task {spec!r} failed to build: {type(exc).__name__}: {exc}") from exc
    _check_task(spec, task)
    return task


def shard_of(peer_id_bytes: bytes, num_shards: int) -> int:
    """The data shard of a peer: a hash of its ID, so any peer can compute anyone's shard."""
    if num_shards < 1:
        raise ValueError(f"num_shards must be at least 1, got {num_shards}")
    digest = hashlib.sha256(b"shoal/data-shard\0" + peer_id_bytes).digest()
    return int.from_bytes(digest[:8], "big") % num_shards


def trains_on_private_data(task: Task, data: Path | None) -> bool:
    """Whether this peer's batches come from data only it has (see ``private_data``)."""
    private = getattr(task, "private_data", None)
    if callable(private):
        return bool(private())
    return data is not None


def _resolve_factory(spec: str) -> Callable[..., Task]:
    target, colon, attribute = spec.rpartition(":")
    if not colon:
        if spec in BUILTIN_TASKS:
            return BUILTIN_TASKS[spec]
        builtins = ", ".join(sorted(BUILTIN_TASKS))
        raise TaskError(
            f"unknown task {spec!r}: built-in tasks are {builtins}; "
            "or give module:function or path/to/file.py:function"
        )
    if not target or not all(part.isidentifier() for part in attribute.split(".")):
        raise TaskError(f"bad task spec {spec!r}: expected {_SPEC_FORMS}")
    if is_file_target(target):
        module = _import_file(Path(target), spec)
    else:
        module = _import_module(target, spec)
    try:
        factory = reduce(getattr, attribute.split("."), module)
    except AttributeError:
        raise TaskError(f"task {spec!r}: {target} has no {attribute!r}") from None
    if not callable(factory):
        raise TaskError(f"task {spec!r}: {attribute!r} in {target} is not a function")
    return factory


def _import_module(name: str, spec: str) -> Any:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name and (name == exc.name or name.startswith(exc.name + ".")):
            raise TaskError(
                f"task {spec!r}: no module named {exc.name!r} "
                "(install it or add it to PYTHONPATH; a file is given as path/to/file.py:function)"
            ) from None
        raise TaskError(f"task {spec!r}: importing {name} failed: {exc}") from exc
    except Exception as exc:
        raise TaskError(
            f"task {spec!r}: importing {name} failed: {type(exc).__name__}: {exc}"
        ) from exc


def _import_file(path: Path, spec: str) -> Any:
    if not path.is_file():
        raise TaskError(f"task {spec!r}: no such file {path}")
    # A name of its own per file, registered in sys.modules while it runs, as a
    # normal import would be (dataclasses and pickle look the module up there).
    resolved = path.resolve()
    digest = hashlib.sha256(str(resolved).encode()).hexdigest()[:12]
    module_name = f"shoal_task_{digest}_{path.stem}"
    module_spec = importlib.util.spec_from_file_location(module_name, resolved)
    if module_spec is None or module_spec.loader is None:
        raise TaskError(f"task {spec!r}: cannot load {path} as Python")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[module_name]
        raise TaskError(
            f"task {spec!r}: running {path} failed: {type(exc).__name__}: {exc}"
        ) from exc
    return module


def _accepts_data(factory: Callable[..., Task]) -> bool:
    try:
        parameters = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):  # no introspectable signature: let the call decide
        return True
    return any(
        p.kind is inspect.Parameter.VAR_KEYWORD
        or (p.name == "data" and p.kind is not inspect.Parameter.POSITIONAL_ONLY)
        for p in parameters
    )


def _check_task(spec: str, task: object) -> None:
    missing = [m for m in _TASK_MEMBERS if not hasattr(task, m)]
    if missing:
        raise TaskError(
            f"task {spec!r}: the factory returned a {type(task).__name__} "
            f"without {', '.join(missing)} (see shoal.peer.training.task.Task)"
        )
    config = task.config()  # type: ignore[attr-defined]
    if not isinstance(config, dict):
        raise TaskError(f"task {spec!r}: config() returned a {type(config).__name__}, not a dict")
    try:
        msgpack.packb(config, strict_types=False)
    except (TypeError, ValueError, OverflowError) as exc:
        raise TaskError(f"task {spec!r}: config() is not msgpack-able: {exc}") from None


_TASK_MEMBERS = (
    "name",
    "config",
    "make_model",
    "batches",
    "loss",
    "batch_tokens",
    "eval_batches",
)
