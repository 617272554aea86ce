"""A test task: the built-in bytegpt, recording every stage a process builds for real.

Each `make_stage` (and `make_stages`) whose parameters are not on the meta device
(shapes only, nothing allocated: the bounds' probe) appends "PID STAGE" (or "PID
all") to the file named by $SHOAL_TEST_BUILD_LOG, so a test of `shoal run`
processes can check that each one built only the stage it serves.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from torch import nn

from shoal.peer.training.tasks.bytegpt import ByteGPTTask
from shoal.peer.training.tasks.bytegpt import make_task as make_bytegpt

LOG_ENV = "SHOAL_TEST_BUILD_LOG"


def _record(what: str, modules: list[nn.Module]) -> None:
    path = os.environ.get(LOG_ENV)
    real = any(p.device.type != "meta" for m in modules for p in m.parameters())
    if path and real:
        with open(path, "a") as log:  # (one short line: appends do not interleave)
            log.write(f"{os.getpid()} {what}\n")


class CountingTask(ByteGPTTask):
    def make_stage(self, seed: int, count: int, k: int) -> nn.Module:
        module = super().make_stage(seed, count, k)
        _record(str(k), [module])
        return module

    def make_stages(self, seed: int, count: int) -> list[nn.Module]:
        # (bytegpt's make_stages builds each with make_stage: those are recorded too.)
        modules = super().make_stages(seed, count)
        _record("all", modules)
        return modules


def make_task(config: dict[str, Any], data: Path | None = None) -> CountingTask:
    task = make_bytegpt(config, data)
    return CountingTask(task.settings, task.corpus)
