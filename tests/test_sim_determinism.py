"""The simulator is deterministic: one scenario with one seed gives the same figures on
every run (on one machine), so an A/B comparison of a protocol change needs one run a
side, not enough runs to average the noise out.

What made runs differ: executor threads (their results landed among the callbacks of a
virtual instant in an order set by real time), os.urandom / SystemRandom / unseeded
random.Random() (round IDs, nonces, routing tables' draws), the per-process salt of
str and bytes hashes (the order of sets of IDs), tasks hashed by their address in
memory (the order of sets of tasks followed the heap's history), and a host's
connections kept in a set (a closing host closed them in the order of their addresses).
"""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import random
import secrets
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "sim"))

from vtime import VirtualTimeLoop, seeded_entropy  # noqa: E402

# Figures measured in real time: the only ones allowed to differ between runs.
WALL_CLOCK_KEYS = {"wall_s", "virtual_over_wall"}

# 16 peers on a 2 x 2 grid and one key for all, with churn: round IDs and nonces from
# os.urandom, hashing and codec work in executor threads, and sets of tasks decide
# what happens. Before the fix two runs differed in most figures; about 5 s a run.
SCENARIO: dict[str, Any] = {
    "name": "determinism_ci",
    "peers": 16,
    "seed": 5,
    "links": {
        "home": {"share": 0.8, "down_mbit": [10, 100], "up_mbit": [2, 20], "latency_ms": [10, 60]},
        "datacenter": {
            "share": 0.2,
            "down_mbit": [1000, 1000],
            "up_mbit": [1000, 1000],
            "latency_ms": [1, 5],
        },
    },
    "churn": {"mean_session_min": 3.0},
    "workload": {"kind": "moshpit", "join_window_s": 2, "size": 64, "grid_dims": 2,
                 "grid_side": 2, "min_matchmaking_time": 3.0, "target_group_size": 8,
                 "rounds": 3},
}  # fmt: skip


def run_py(path: Path, *options: str) -> dict[str, Any]:
    """`python sim/run.py path [options]` as a user runs it: no PYTHONHASHSEED in its
    environment (run.py fixes the salt itself); the JSON object it prints."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    out = subprocess.run(
        [sys.executable, str(ROOT / "sim" / "run.py"), str(path), *options],
        capture_output=True, text=True, timeout=55, env=env, check=True,
    )  # fmt: skip
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1, out.stdout
    figures: dict[str, Any] = json.loads(lines[0])
    return figures


@pytest.mark.timeout(120)
def test_a_scenario_run_twice_gives_the_same_figures(tmp_path: Path) -> None:
    path = tmp_path / "determinism_ci.json"
    path.write_text(json.dumps(SCENARIO))
    traces = [tmp_path / "first.gz", tmp_path / "second.gz"]
    first, second = (run_py(path, "--trace", str(trace)) for trace in traces)
    assert first["commits_fraction"] > 0 and "one_key" in first  # (it did run both arms)
    for figures in (first, second):
        for key in WALL_CLOCK_KEYS:
            figures.pop(key)
    assert first == second
    # And event by event: every callback the loop ran, in the same order, at the same
    # virtual instants (the trace a divergence is hunted down with).
    callbacks = [gzip.decompress(trace.read_bytes()).splitlines() for trace in traces]
    assert len(callbacks[0]) > 10_000 and b" task 0 run_moshpit" in callbacks[0][0]
    pairs = zip(*callbacks, strict=False)  # (a shorter trace: the lengths say so below)
    parted = next((i for i, (a, b) in enumerate(pairs) if a != b), None)
    assert parted is None, f"the traces part at {callbacks[0][parted]!r}"
    assert len(callbacks[0]) == len(callbacks[1])


@pytest.mark.timeout(60)
def test_run_py_fixes_the_hash_salt_unless_one_was_chosen() -> None:
    """run.py re-runs itself with PYTHONHASHSEED=0 where it is not set: the order of
    sets of str and bytes (peer IDs, versions) then repeats from run to run."""
    code = (
        f"import os, sys; sys.path.insert(0, {str(ROOT / 'sim')!r}); import run; "
        "run.fix_hash_seed(); print(os.environ['PYTHONHASHSEED'], hash('peer'))"
    )

    def salt_and_hash(**env: str) -> str:
        base = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=50, env={**base, **env}, check=True)  # fmt: skip
        return out.stdout.strip()

    unset = salt_and_hash()
    assert unset.startswith("0 ") and unset == salt_and_hash()
    assert salt_and_hash(PYTHONHASHSEED="5").startswith("5 ")


@pytest.mark.timeout(30)
def test_executor_jobs_run_at_once_and_land_in_the_order_they_started() -> None:
    """A slow job started first settles first, as it would have on an infinitely fast
    machine (in real threads the quick one's result landed first), in no virtual time,
    at the loop's next pass; a job's exception is raised where its result is awaited."""
    order: list[str] = []

    def slow() -> str:
        time.sleep(0.05)  # real time
        return "slow"

    def fails() -> None:
        raise KeyError("in the job")

    async def job(fn: Any) -> None:
        order.append(await asyncio.to_thread(fn))

    async def main() -> float:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        future = loop.run_in_executor(None, lambda: "quick")
        assert not future.done()  # (its result comes at the next pass, as a thread's)
        await asyncio.gather(job(slow), job(lambda: "quick"))
        with pytest.raises(KeyError, match="in the job"):
            await asyncio.to_thread(fails)
        return loop.time() - t0

    loop = VirtualTimeLoop()
    try:
        taken = loop.run_until_complete(main())
    finally:
        loop.close()
    assert order == ["slow", "quick"]
    assert taken == 0.0


@pytest.mark.timeout(30)
def test_sets_of_tasks_iterate_in_the_same_order_whatever_the_heap_holds() -> None:
    """The tasks done at one instant, as `asyncio.wait` hands them over, come in the
    same order in a loop whose heap was shuffled first (by address they did not)."""

    async def done_order(clutter: int) -> list[int]:
        junk: list[Any] = [object() for _ in range(clutter)]  # (other addresses after)
        names: dict[asyncio.Future[None], int] = {}
        tasks: list[asyncio.Future[None]] = []
        for i in range(64):
            tasks.append(asyncio.ensure_future(asyncio.sleep(1)))
            names[tasks[-1]] = i
            junk.append([object()] * (i % 7))
        done, _ = await asyncio.wait(tasks)
        return [names[t] for t in done]

    def run(clutter: int) -> list[int]:
        loop = VirtualTimeLoop()
        try:
            order: list[int] = loop.run_until_complete(done_order(clutter))
            return order
        finally:
            loop.close()

    assert run(0) == run(1001) == run(77_777)


@pytest.mark.timeout(30)
def test_seeded_entropy_draws_the_same_randomness_for_a_seed_and_then_lets_go() -> None:
    """os.urandom, secrets and unseeded random.Random() repeat under one seed, differ
    under another, and are the system's again afterwards."""
    saved = (os.urandom, random.Random.seed)

    def draws(seed: int) -> tuple[bytes, str, float, float]:
        with seeded_entropy(seed):
            return (os.urandom(16), secrets.token_hex(8), random.Random().random(),
                    random.SystemRandom().random())  # fmt: skip

    assert draws(1) == draws(1)
    assert draws(1) != draws(2)
    assert (os.urandom, random.Random.seed) == saved
    assert random.Random(7).random() == random.Random(7).random()  # (seeded: as before)
