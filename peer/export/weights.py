"""Checkpoints others can load: the swarm's global parameters as safetensors or Hugging Face
`save_pretrained` output (`shoal export`), and such weights as a new experiment's start
(`shoal run --init-from`).

What is exported is the outer strategy's *global* parameters of the data directory's
latest checkpoint: the swarm's last committed average (DiLoCo's and Streaming DiLoCo's
globals, NoLoCo's outer parameters), not this peer's inner parameters, which hold its
own steps since that commit. Buffers (which no strategy averages) are the checkpoint's.
The checkpoint is as fresh as the daemon's last save (every --checkpoint-interval, and
at shutdown). Nothing here reads from a hub: the model is rebuilt from the experiment's
manifest (for `hf`: its pinned transformers config and tokenizer).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shoal.averaging.diloco import split_fragments
from shoal.averaging.fingerprint import state_fingerprint

from ..experiment import Manifest, ManifestError
from ..training.checkpoint import CheckpointError, CheckpointStore
from ..training.task import Task, TaskError, load_task
from ..training.task_code import check_digest

__all__ = [
    "EXPERIMENT_FILE",
    "EXPORT_FORMATS",
    "WEIGHTS_FILE",
    "ExportError",
    "SavedExperiment",
    "export_checkpoint",
    "find_saved_experiment",
    "load_initial_weights",
]

EXPORT_FORMATS = ("safetensors", "hf")
WEIGHTS_FILE = "model.safetensors"  # the name `save_pretrained` writes too
EXPERIMENT_FILE = "shoal_experiment.json"
TOKENIZER_FILE = "tokenizer.json"
MANIFESTS_DIR = "experiments"  # (as session.py keeps them)


class ExportError(Exception):
    """The export (or --init-from) cannot be done; the message is one line for the user."""


@dataclass
class SavedExperiment:
    manifest: Manifest
    checkpoint: dict[str, Any]
    directory: Path  # of its checkpoints


def find_saved_experiment(data_dir: Path, name: str | None = None) -> SavedExperiment:
    """The experiment of `data_dir` (the one named `name`, needed when there are several)
    with its latest checkpoint. Raises ExportError."""
    found: dict[str, Manifest] = {}
    for path in sorted((data_dir / MANIFESTS_DIR).glob("**/*.manifest")):
        try:
            manifest = Manifest.from_bytes(path.read_bytes())  # (signed: checked here)
        except (OSError, ManifestError):
            continue
        named = name is None or manifest.name == name
        if named and (data_dir / "checkpoints" / manifest.experiment_id).is_dir():
            found[manifest.experiment_id] = manifest
    what = f"experiment {name!r}" if name else "any experiment"
    if not found:
        raise ExportError(f"no checkpoint of {what} in {data_dir}: run it there first")
    if len(found) > 1:
        names = ", ".join(sorted(f"{m.name} ({m.experiment_id[:12]})" for m in found.values()))
        raise ExportError(f"{data_dir} holds several experiments ({names}): name one")
    manifest = next(iter(found.values()))
    store = CheckpointStore(data_dir / "checkpoints" / manifest.experiment_id)
    try:
        checkpoint = store.load()
    except CheckpointError as e:
        raise ExportError(str(e)) from None
    if checkpoint is None or checkpoint.get("experiment_id") != manifest.experiment_id:
        raise ExportError(f"no checkpoint of {manifest.describe()} in {store.directory}")
    return SavedExperiment(manifest, checkpoint, store.directory)


def global_parameters(checkpoint: dict[str, Any], sizes: list[int]) -> list[torch.Tensor]:
    """The strategy's global parameters in the model's parameter order (`sizes`: their
    element counts, which place Streaming DiLoCo's fragments). Raises ExportError."""
    strategy = checkpoint.get("strategy")
    if not isinstance(strategy, dict):
        raise ExportError("the checkpoint holds no outer strategy state (a pipeline stage?)")
    if isinstance(strategy.get("globals"), list):  # DiLoCo
        tensors = list(strategy["globals"])
    elif isinstance(strategy.get("outer"), list):  # NoLoCo
        tensors = list(strategy["outer"])
    elif isinstance(strategy.get("fragments"), list):  # Streaming DiLoCo
        fragments = strategy["fragments"]
        placed: list[torch.Tensor | None] = [None] * len(sizes)
        try:
            for indices, frag in zip(
                split_fragments(sizes, len(fragments)), fragments, strict=True
            ):
                for i, tensor in zip(indices, frag["globals"], strict=True):
                    placed[i] = tensor
        except (ValueError, KeyError, TypeError):
            raise ExportError("the checkpoint's fragments do not fit the model") from None
        tensors = [t for t in placed if t is not None]
    else:
        raise ExportError(f"cannot export a checkpoint of strategy {strategy.get('strategy')!r}")
    if len(tensors) != len(sizes) or not all(isinstance(t, torch.Tensor) for t in tensors):
        raise ExportError("the checkpoint's global parameters do not fit the model")
    return tensors


def export_checkpoint(
    data_dir: Path,
    out: Path,
    *,
    format: str = "safetensors",
    experiment: str | None = None,
    data: Path | None = None,
) -> SavedExperiment:
    """Write the swarm's global parameters of `data_dir`'s experiment to folder `out`:
    `format` "safetensors" (any task: model.safetensors, and the experiment in
    shoal_experiment.json) or "hf" (the hf task: `save_pretrained` output, config.json
    and model.safetensors, with tokenizer.json). `data`: the experiment's --data, for a
    task that reads it to build its model (not `hf`). Raises ExportError."""
    if format not in EXPORT_FORMATS:
        raise ExportError(f"unknown format {format!r}; choose one of {', '.join(EXPORT_FORMATS)}")
    saved = find_saved_experiment(data_dir, experiment)
    manifest = saved.manifest
    if format == "hf" and manifest.task != "hf":
        raise ExportError(
            f"--format hf is for experiments of task hf; {manifest.describe()} is of task "
            f"{manifest.task}: use --format safetensors"
        )
    task = _task_of(manifest, data)
    model = task.make_model(manifest.seed)
    params = [p for _, p in model.named_parameters()]
    globals_ = global_parameters(saved.checkpoint, [p.numel() for p in params])
    try:
        model.load_state_dict(saved.checkpoint["model"])  # the buffers
        _copy_checked(params, globals_)
    except (RuntimeError, KeyError, ValueError) as e:
        raise ExportError(f"the checkpoint does not fit the task's model ({e})") from None
    _write(out, model, task, saved, format)
    return saved


def _task_of(manifest: Manifest, data: Path | None) -> Task:
    try:
        if manifest.task == "hf":
            from ..training.tasks.hf import offline_task

            return offline_task(manifest.task_config)
        check_digest(manifest.task, manifest.task_digest)
        return load_task(manifest.task, manifest.task_config, data=data)
    except TaskError as e:
        raise ExportError(str(e)) from None


def _copy_checked(params: list[nn.Parameter], values: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for p, v in zip(params, values, strict=True):
            if p.shape != v.shape:
                raise ValueError(f"a global parameter of shape {tuple(v.shape)} for {p.shape}")
            p.copy_(v)


def _write(out: Path, model: nn.Module, task: Task, saved: SavedExperiment, format: str) -> None:
    save_model = _safetensors().save_model
    manifest = saved.manifest
    try:
        out.mkdir(parents=True, exist_ok=True)
        if format == "hf":
            model.save_pretrained(out, safe_serialization=True)  # type: ignore[operator]
            task.tokenizer.save(str(out / TOKENIZER_FILE))  # type: ignore[attr-defined]
        else:
            save_model(model, str(out / WEIGHTS_FILE))
        strategy = saved.checkpoint["strategy"]
        about = {
            "experiment": manifest.name,
            "experiment_id": manifest.experiment_id,
            "host": str(manifest.host),
            "task": manifest.task,
            "task_config": manifest.task_config,
            "strategy": manifest.strategy,
            "hyperparameters": manifest.hyperparameters,
            "seed": manifest.seed,
            "step": saved.checkpoint.get("step"),
            "outer_step": strategy.get("commits", strategy.get("outer_steps")),
            # Of the exported parameters, as the initial fingerprint of an experiment
            # hosted with --init-from this folder reads.
            "fingerprint": state_fingerprint([p.detach() for p in model.parameters()], {}),
        }
        (out / EXPERIMENT_FILE).write_text(json.dumps(about, indent=2, default=str) + "\n")
    except OSError as e:
        raise ExportError(f"cannot write to {out}: {e.strerror or e}") from None


def load_initial_weights(model: nn.Module, directory: Path) -> None:
    """Load `directory`'s model.safetensors into `model` (fresh from the task), refusing
    in one line unless every parameter is there with its exact shape and dtype and
    every tensor of the file is a parameter or buffer of the model. A weight shared by
    two names (tied embeddings) may be stored under either. Raises ExportError."""
    path = directory / WEIGHTS_FILE
    try:
        tensors = _safetensors().load_file(str(path))
    except Exception as e:  # safetensors raises its own errors for a damaged file
        raise ExportError(f"cannot read {path}: {e}") from None
    state = model.state_dict(keep_vars=True)
    unknown = sorted(set(tensors) - set(state))
    if unknown:
        raise ExportError(f"{path} holds {unknown[0]!r}, which the task's model has not")
    for name, value in tensors.items():
        have = state[name]
        if have.shape != value.shape or have.dtype != value.dtype:
            raise ExportError(
                f"{path}: {name} is {value.dtype} {tuple(value.shape)}, the task's model "
                f"wants {have.dtype} {tuple(have.shape)}"
            )
    aliases: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    for names in aliases.values():
        if not any(n in tensors for n in names):
            raise ExportError(f"{path} lacks {names[0]!r}, a parameter of the task's model")
    with torch.no_grad():
        for name, value in tensors.items():
            state[name].copy_(value)
    if not all(math.isfinite(float(p.detach().abs().sum())) for p in model.parameters()):
        raise ExportError(f"{path} holds non-finite weights")


def _safetensors() -> Any:
    try:
        import safetensors.torch
    except ImportError:
        raise ExportError(
            "exported weights need safetensors: pip install 'shoal[hf]' (or safetensors)"
        ) from None
    return safetensors.torch
