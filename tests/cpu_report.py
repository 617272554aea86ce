"""Each test's wall time and CPU time, for balancing the suite across cores.

With `SHOAL_TEST_CPU_LOG=FILE` set, every test appends one JSON line to FILE:
its node id, its wall seconds (setup, call and teardown) and the CPU seconds of
the test process and of the processes it started and reaped (daemons, lab
peers; not containers, whose processes podman reaps). A test whose CPU is
far below its wall time waits on timers and links, and can share a core with a
busy one; `--durations` alone cannot tell the two kinds apart.
"""

from __future__ import annotations

import json
import os
import resource
import time
from collections.abc import Generator
from typing import Any

import pytest

LOG_ENV = "SHOAL_TEST_CPU_LOG"


def _cpu_s() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + reaped.ru_utime + reaped.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: Any) -> Generator[None, None, None]:
    path = os.environ.get(LOG_ENV)
    if not path:
        yield
        return
    wall, cpu = time.perf_counter(), _cpu_s()
    yield
    line = {
        "test": item.nodeid,
        "wall_s": round(time.perf_counter() - wall, 2),
        "cpu_s": round(_cpu_s() - cpu, 2),
        "worker": os.environ.get("PYTEST_XDIST_WORKER", ""),
    }
    with open(path, "a", encoding="utf-8") as out:
        out.write(json.dumps(line) + "\n")
