"""Each test's wall time and CPU time, for balancing the suite across cores.

With `SHOAL_TEST_CPU_LOG=FILE` set, every test appends one JSON line to FILE:
its node id, its wall seconds (setup, call and teardown) and the CPU seconds of
the test process and of the processes it started and reaped (daemons, lab
peers; not containers, whose processes podman reaps). A test whose CPU is
far below its wall time waits on timers and links, and can share a core with a
busy one; `--durations` alone cannot tell the two kinds apart.

`python tests/cpu_report.py FILE [N]` sums FILE up: wall and CPU seconds per
xdist worker and per group, then the N longest tests of each group with the
cores they kept busy on average.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from collections import defaultdict
from collections.abc import Generator, Iterable
from typing import Any

import pytest

LOG_ENV = "SHOAL_TEST_CPU_LOG"


def _cpu_s() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    forked = sys.modules.get("prefork")  # (its children are the fork server's to reap)
    forked_s = forked.reaped_cpu_s() if forked is not None else 0.0
    return own.ru_utime + own.ru_stime + reaped.ru_utime + reaped.ru_stime + forked_s


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


def summary(lines: Iterable[str], longest: int = 10) -> str:
    """FILE's lines summed up (see the module doc)."""
    rows = [json.loads(line) for line in lines if line.strip()]
    out: list[str] = []
    for title, key in (("worker", lambda r: r["worker"] or "-"), ("group", _group)):
        totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
        for r in rows:
            t = totals[key(r)]
            t[0], t[1], t[2] = t[0] + r["wall_s"], t[1] + r["cpu_s"], t[2] + 1
        for name, (wall, cpu, n) in sorted(totals.items()):
            out.append(f"{title} {name}: {n:.0f} tests, wall {wall:.0f} s, cpu {cpu:.0f} s")
    for group in sorted({_group(r) for r in rows}):
        out.append(f"longest in group {group} (wall s, cpu s, cores):")
        mine = sorted((r for r in rows if _group(r) == group), key=lambda r: -r["wall_s"])
        for r in mine[:longest]:
            cores = r["cpu_s"] / r["wall_s"] if r["wall_s"] else 0.0
            name = r["test"].rpartition("@")[0] or r["test"]
            out.append(f"  {r['wall_s']:7.1f} {r['cpu_s']:7.1f} {cores:5.2f}  {name}")
    return "\n".join(out)


def _group(row: dict[str, Any]) -> str:
    test = row["test"]
    return test.rpartition("@")[2] if "@" in test.rpartition("]")[2] else "(none)"


if __name__ == "__main__":
    with open(sys.argv[1], encoding="utf-8") as log:
        print(summary(log, int(sys.argv[2]) if len(sys.argv) > 2 else 10))
