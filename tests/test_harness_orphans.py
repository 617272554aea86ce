"""The test harness's children die with the test run: a run that pytest-timeout ends
with os._exit (no cleanup) must not leave daemons training on and slowing every
test after it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

PARENT = """
import subprocess, sys
sys.path.insert(0, {tests!r})
from daemon_harness import die_with_parent
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         preexec_fn={preexec})
print(child.pid, flush=True)
import os; os._exit(0)
"""


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"  # (a zombie is dead)
    except FileNotFoundError:
        return False


@pytest.mark.timeout(30)
def test_a_child_started_by_the_harness_dies_when_its_parent_dies_without_cleanup() -> None:
    assert orphan_survives("None"), "without the harness's hook an orphan lives on"
    assert not orphan_survives("die_with_parent")


def orphan_survives(preexec: str) -> bool:
    """Whether a child outlives (by 10 s at most) its parent's os._exit."""
    code = PARENT.format(tests=str(Path(__file__).parent), preexec=preexec)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    child = int(out.stdout.split()[0])
    deadline = time.monotonic() + (10 if preexec != "None" else 1)
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    survived = alive(child)
    if survived:
        os.kill(child, 9)
    return survived
