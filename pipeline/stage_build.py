"""Building one stage of a task's pipelined model, and what it costs, without the others.

A task may offer ``make_stage(seed, count, k)`` (stage `k` of `count`, built
without building the others) and ``stage_size(count, k)`` (its parameter
elements, from the config, cheap: nothing built). A task that only has
``make_stages(seed, count)`` still works: the whole model is built once and
sliced, and its size is counted from the slice.

Every stage a peer builds for real goes through `build_stage`; `stage_fingerprints`
hashes a pipeline's initial stages one at a time (build, hash, free), so that the
host writing a manifest never holds two stages at once. Builds on PyTorch's meta
device (`pipeline.bounds`' shape probe) allocate and initialize nothing and are
not counted as builds.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from shoal.averaging.fingerprint import state_fingerprint

__all__ = [
    "build_stage",
    "builds_stages_alone",
    "stage_fingerprint",
    "stage_fingerprints",
    "stage_size",
]


def builds_stages_alone(task: Any) -> bool:
    """Whether the task builds one stage without building the others."""
    return callable(getattr(task, "make_stage", None))


def build_stage(task: Any, seed: int, count: int, k: int) -> nn.Module:
    """Stage `k` of `count` of the task's model from `seed` (deterministic)."""
    if not 0 <= k < count:
        raise ValueError(f"stage {k} of {count}: stages are 0 to {count - 1}")
    if builds_stages_alone(task):
        return task.make_stage(seed, count, k)
    modules = task.make_stages(seed, count)
    module = modules[k]
    del modules
    return module


def stage_size(task: Any, seed: int, count: int, k: int) -> int:
    """Parameter elements of stage `k` of `count` (the task's `stage_size` when it has
    one, else counted from the built stage)."""
    sizer = getattr(task, "stage_size", None)
    if callable(sizer):
        return int(sizer(count, k))
    module = build_stage(task, seed, count, k)
    return sum(p.numel() for p in module.parameters())


def stage_fingerprint(module: nn.Module) -> str:
    """The fingerprint of a stage's parameters (in order; hashed from the host)."""
    return state_fingerprint([p.detach() for p in module.parameters()], {})


def stage_fingerprints(task: Any, seed: int, count: int) -> list[str]:
    """The initial fingerprint of each of the `count` stages, built one at a time and
    freed once hashed (a task with only `make_stages`: built once, all together)."""
    if not builds_stages_alone(task):
        return [stage_fingerprint(m) for m in task.make_stages(seed, count)]
    fingerprints = []
    for k in range(count):
        module = task.make_stage(seed, count, k)
        fingerprints.append(stage_fingerprint(module))
        del module  # (before the next is built: never two at once)
    return fingerprints
