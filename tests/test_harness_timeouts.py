"""A test past its timeout fails with its stacks, and the run goes on (tests/timeouts.py).

Each case runs a small pytest session of its own, with this project's options (two
xdist workers, loadgroup, no worker restarts), in a subprocess: the thing under test
is what a whole run does when one of its tests hangs.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
from daemon_harness import SlowWait, wait_for

TESTS = Path(__file__).parent

CONFTEST = f"""
import sys
sys.path.insert(0, {str(TESTS)!r})
import uvloop
from timeouts import pytest_timeout_cancel_timer, pytest_timeout_set_timer, tracked

def pytest_asyncio_loop_factories(config, item):
    return {{"uvloop": tracked(uvloop.new_event_loop)}}
"""

HANGS = """
import asyncio, time, pytest

GROUP = pytest.mark.xdist_group("one-at-a-time")

@pytest.mark.parametrize("n", range(8))
def test_quick(n):
    time.sleep(0.2)

@GROUP
@pytest.mark.parametrize("n", range(4))
def test_quick_in_the_group(n):
    time.sleep(0.2)

@GROUP
@pytest.mark.timeout(2)
async def test_waits_forever_on_an_event():
    await asyncio.Event().wait()

@GROUP
@pytest.mark.timeout(2)
def test_loops_forever():
    while True:
        time.sleep(0.05)
"""

IGNORES_INTERRUPTION = """
import time, pytest

@pytest.mark.timeout(2)
def test_swallows_every_interruption():
    while True:
        try:
            time.sleep(0.05)
        except Exception:
            pass

@pytest.mark.parametrize("n", range(4))
def test_quick(n):
    time.sleep(0.2)
"""


def run_session(tmp_path: Path, tests: str, grace_s: float) -> tuple[str, float]:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_cases.py").write_text(tests)
    (tmp_path / "pytest.ini").write_text(
        "[pytest]\nasyncio_mode = auto\nasyncio_default_fixture_loop_scope = function\n"
        "timeout = 60\ntimeout_method = thread\n"
    )
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        "-n",
        "2",
        "--dist",
        "loadgroup",
        "--max-worker-restart",
        "0",
        "-rA",
        str(tmp_path),
    ]
    started = time.monotonic()
    out = subprocess.run(
        command,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
        env={**os.environ, "SHOAL_TEST_TIMEOUT_GRACE_S": str(grace_s)},
    )
    return out.stdout + out.stderr, time.monotonic() - started


@pytest.mark.timeout(100)
def test_hung_tests_fail_with_where_they_hung_and_every_other_test_runs(tmp_path: Path) -> None:
    output, _ = run_session(tmp_path, HANGS, grace_s=30)
    assert "2 failed, 12 passed" in output, output
    assert "crashed" not in output, output
    # The async test: cancelled where it waited, its tasks' stacks in its stderr.
    # (xdist adds "@one-at-a-time" to the test's id)
    assert re.search(r"test_waits_forever_on_an_event\S* timed out after 2 s", output)
    assert "CancelledError" in output
    assert "await asyncio.Event().wait()" in output
    # The synchronous one: TimedOut raised in its loop.
    assert "TimedOut: the test ran past its timeout" in output
    assert "time.sleep(0.05)" in output


@pytest.mark.timeout(100)
def test_a_test_that_ignores_its_interruption_ends_the_run_with_its_stacks(tmp_path: Path) -> None:
    output, seconds = run_session(tmp_path, IGNORES_INTERRUPTION, grace_s=2)
    assert "test_swallows_every_interruption still runs 2 s after its 2 s timeout" in output
    assert "in test_swallows_every_interruption" in output  # its stack, on the real stderr
    assert "crashed and worker restarting disabled" in output, output
    assert seconds < 60, f"the run must end, not wait for CI's limit ({seconds:.0f} s)"


@pytest.mark.timeout(10)
def test_a_wait_that_takes_more_than_half_its_timeout_says_so_in_a_passing_run() -> None:
    started = time.monotonic()
    with pytest.warns(SlowWait, match="the slow thing: "):
        assert wait_for("the slow thing", lambda: time.monotonic() - started > 0.3, 0.5,
                        every=0.05) is True  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error", SlowWait)
        assert wait_for("the quick thing", lambda: "done", 5.0) == "done"
