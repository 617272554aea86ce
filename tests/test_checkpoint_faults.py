"""A disk that fails under a training peer: checkpoints stop, training does not.

A full disk (or a data directory gone read-only) while a periodic checkpoint is
written leaves the last good checkpoint as it was (saves are atomic), logs one
WARNING per distinct problem, not one per try, shows the problem in the trainer's
stats (`/status.checkpoint_error`) and training goes on; once the disk has room
again, checkpoints are written again and the error clears.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from waiting import eventually

import shoal.peer.trainer as trainer_module
import shoal.peer.training.checkpoint as checkpoint_module
from shoal.averaging.strategies import make_strategy
from shoal.dht.node import DHTNode
from shoal.peer.trainer import Trainer
from shoal.peer.training.checkpoint import CheckpointStore
from shoal.peer.training.task import load_task

pytestmark = pytest.mark.timeout(60)

TINY = {"d_model": 32, "n_layers": 1, "n_heads": 2, "context": 32, "batch_size": 4}
FAST = {"matchmaking_time": 1.0, "round_timeout": 8.0, "stall_timeout": 2.0, "state_timeout": 10.0}


def full_disk(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
    f.write(b"PK\x03\x04 part of a checkpoint")
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.fixture
async def trainer(make_host: Callable[..., Any], tmp_path: Path) -> AsyncIterator[Trainer]:
    """A lone DiLoCo peer that writes a checkpoint after every inner step."""
    task = load_task("bytegpt", dict(TINY))
    host = await make_host(max_connections_per_ip=100_000, close_grace=0.1)
    dht = await DHTNode.create(host, bootstrap=[], hop_timeout=1.0)
    model = task.make_model(0)
    strategy = make_strategy(
        "diloco", dht, "exp/outer", list(model.parameters()), {"inner_steps": 50, **FAST}
    )
    await strategy.start(join=False)
    made = Trainer(
        task, model, strategy, {"warmup_steps": 0}, shard=0, seed=0,
        checkpoints=CheckpointStore(tmp_path / "checkpoints"), checkpoint_interval=0.0,
    )  # fmt: skip
    try:
        yield made
    finally:
        made.close()
        await strategy.aclose()
        await dht.aclose()


async def test_a_full_disk_stops_checkpoints_not_training(
    trainer: Trainer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    store = trainer.checkpoints
    assert store is not None
    stop = asyncio.Event()
    running = asyncio.ensure_future(trainer.run(stop))
    try:
        await eventually(lambda: trainer.stats.checkpoint_at is not None, "a first checkpoint", 20)
        caplog.set_level(logging.INFO, logger="shoal.trainer")
        monkeypatch.setattr(checkpoint_module.torch, "save", full_disk)
        await eventually(lambda: trainer.stats.checkpoint_error is not None, "a failed save", 20)
        good, good_at = store.load(), trainer.stats.checkpoint_at  # (no save lands from now)
        assert good is not None
        failing_from = trainer.stats.step
        await eventually(lambda: trainer.stats.step >= failing_from + 5, "5 more steps", 20)
        assert not running.done(), "training stopped with the disk"
        assert trainer.stats.checkpoint_at == good_at
        error = trainer.stats.checkpoint_error
        assert error is not None and "No space left" in error and "--data-dir" in error
        warnings = [r for r in caplog.records if "checkpoint not written" in r.getMessage()]
        assert len(warnings) == 1, "one line per problem, not per try"
        assert warnings[0].levelno == logging.WARNING
        kept = store.load()
        assert kept is not None and kept["step"] == good["step"]  # the last good one, intact
        # Saves go on failing in a thread meanwhile: one may be between its temporary
        # file and its clean-up (a CI run saw one). None may stay.
        await eventually(
            lambda: not [p for p in store.directory.iterdir() if p.name.endswith(".tmp")],
            "no half-written checkpoint left behind",
        )

        monkeypatch.undo()  # room on the disk again
        now_at = trainer.stats.step
        await eventually(
            lambda: trainer.stats.checkpoint_error is None, "a checkpoint written again", 20
        )
        assert any("written again" in r.getMessage() for r in caplog.records)
        latest = store.load()
        assert latest is not None and latest["step"] >= now_at
        assert isinstance(latest["model"], dict) and all(
            isinstance(t, torch.Tensor) for t in latest["model"].values()
        )
    finally:
        monkeypatch.undo()  # (the final checkpoint, at stop, must be written)
        stop.set()
        await asyncio.wait_for(running, 30)


async def test_a_checkpoint_copies_the_model_in_the_trainers_thread_not_on_the_event_loop(
    trainer: Trainer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """(Copying a 50M-parameter model and its Adam state takes a second: on the event
    loop it would hold every heartbeat and /status that long.)"""
    copied_in: list[str] = []
    clone = trainer_module._clone

    def recording_clone(obj: Any) -> Any:
        if isinstance(obj, dict) and "model" in obj:
            copied_in.append(threading.current_thread().name)
        return clone(obj)

    monkeypatch.setattr(trainer_module, "_clone", recording_clone)
    await trainer.save_checkpoint()
    assert len(copied_in) == 1 and copied_in[0].startswith("shoal-train")
    assert trainer.checkpoints is not None and trainer.checkpoints.load() is not None
