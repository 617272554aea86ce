"""Run the fuzz targets: coverage-guided (atheris, libFuzzer) or a replay of the corpus.

    python fuzz/run.py                       # every target, 10 s each
    python fuzz/run.py --seconds 3600 mux_frames rpc_frames   # long runs
    python fuzz/run.py --hours 8 --jobs 2    # rotate over every target for 8 hours
    python fuzz/run.py --minimize            # merge fuzz/work/<t>/ down to a minimal set
    python fuzz/run.py --combined --seconds 40 --jobs 2   # what CI runs (tests/test_fuzz.py)
    python fuzz/run.py --replay              # the corpus only (no atheris needed)
    python fuzz/run.py --list

Each target runs in a process of its own (libFuzzer owns the process) with its
seed corpus `fuzz/corpus/<target>/`; inputs that grow coverage are written to
`fuzz/work/<target>/` (not committed), so a later run starts from them.
`--combined` fuzzes every target in one process (the first input byte picks
the target), so a short run pays one start-up instead of one per target. A
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
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

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


COMBINED = "combined"
ARGV0 = "SHOAL_FUZZ_ARGV0"


def _fuzz_one(name: str) -> None:
    """libFuzzer's entry point, in the child process (argv carries libFuzzer's flags)."""
    import atheris

    # Coverage of shoal's own code guides the fuzzer (libraries are not instrumented).
    with atheris.instrument_imports(include=["shoal", "targets", "targets_net", "targets_app"]):
        names = list(targets())
    counts = dict.fromkeys(names, 0)
    counts_file = WORK / f"{name}-counts-{os.getpid()}.json"
    last_dump = [time.monotonic()]

    def one_input(data: bytes) -> None:
        if name != COMBINED:
            counts[name] += 1
            check(name, data)
        elif data:
            target = names[data[0] % len(names)]
            counts[target] += 1
            check(target, data[1:])
        if time.monotonic() - last_dump[0] > 1.0:  # libFuzzer exits without Python's atexit
            last_dump[0] = time.monotonic()
            counts_file.write_text(json.dumps(counts))

    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()


def _combined_seeds(names: list[str]) -> Path:
    """Every target's corpus, each input behind the byte that selects its target."""
    seeds = WORK / "combined-seeds"
    seeds.mkdir(parents=True, exist_ok=True)
    for old in seeds.iterdir():
        old.unlink()
    for i, name in enumerate(names):
        for path in sorted((CORPUS / name).glob("*")):
            (seeds / f"{name}-{path.name}").write_bytes(bytes([i]) + path.read_bytes())
    return seeds


def _counts(name: str) -> dict[str, int]:
    """Executions per target, summed over the processes of the run that just ended."""
    total: dict[str, int] = {}
    for path in WORK.glob(f"{name}-counts-*.json"):
        for target, n in json.loads(path.read_text()).items():
            total[target] = total.get(target, 0) + n
        path.unlink()
    return total


def fuzz(name: str, seconds: int, seed: int = 0) -> dict[str, object]:
    work = WORK / name
    work.mkdir(parents=True, exist_ok=True)
    CRASHES.mkdir(exist_ok=True)
    # (combined(): the seeds of every target, written once for all its processes)
    corpus = WORK / "combined-seeds" if name == COMBINED else CORPUS / name
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
        f"-seed={seed}",
        str(work),
    ]
    if corpus.is_dir():
        args.append(str(corpus))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    started = time.monotonic()
    proc = subprocess.run(args, capture_output=True, text=True, env=env, check=False)
    log = proc.stdout + proc.stderr
    if name != COMBINED:
        _counts(name)  # (the per-target count is libFuzzer's own here)
    runs = re.findall(r"stat::number_of_executed_units:\s+(\d+)", log)
    crash = re.findall(r"Test unit written to (\S+)", log)
    result: dict[str, object] = {
        "executions": int(runs[-1]) if runs else None,
        "seconds": round(time.monotonic() - started, 1),
        "corpus": len(list(work.iterdir())),
        "crash": crash[-1] if crash else None,
        "returncode": proc.returncode,
    }
    if proc.returncode != 0 and not crash:
        result["error"] = log[-2000:]
    elif crash:
        result["error"] = log[log.find("=== Uncaught") :][:3000] or log[-3000:]
        if name == COMBINED:  # which target, and its input without the selector byte
            data = Path(crash[-1]).read_bytes()
            names = list(targets())
            if data:
                result["target"] = names[data[0] % len(names)]
                Path(crash[-1] + ".input").write_bytes(data[1:])
    return result


def combined(seconds: int, jobs: int) -> dict[str, object]:
    """Every target in `jobs` processes at once, `seconds` each: a short run's start-up
    paid once per process, not once per target."""
    _combined_seeds(list(targets()))
    with concurrent.futures.ThreadPoolExecutor(max(1, jobs)) as pool:
        runs = list(pool.map(lambda i: fuzz(COMBINED, seconds, seed=i + 1), range(jobs)))
    return {"processes": runs, "executions": _counts(COMBINED)}


def _child_command(name: str) -> Path:
    """An executable that runs `name`'s libFuzzer child: libFuzzer's -merge runs its
    argv[0] again, which must then be a command (run.py alone is not)."""
    script = WORK / f"child-{name}.sh"
    script.write_text(
        f'#!/bin/sh\nexec "{sys.executable}" "{Path(__file__).resolve()}" --child {name} "$@"\n'
    )
    script.chmod(0o755)
    return script


def minimize(names: list[str]) -> dict[str, dict[str, object]]:
    """Merge each target's work corpus down to the inputs that keep its coverage
    (libFuzzer's -merge=1), replacing fuzz/work/<target>/ with the result (kept as it
    was when the merge fails)."""
    out: dict[str, dict[str, object]] = {}
    for name in names:
        work, merged = WORK / name, WORK / f"{name}.merged"
        if not work.is_dir() or not any(work.iterdir()):
            continue
        shutil.rmtree(merged, ignore_errors=True)
        merged.mkdir()
        before = len(list(work.iterdir()))
        command = _child_command(name)
        args = [str(command), "-merge=1", "-max_len=4096", "-timeout=10", "-rss_limit_mb=2048",
                str(merged), str(work)]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1", ARGV0: str(command)}
        proc = subprocess.run(args, capture_output=True, text=True, env=env, check=False)
        after = list(merged.iterdir())
        if proc.returncode != 0 or not after:
            out[name] = {"before": before, "error": (proc.stdout + proc.stderr)[-1000:]}
            shutil.rmtree(merged)
            continue
        shutil.rmtree(work)
        merged.rename(work)
        out[name] = {"before": before, "after": len(after)}
    return out


def rotate(names: list[str], hours: float, seconds: int, jobs: int) -> dict[str, object]:
    """Fuzz the targets in turn, `seconds` each (`jobs` at a time), round after round
    until `hours` pass (every target gets at least one turn); then minimize the work
    corpora. Executions and crashes are summed per target; a crashing target sits
    out the rest of the run (its crash waits for a fix)."""
    deadline = time.monotonic() + hours * 3600
    totals: dict[str, dict[str, Any]] = {
        n: {"executions": 0, "seconds": 0.0, "turns": 0, "crashes": []} for n in names
    }
    crashed: set[str] = set()
    queue = list(names)
    with concurrent.futures.ThreadPoolExecutor(max(1, jobs)) as pool:
        while queue:
            batch, queue = queue[:jobs], queue[jobs:]
            for name, r in zip(batch, pool.map(lambda n: fuzz(n, seconds), batch), strict=True):
                t = totals[name]
                t["executions"] += int(r.get("executions") or 0)
                t["seconds"] = round(t["seconds"] + float(r["seconds"]), 1)  # type: ignore[arg-type]
                t["turns"] += 1
                if r.get("crash") or r.get("error"):
                    t["crashes"].append(r.get("crash") or r.get("error"))
                    crashed.add(name)
            progress = {n: totals[n]["executions"] for n in batch}
            print(json.dumps({"progress": progress}), file=sys.stderr, flush=True)
            if not queue and time.monotonic() < deadline:
                queue = [n for n in names if n not in crashed]
    return {"targets": totals, "minimized": minimize(names)}


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        name = sys.argv.pop(2)
        sys.argv.pop(1)
        sys.argv[0] = os.environ.get(ARGV0, sys.argv[0])  # what libFuzzer runs again
        _fuzz_one(name)
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("targets", nargs="*", help="target names (default: all)")
    parser.add_argument("--seconds", type=int, default=10, help="fuzzing time per target")
    parser.add_argument("--replay", action="store_true", help="replay the corpus only")
    parser.add_argument("--list", action="store_true", help="list the targets")
    parser.add_argument("--jobs", type=int, default=1, help="targets fuzzed at once")
    parser.add_argument("--combined", action="store_true", help="every target in one process")
    parser.add_argument("--hours", type=float, help="rotate over the targets for this long")
    parser.add_argument("--minimize", action="store_true", help="merge the work corpora down")
    args = parser.parse_args()
    known = targets()
    names = args.targets or list(known)
    unknown = [n for n in names if n not in known]
    if unknown:
        parser.error(f"unknown target(s) {', '.join(unknown)}; known: {', '.join(known)}")
    if args.list:
        for name in names:
            print(f"{name:26} {known[name].doc.splitlines()[0]}")
        return 0
    if args.replay:
        print(json.dumps({"replay": replay(names)}))
        return 0
    if args.minimize:
        print(json.dumps({"minimized": minimize(names)}))
        return 0
    if args.combined:
        report = combined(args.seconds, args.jobs)
        print(json.dumps({"seconds": args.seconds, **report}))
        runs = report["processes"]
        return 1 if any(r.get("crash") or r.get("error") for r in runs) else 0  # type: ignore[union-attr]
    if args.hours:
        report = rotate(names, args.hours, args.seconds, args.jobs)
        print(json.dumps(report))
        return 1 if any(t["crashes"] for t in report["targets"].values()) else 0  # type: ignore[union-attr]
    with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
        done = pool.map(lambda name: fuzz(name, args.seconds), names)
        results = dict(zip(names, done, strict=True))
    print(json.dumps({"seconds_per_target": args.seconds, "targets": results}))
    return 1 if any(r.get("crash") or r.get("error") for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
