"""Run the fuzz targets: coverage-guided (atheris, libFuzzer) or a replay of the corpus.

    python fuzz/run.py                       # every target, 10 s each
    python fuzz/run.py --seconds 3600 mux_frames rpc_frames   # long runs
    python fuzz/run.py --replay              # the corpus only (no atheris needed)
    python fuzz/run.py --seconds 5 --jobs 2  # what CI runs (tests/test_fuzz.py)
    python fuzz/run.py --list

Each target runs in a process of its own (libFuzzer owns the process) with its
seed corpus `fuzz/corpus/<target>/`; inputs that grow coverage are written to
`fuzz/work/<target>/` (not committed), so a later run starts from them. A
crash (an exception other than the target's documented errors, or a
failed consistency check) stops that target and leaves the input as
`fuzz/crashes/<target>-<hash>`; copy it into `fuzz/corpus/<target>/` once the
bug is fixed, as the regression case. Prints one JSON object: per target the
executions, the seconds, the corpus size and the crash file if any.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

CORPUS = HERE / "corpus"
WORK = HERE / "work"
CRASHES = HERE / "crashes"


def targets() -> dict:
    # Imported on first use: in a fuzzing child, only after atheris instruments imports.
    from targets import TARGETS

    return TARGETS


def check(name: str, data: bytes) -> None:
    """One input through one target: its documented errors are fine, anything else raises."""
    target = targets()[name]
    try:
        target.run(data)
    except target.allowed:
        pass


def replay(names: list[str]) -> dict[str, dict[str, object]]:
    """Every file of the corpus through its target (regressions, and the seeds)."""
    out: dict[str, dict[str, object]] = {}
    for name in names:
        files = sorted((CORPUS / name).glob("*")) if (CORPUS / name).is_dir() else []
        started = time.monotonic()
        for path in files:
            try:
                check(name, path.read_bytes())
            except Exception as e:
                raise AssertionError(f"{name}: {path.name}: {type(e).__name__}: {e}") from e
        out[name] = {"inputs": len(files), "seconds": round(time.monotonic() - started, 3)}
    return out


def _fuzz_one(name: str) -> None:
    """libFuzzer's entry point, in the child process (argv carries libFuzzer's flags)."""
    import atheris

    # Coverage of shoal's own code guides the fuzzer (libraries are not instrumented).
    with atheris.instrument_imports(include=["shoal", "targets"]):
        targets()

    def one_input(data: bytes) -> None:
        check(name, data)

    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()


def fuzz(name: str, seconds: int) -> dict[str, object]:
    work = WORK / name
    work.mkdir(parents=True, exist_ok=True)
    CRASHES.mkdir(exist_ok=True)
    corpus = CORPUS / name
    args = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        name,
        f"-max_total_time={seconds}",
        "-max_len=4096",
        "-rss_limit_mb=2048",
        "-timeout=10",
        f"-artifact_prefix={CRASHES}/{name}-",
        "-print_final_stats=1",
        str(work),
    ]
    if corpus.is_dir():
        args.append(str(corpus))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    started = time.monotonic()
    proc = subprocess.run(args, capture_output=True, text=True, env=env, check=False)
    log = proc.stdout + proc.stderr
    runs = re.findall(r"stat::number_of_executed_units:\s+(\d+)", log)
    crash = re.findall(r"Test unit written to (\S+)", log)
    result: dict[str, object] = {
        "executions": int(runs[-1]) if runs else None,
        "seconds": round(time.monotonic() - started, 1),
        "corpus": len(list(work.iterdir())),
        "crash": crash[-1] if crash else None,
    }
    if proc.returncode != 0 and not crash:
        result["error"] = log[-2000:]
    elif crash:
        result["error"] = log[log.find("=== Uncaught") :][:3000] or log[-3000:]
    return result


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        name = sys.argv.pop(2)
        sys.argv.pop(1)
        _fuzz_one(name)
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("targets", nargs="*", help="target names (default: all)")
    parser.add_argument("--seconds", type=int, default=10, help="fuzzing time per target")
    parser.add_argument("--replay", action="store_true", help="replay the corpus only")
    parser.add_argument("--list", action="store_true", help="list the targets")
    parser.add_argument("--jobs", type=int, default=1, help="targets fuzzed at once")
    args = parser.parse_args()
    known = targets()
    names = args.targets or list(known)
    unknown = [n for n in names if n not in known]
    if unknown:
        parser.error(f"unknown target(s) {', '.join(unknown)}; known: {', '.join(known)}")
    if args.list:
        for name in names:
            print(f"{name:26} {known[name].doc}")
        return 0
    if args.replay:
        print(json.dumps({"replay": replay(names)}))
        return 0
    with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
        done = pool.map(lambda name: fuzz(name, args.seconds), names)
        results = dict(zip(names, done, strict=True))
    print(json.dumps({"seconds_per_target": args.seconds, "targets": results}))
    return 1 if any(r.get("crash") or r.get("error") for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
