"""Every decoder of untrusted input under the fuzzer (fuzz/targets.py lists them).

The corpus (seeds and the inputs of fixed crashes) is replayed in-process: a
regression fails here at once. Then every target is fuzzed for a few seconds
with coverage guidance (atheris); anything escaping other than the decoder's
documented errors fails the test with the input left in fuzz/crashes/. Long
runs: `python fuzz/run.py --seconds 3600`.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

FUZZ = Path(__file__).resolve().parents[1] / "fuzz"
SECONDS_PER_TARGET = 2  # (each target also pays ~2 s of startup: about 60 s of CI)


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


@pytest.mark.timeout(400)
def test_every_target_survives_a_short_coverage_guided_run() -> None:
    pytest.importorskip("atheris", reason="atheris has wheels for x86-64 Linux only")
    proc = subprocess.run(
        [sys.executable, str(FUZZ / "run.py"), "--seconds", str(SECONDS_PER_TARGET), "--jobs", "2"],
        capture_output=True,
        text=True,
        timeout=380,
        check=False,
    )
    report = json.loads(proc.stdout)
    failed = {name: r for name, r in report["targets"].items() if r.get("crash") or r.get("error")}
    assert not failed, json.dumps(failed, indent=1)
    assert all(r["executions"] > 0 for r in report["targets"].values()), report
