"""`SHOAL_TEST_CPU_LOG` tells a test that keeps a core busy, in itself or in a process
it starts, from one that waits (tests/cpu_report.py).

A small pytest session of its own runs in a subprocess, with this project's two
xdist workers and loadgroup, and writes the log that is then read back.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cpu_report import summary

TESTS = Path(__file__).parent

CONFTEST = f"""
import sys
sys.path.insert(0, {str(TESTS)!r})
from cpu_report import pytest_runtest_protocol
"""

CASES = """
import subprocess, sys, time, pytest

def burn(seconds):
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass

def test_waits():
    time.sleep(1.0)

def test_burns_in_itself():
    burn(1.0)

@pytest.mark.xdist_group("one-at-a-time")
def test_burns_in_a_process_it_starts():
    code = "import time\\nend = time.process_time() + 1.0\\nwhile time.process_time() < end: pass"
    subprocess.run([sys.executable, "-c", code], check=True)
"""


@pytest.mark.timeout(90)
def test_each_test_gets_its_wall_and_the_cpu_of_what_it_ran(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_cases.py").write_text(CASES)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    log = tmp_path / "cpu.jsonl"
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:randomly",
               "-n", "2", "--dist", "loadgroup", str(tmp_path)]  # fmt: skip
    env = {**os.environ, "SHOAL_TEST_CPU_LOG": str(log)}
    out = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=80,
                         check=False, env=env)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    lines = log.read_text().splitlines()
    rows = {json.loads(line)["test"].split("::")[1]: json.loads(line) for line in lines}

    waits = rows["test_waits"]
    assert waits["wall_s"] >= 1.0 and waits["cpu_s"] < 0.5
    # (No "@one-at-a-time": xdist's loadgroup did not group it, as under pytest 9.2.)
    assert "test_burns_in_a_process_it_starts@one-at-a-time" in rows, sorted(rows)
    for busy in ("test_burns_in_itself", "test_burns_in_a_process_it_starts@one-at-a-time"):
        assert rows[busy]["cpu_s"] >= 1.0, rows[busy]
        assert rows[busy]["worker"] in {"gw0", "gw1"}

    text = summary(lines)
    assert "group one-at-a-time: 1 tests" in text and "group (none): 2 tests" in text
    assert "test_cases.py::test_burns_in_a_process_it_starts\n" in text + "\n"
