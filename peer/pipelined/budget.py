"""A peer's memory budget (`--max-memory`) and what each pipeline stage would cost it.

The estimate of each stage (`pipeline.memory.stage_memory`) comes from the
task's stage sizes (`stage_build.stage_size`: nothing built) and the stages'
bounds; a peer chooses, and moves into, only stages whose estimate fits its
budget. Without `--max-memory` the budget is what the machine has free when the
peer starts (`MemAvailable`, or what is left of a container's cgroup memory
limit when less), plus the device's free memory on a GPU (the parameters,
gradients and moments then live there). A stage that fits only leanly is served
leanly (`StageBudget.limits`, `memory.fit_stage`): fewer answers kept for retries,
then backwards that wait while a step averages, then AdamW's moments in a file of
the data directory, then passes of fewer samples, so that what the stage keeps stays
within the budget.

The records of other peers play no part in what fits: a peer that claims a huge
capacity for some stage can make the others look emptier, never make a stage
that does not fit look as if it did.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from shoal.pipeline.bounds import StageBounds
from shoal.pipeline.directory import StageRecord, least_capacity_stage
from shoal.pipeline.memory import (
    StageLimits,
    StageMemory,
    fit_stage,
    stages_that_fit,
    trainer_memory,
)
from shoal.pipeline.sizes import format_size
from shoal.pipeline.stage_build import stage_size
from shoal.transport.identity import PeerID
from shoal.transport.mux import DEFAULT_MAX_WINDOW

__all__ = ["NoStageFits", "StageBudget", "available_memory", "cgroup_memory_free"]

log = logging.getLogger("shoal.pipeline")

MIN_GROUP = 2  # the receive slots of a stage's all-reduce: at least one other member


class NoStageFits(ValueError):
    """No stage of the experiment fits this peer's memory budget (or, for a trainer,
    its own microbatches do not)."""


def available_memory(
    device: torch.device,
    meminfo: Path = Path("/proc/meminfo"),
    cgroups: tuple[Path, Path] = (Path("/proc/self/cgroup"), Path("/sys/fs/cgroup")),
) -> int | None:
    """What the machine (and the device, on a GPU) has free now; None when unknown.
    In a container (a cgroup with a memory limit: `docker run --memory`, compose's
    `mem_limit`) the machine's MemAvailable is the host's: what is left of the
    limit counts when it is less."""
    free: int | None = None
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                free = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        free = None
    limited = cgroup_memory_free(*cgroups)
    if limited is not None:
        free = limited if free is None else min(free, limited)
    if device.type == "cuda" and torch.cuda.is_available():
        device_free, _ = torch.cuda.mem_get_info(device)
        free = (free or 0) + int(device_free)
    return free


# A cgroup limit at least this large is no limit (v1 writes "no limit" as ~2^63).
_NO_LIMIT = 1 << 60


def cgroup_memory_free(proc_cgroup: Path, root: Path) -> int | None:
    """What is left of the memory limits of our cgroup and its ancestors (the least),
    cgroup v2 (`memory.max`, `memory.current`) or v1 (`memory.limit_in_bytes`,
    `memory.usage_in_bytes`); None when there is no limit or no cgroup to read."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    places: list[tuple[Path, str, str]] = []
    for line in lines:
        hierarchy, controllers, path = [*line.split(":", 2), "", ""][:3]
        relative = path.strip().lstrip("/")
        if hierarchy == "0" and controllers == "":
            places.append((root, relative, "v2"))
        elif "memory" in controllers.split(","):
            places.append((root / "memory", relative, "v1"))
    least: int | None = None
    for mount, relative, version in places:
        here = mount / relative
        if not here.is_dir():
            here = mount  # (a cgroup namespace: our cgroup is its root)
        for directory in [here, *here.parents]:
            left = _left_in(directory, version)
            if left is not None:
                least = left if least is None else min(least, left)
            if directory == mount:
                break
    return least


def _left_in(directory: Path, version: str) -> int | None:
    names = ("memory.max", "memory.current") if version == "v2" else (
        "memory.limit_in_bytes", "memory.usage_in_bytes")  # fmt: skip
    try:
        limit_text = (directory / names[0]).read_text().strip()
        if limit_text == "max":
            return None
        limit, used = int(limit_text), int((directory / names[1]).read_text().strip())
    except (OSError, ValueError):
        return None
    return None if limit >= _NO_LIMIT else max(0, limit - used)


def _stage_sizes(task: Any, seed: int, count: int) -> list[int]:
    """Each stage's parameter elements: the task's cheap `stage_size` when it has one,
    else counted on the meta device (shapes only: nothing allocated)."""
    if callable(getattr(task, "stage_size", None)):
        return [stage_size(task, seed, count, k) for k in range(count)]
    with torch.device("meta"):
        modules = task.make_stages(seed, count)
    return [sum(p.numel() for p in m.parameters()) for m in modules]


class StageBudget:
    """What each stage costs this peer, against its budget (None: no limit known)."""

    def __init__(
        self,
        task: Any,
        seed: int,
        bounds: Sequence[StageBounds],
        *,
        budget: int | None,
        in_flight: int,
        trainer: bool = False,
        audits: bool = False,
        on_device: bool = False,
        copies_on_disk: bool = False,
        window: int = DEFAULT_MAX_WINDOW,
    ) -> None:
        """`trainer`: we also drive microbatches (role auto): what our own trainer keeps
        in flight comes off the budget before a stage's cost; `audits`: the experiment
        verifies its stages (a stage peer keeps its answers for audits); `on_device`:
        our stage would live on a device (a GPU), not in host memory; `copies_on_disk`:
        the state's transient copies go to a folder; `window`: our connections'
        receive window (`memory.stage_memory`)."""
        self.audits = audits
        self.on_device = on_device
        self.copies_on_disk = copies_on_disk
        self.window = window
        self.budget = budget
        self.bounds = list(bounds)
        self.in_flight = in_flight
        count = len(self.bounds)
        self.sizes = _stage_sizes(task, seed, count)
        self.groups = [MIN_GROUP] * count
        self.reserved = trainer_memory(self.bounds, in_flight) if trainer else 0

    def cost(self, k: int) -> StageMemory:
        """What serving stage `k` costs, with the limits it would be served with."""
        return self._fitted(k)[0]

    def limits(self, k: int) -> StageLimits:
        """How we would serve stage `k` within our budget (less what our trainer keeps):
        the samples a pass takes, the answers kept (`memory.fit_stage`)."""
        return self._fitted(k)[1]

    def _fitted(self, k: int) -> tuple[StageMemory, StageLimits]:
        room = None if self.budget is None else self.budget - self.reserved
        return fit_stage(self.sizes[k], self.bounds[k], budget=room, in_flight=self.in_flight,
                         group_size=self.groups[k], audits=self.audits,
                         on_device=self.on_device,
                         copies_on_disk=self.copies_on_disk, window=self.window)  # fmt: skip

    def see_peers(self, peers: Sequence[int]) -> None:
        """Each stage's other peers, as the records show them: with us, the stage's
        all-reduce group (a liar's records can make a stage look dearer, never cheaper)."""
        self.groups = [max(MIN_GROUP, n + 1) for n in peers]

    def costs(self) -> list[int]:
        return [self.cost(k).total for k in range(len(self.sizes))]

    def fitting(self) -> list[int]:
        """The stages within the budget (every stage without one)."""
        costs = self.costs()
        if self.budget is None:
            return list(range(len(costs)))
        return stages_that_fit(costs, self.budget - self.reserved)

    def refusal(self) -> str:
        """The one line a peer that can serve no stage says."""
        assert self.budget is not None
        smallest = min(range(len(self.sizes)), key=lambda k: self.cost(k).total)
        trainer = f" plus {format_size(self.reserved)} for our trainer" if self.reserved else ""
        return (
            f"no stage fits --max-memory {format_size(self.budget)}: the smallest, stage "
            f"{smallest}, needs {format_size(self.cost(smallest).total)}{trainer} (parameters, "
            "gradients, AdamW moments, averaging buffers, activations)"
        )

    def check_trainer(self) -> None:
        """Refuse (NoStageFits) when our own microbatches in flight exceed the budget."""
        need = trainer_memory(self.bounds, self.in_flight)
        if self.budget is not None and need > self.budget:
            raise NoStageFits(
                f"a trainer's microbatches in flight need {format_size(need)}, more than "
                f"--max-memory {format_size(self.budget)}"
            )

    def fitting_for(self, records: Sequence[Sequence[StageRecord]], me: PeerID) -> list[int]:
        """The stages that fit, with the all-reduce groups the records show."""
        self.see_peers([sum(r.peer != me for r in stage) for stage in records])
        return self.fitting()

    def choose(
        self,
        records: Sequence[Sequence[StageRecord]],
        me: PeerID,
        wanted: int | None,
        preferred: int | None = None,
    ) -> int:
        """`wanted` (`--stage`), else `preferred` if it fits, else the least-capacity
        stage among those that fit; one that does not fit is refused (NoStageFits)."""
        fitting = self.fitting_for(records, me)
        if wanted is not None and wanted not in fitting:
            cost = self.cost(wanted).total + self.reserved
            raise NoStageFits(f"stage {wanted} needs {format_size(cost)}, more than "
                              f"--max-memory {format_size(self.budget or 0)}")  # fmt: skip
        if not fitting:
            raise NoStageFits(self.refusal())
        if wanted is not None:
            return wanted
        if preferred in fitting:
            return preferred
        return least_capacity_stage(list(map(list, records)), allowed=fitting)
