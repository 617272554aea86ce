"""A stage whose every peer was killed comes back from a checkpoint, with `shoal run` processes.

Two stages: the host serves stage 0, two daemons serve stage 1 and write a
checkpoint of it every second; the trainer runs in the test process (lag 0,
exact codec) so its counters can be read. Both stage-1 daemons are killed
with SIGKILL and one is restarted from its data directory: it restores the
stage at its checkpointed version, the trainer re-bases and trains on, and
every sample the trainer completed is in exactly one step of each stage or
held for the next (the steps after the checkpoint were lost with the stage:
the trainer replays what they counted). Killed again and restarted with its
checkpoint gone, the stage starts from the initial weights and /status says
it was lost, with its version.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from daemon_harness import Daemon, wait_for

from shoal.dht.node import DHTNode
from shoal.peer.experiment import find_manifest, parse_experiment_ref
from shoal.peer.training.tasks.bytegpt import make_task
from shoal.pipeline.trainer import PipelineTrainer
from shoal.pipeline.trainer_loop import TrainerLoop

pytestmark = pytest.mark.slow

TASK = "d_model=16,n_layers=2,n_heads=2,context=16,batch_size=4"
ENV = {
    "SHOAL_TASK_OPTIONS": TASK,
    "SHOAL_THREADS": "1",
    "SHOAL_CHECKPOINT_INTERVAL": "1",
    "SHOAL_STRATEGY_OPTIONS": "lag=0,codec=none",
}


def pipeline_of(d: Daemon) -> dict[str, Any]:
    return d.status()["pipeline"]  # type: ignore[no-any-return]


def tails(daemons: list[Daemon]) -> Callable[[], str]:
    return lambda: "\n".join(d.tail(15) for d in daemons)


async def wait(what: str, condition: Callable[[], Any], timeout: float, debug: Any) -> Any:
    return await asyncio.to_thread(wait_for, what, condition, timeout, debug=debug)


def accounted(peers: list[Daemon], stage: int, samples: int) -> bool:
    """Stage `stage`'s step sizes plus the samples its peers hold add up to `samples`."""
    of_stage = [p for p in (pipeline_of(d) for d in peers) if p["stage"] == stage]
    steps: dict[str, int] = {}
    for p in of_stage:
        steps.update(p["step_samples"])
    return sum(steps.values()) + sum(p["pending_samples"] for p in of_stage) == samples


@pytest.mark.timeout(150)
async def test_a_stage_whose_peers_were_all_killed_resumes_from_a_restarted_peers_checkpoint(
    tmp_path: Path, make_host: Callable[..., Any]
) -> None:
    host_args = ["--host-experiment", "ckpt", "--pipeline-stages", "2", "--role", "stage"]
    began = time.monotonic()
    host = Daemon("host", tmp_path, [*host_args, "--stage", "0"], ENV)
    daemons = [host]
    dht = None
    stop = asyncio.Event()
    try:
        await asyncio.to_thread(host.wait_ready)
        join = ["--join", host.join_ref, "--bootstrap", host.address, "--role", "stage",
                "--stage", "1"]  # fmt: skip
        ones = [Daemon(f"one-{i}", tmp_path, join, ENV) for i in range(2)]
        daemons += ones
        for d in ones:
            await asyncio.to_thread(d.wait_ready)
        dht = await DHTNode.create(await make_host(), bootstrap=[host.address])
        manifest = await find_manifest(dht, parse_experiment_ref(host.join_ref), timeout=15)
        task = make_task(manifest.task_config)
        trainer = PipelineTrainer(dht, manifest.experiment_id, 2, codec="none")
        loop = TrainerLoop(trainer, task.batches(0, 1, 0), inputs_of=task.stage_inputs,
                           loss_of=task.stage_loss, lag=0,
                           global_batch=manifest.strategy_options["global_batch"])  # fmt: skip
        run = asyncio.ensure_future(loop.run(stop))
        debug = tails(daemons)
        print(f"{time.monotonic() - began:.1f}s: the daemons are up")
        # (And the host has read stage 1's records past version 0: a peer knows what a
        # restore cost only from what it saw (pipeline/stage_losses.py), and it reads
        # the records every 5 s; on a quick machine the steps came sooner.)
        await wait("3 steps, each stage-1 peer's checkpoint, the host seeing stage 1",
                   lambda: loop.steps >= 3 and all(d.status()["checkpoint_at"] for d in ones)
                   and (pipeline_of(host)["stages"][1]["version"] or 0) >= 1,
                   60, debug)  # fmt: skip
        print(f"{time.monotonic() - began:.1f}s: 3 steps")

        for d in ones:  # the whole stage dies
            d.kill()
        before = max(trainer.versions[1], 1)
        saved = torch.load(next((ones[0].data_dir / "checkpoints").glob("*/latest.pt")),
                           weights_only=True)["commits"]  # fmt: skip
        restarted = Daemon("one-0", tmp_path, join, ENV)  # its data directory, its identity
        daemons.append(restarted)
        await asyncio.to_thread(restarted.wait_ready)
        started = time.monotonic()
        resumed = pipeline_of(restarted)
        print(
            f"{time.monotonic() - began:.1f}s: restored at version {resumed['version']}; "
            f"the stage had reached {before}"
        )
        assert resumed["version"] == saved and 1 <= saved <= before
        own = resumed["stages"][1]["restored"]  # (when it saw the dead peers' records)
        assert own is None or own["version"] == resumed["version"], own

        steps = loop.steps

        def state() -> str:  # (what the trainer sees of stage 1, should it not step)
            views = {str(p)[-6:]: v for p, v in trainer.balancers[1].snapshot().items()}
            return (
                f"{debug()}\nversions {trainer.versions} views {views} "
                f"in flight {loop.in_flight} {trainer.counters}"
            )

        await wait("3 steps after the restore", lambda: loop.steps >= steps + 3, 60, state)
        print(f"3 steps {time.monotonic() - started:.1f}s after the restore")
        assert not run.done()
        restored = await wait(
            "the host to see the restore",
            lambda: pipeline_of(host)["stages"][1]["restored"],
            15,
            debug,
        )
        assert restored["version"] == resumed["version"]
        assert restored["lost_version"] >= restored["version"]

        stop.set()
        await run
        await asyncio.wait_for(trainer.settled(), 30)
        alive = [host, restarted]
        samples = trainer.counters.samples

        def ledger() -> str:  # (what each side counted, should the sums differ)
            keys = ("stage", "version", "step_samples", "pending_samples", "syncs")
            views = [{k: pipeline_of(d).get(k) for k in keys} for d in alive]
            return f"{debug()}\ntrainer {samples} samples {trainer.counters}\nstages {views}"

        for s in (0, 1):
            await wait(f"stage {s} to account for every sample",
                       lambda s=s: accounted(alive, s, samples), 30, ledger)  # fmt: skip
        assert sum(trainer.ledger.restored) > 0 or resumed["version"] == before

        # Killed again, its checkpoint gone: no copy of the stage is left.
        restarted.kill()
        shutil.rmtree(restarted.data_dir / "checkpoints")
        again = Daemon("one-0", tmp_path, join, ENV)
        daemons.append(again)
        await asyncio.to_thread(again.wait_ready)
        assert pipeline_of(again)["version"] == 0  # from the initial weights, said so:
        lost = await wait(
            "the host to say stage 1 was lost",
            lambda: pipeline_of(host)["stages"][1]["lost"],
            15,
            debug,
        )
        assert lost["version"] >= restored["version"] and lost["since"] > 0
        print(f"{time.monotonic() - began:.1f}s: lost at {lost['version']}")
    finally:
        stop.set()
        if dht is not None:
            await dht.aclose()
        for d in daemons:
            d.kill()
