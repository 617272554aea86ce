"""The tests' fork server (tests/prefork.py) starts a Python child as `subprocess`
would, only without importing torch again: its argv, environment, working directory,
streams and exit status are its own, it draws its own random numbers, a child that
needs a different interpreter start is exec'd, and children die with the test run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import prefork
import pytest
from test_harness_orphans import alive

pytestmark = pytest.mark.timeout(60)

# (The server imported torch with one OpenMP thread; a child that asks for another count
# is exec'd. Every child the tests start asks for one.)
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}

CHILD = """
import json, os, random, sys
print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "env": os.environ.get("PREFORK_TEST"),
                  "torch": "torch" in sys.modules, "random": random.random(), "main": __name__}),
      flush=True)
sys.stderr.write("to stderr\\n")
if sys.argv[1:2] == ["wait"]:
    sys.stdin.read()
    import time; time.sleep(60)
sys.exit(int(sys.argv[1]) if sys.argv[1:2] != ["wait"] else 0)
"""


@pytest.fixture
def child_script(tmp_path: Path) -> Path:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    return script


def first_line(proc: subprocess.Popen[bytes] | prefork.ForkedProcess) -> dict[str, object]:
    assert proc.stdout is not None
    return json.loads(proc.stdout.readline())  # type: ignore[no-any-return]


def test_a_forked_script_has_its_own_argv_env_cwd_streams_and_exit_code(
    child_script: Path, tmp_path: Path
) -> None:
    workdir = tmp_path / "work"
    workdir.mkdir()
    with (tmp_path / "err").open("wb") as err:
        proc = prefork.popen(
            [sys.executable, str(child_script), "3", "x"],
            stdout=subprocess.PIPE,
            stderr=err,
            env={**ENV, "PREFORK_TEST": "mine"},
            cwd=workdir,
        )
    assert isinstance(proc, prefork.ForkedProcess)
    seen = first_line(proc)
    assert seen == {**seen, "argv": ["3", "x"], "cwd": str(workdir), "env": "mine"}
    assert seen["torch"] and seen["main"] == "__main__"  # (torch came with the fork)
    assert proc.wait(timeout=10) == 3 and proc.returncode == 3
    assert (tmp_path / "err").read_text() == "to stderr\n"


def test_two_forked_children_draw_different_random_numbers(child_script: Path) -> None:
    argv = [sys.executable, str(child_script), "0"]
    procs = [prefork.popen(argv, stdout=subprocess.PIPE, env=ENV) for _ in range(2)]
    draws = {first_line(p)["random"] for p in procs}
    assert len(draws) == 2
    assert [p.wait(timeout=10) for p in procs] == [0, 0]


def test_a_killed_or_stopped_child_reports_what_popen_would(child_script: Path) -> None:
    argv = [sys.executable, str(child_script), "wait"]
    proc = prefork.popen(argv, stdout=subprocess.PIPE, env=ENV)
    assert isinstance(proc, prefork.ForkedProcess)
    first_line(proc)
    assert proc.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.2)
    proc.send_signal(signal.SIGSTOP)
    proc.send_signal(signal.SIGCONT)
    assert proc.poll() is None  # (stopped and continued: still running)
    proc.terminate()
    assert proc.wait(timeout=10) == -signal.SIGTERM
    proc.kill()  # (after its exit: signals nobody)


def test_a_module_runs_as_with_dash_m_from_its_working_directory(tmp_path: Path) -> None:
    (tmp_path / "module_child.py").write_text(CHILD)
    argv = [sys.executable, "-m", "module_child", "5"]
    proc = prefork.popen(argv, stdout=subprocess.PIPE, env=ENV, cwd=tmp_path)
    assert isinstance(proc, prefork.ForkedProcess)
    seen = first_line(proc)
    assert seen["argv"] == ["5"] and seen["main"] == "__main__"
    assert proc.wait(timeout=10) == 5


def test_a_child_that_needs_another_interpreter_start_is_execd(
    child_script: Path, tmp_path: Path
) -> None:
    """A PYTHONPATH of its own (the tampered peers' sitecustomize.py runs at start-up)."""
    (tmp_path / "sitecustomize.py").write_text("import os; os.environ['PREFORK_TEST'] = 'site'\n")
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    proc = prefork.popen(
        [sys.executable, str(child_script), "0"],
        stdout=subprocess.PIPE,
        env={**ENV, "PYTHONPATH": path},
    )
    assert isinstance(proc, subprocess.Popen)
    assert first_line(proc)["env"] == "site"
    assert proc.wait(timeout=10) == 0


PARENT = """
import subprocess, sys
sys.path.insert(0, {tests!r})
import prefork
child = prefork.popen([sys.executable, {script!r}, "wait"], stdout=subprocess.PIPE,
                      env={{**prefork.SERVER_ENV}})
assert isinstance(child, prefork.ForkedProcess)
child.stdout.readline()
print(child.pid, flush=True)
import os; os._exit(0)
"""


def test_forked_children_die_when_the_test_run_dies_without_cleanup(child_script: Path) -> None:
    code = PARENT.format(tests=str(Path(__file__).parent), script=str(child_script))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    child = int(out.stdout.split()[0])
    deadline = time.monotonic() + 10
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    if alive(child):
        os.kill(child, signal.SIGKILL)
        raise AssertionError("a forked child outlived the process that asked for it")
