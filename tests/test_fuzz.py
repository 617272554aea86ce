"""Every decoder of untrusted input under the fuzzer (fuzz/targets.py lists them).

The corpus (seeds and the inputs of fixed crashes) is replayed in-process: a
regression fails here at once. Then every target is fuzzed with coverage
guidance (atheris) in one combined run: two processes, each running all the
targets (the first input byte picks one), so CI pays two start-ups rather than
one per target. Anything escaping other than the decoder's documented errors
fails the test with the input left in fuzz/crashes/. Long runs, per target:
`python fuzz/run.py --hours 8 --jobs 2`.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

FUZZ = Path(__file__).resolve().parents[1] / "fuzz"
COMBINED_SECONDS = 15  # per process (2 processes on 2 cores), plus ~15 s of start-up


def _load_runner():
    sys.path.insert(0, str(FUZZ))
    spec = importlib.util.spec_from_file_location("fuzz_run", FUZZ / "run.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_target_has_a_seed_corpus_that_replays_cleanly() -> None:
    runner = _load_runner()
    result = runner.replay(list(runner.targets()))
    assert set(result) == set(runner.targets())
    assert all(r["inputs"] >= 1 for r in result.values()), result


@pytest.mark.timeout(200)
def test_every_target_survives_a_combined_coverage_guided_run() -> None:
    pytest.importorskip("atheris", reason="atheris has wheels for x86-64 Linux only")
    proc = subprocess.run(
        [sys.executable, str(FUZZ / "run.py"), "--combined", "--jobs", "2",
         "--seconds", str(COMBINED_SECONDS)],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )  # fmt: skip
    report = json.loads(proc.stdout)
    failed = [r for r in report["processes"] if r.get("crash") or r.get("error")]
    assert not failed, json.dumps(failed, indent=1)
    assert all(r["executions"] > 0 for r in report["processes"]), report
    # Every target ran: a target the dispatcher never reached would go untested.
    runner = _load_runner()
    missed = {name for name in runner.targets() if not report["executions"].get(name)}
    assert not missed, report["executions"]
