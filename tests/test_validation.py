"""The validation loss a peer reports (peer/training/validation.py and its hook in the trainer).

It is the mean loss over the task's held-out batches, scored on the model a round
left (DiLoCo: the swarm's global parameters), in the training thread, and never
more often than the schedule allows: at once the first time, then after
`min_interval_s`, or longer when an evaluation is slow (at most `max_share` of the
time).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import torch

from shoal.averaging.outer import RoundOutcome, RoundReport
from shoal.averaging.strategies import make_strategy
from shoal.dht.node import DHTNode
from shoal.peer.trainer import Trainer
from shoal.peer.training.task import Task, load_task
from shoal.peer.training.validation import Validation, ValidationSchedule, changes_the_model

pytestmark = pytest.mark.timeout(60)

TINY = {"d_model": 32, "n_layers": 1, "n_heads": 2, "context": 32, "batch_size": 4}
FAST = {"matchmaking_time": 1.0, "round_timeout": 8.0, "stall_timeout": 2.0, "state_timeout": 10.0}


def report(outcome: RoundOutcome) -> RoundReport:
    return RoundReport(1, outcome, "", 1, 0.1, None, 0)


def test_the_model_changed_after_a_commit_or_a_resync_only() -> None:
    assert changes_the_model([report(RoundOutcome.ABORTED), report(RoundOutcome.COMMITTED)])
    assert changes_the_model([report(RoundOutcome.RESYNCED)])
    assert not changes_the_model([report(RoundOutcome.ABORTED), report(RoundOutcome.NO_GROUP)])
    assert not changes_the_model([])


def test_the_first_evaluation_is_due_at_once_then_not_before_the_minimum_interval() -> None:
    schedule = ValidationSchedule(min_interval_s=30.0, max_share=0.05)
    assert schedule.due(100.0)
    schedule.ran(100.0, 100.5)  # 0.5 s: 10 s would keep it at 5%, below the minimum
    assert not schedule.due(130.4)
    assert schedule.due(130.5)


def test_a_slow_evaluation_spaces_the_next_one_to_keep_its_share_of_the_time() -> None:
    schedule = ValidationSchedule(min_interval_s=30.0, max_share=0.05)
    schedule.ran(0.0, 4.0)  # 4 s every 80 s is 5%
    assert not schedule.due(79.9)
    assert schedule.due(80.0)


def test_schedule_and_validation_refuse_unusable_settings(task: Task) -> None:
    with pytest.raises(ValueError):
        ValidationSchedule(max_share=0)
    with pytest.raises(ValueError):
        ValidationSchedule(min_interval_s=-1)
    with pytest.raises(ValueError):
        Validation(task, batches=-1)
    assert not Validation(task, batches=0).enabled


@pytest.fixture(scope="module")
def task() -> Task:
    return load_task("bytegpt", dict(TINY))


@pytest.fixture
async def lone_diloco(
    make_host: Callable[..., Any], task: Task
) -> AsyncIterator[tuple[torch.nn.Module, Any]]:
    """A model and DiLoCo over its parameters, alone in its own DHT (rounds commit alone)."""
    host = await make_host(max_connections_per_ip=100_000, close_grace=0.1)
    dht = await DHTNode.create(host, bootstrap=[], hop_timeout=1.0)
    model = task.make_model(0)
    params = list(model.parameters())
    strategy = make_strategy("diloco", dht, "exp/outer", params, {"inner_steps": 3, **FAST})
    await strategy.start(join=False)
    try:
        yield model, strategy
    finally:
        await strategy.aclose()
        await dht.aclose()


def mean_loss_of(task: Task, parameters: list[torch.Tensor], batches: list[Any]) -> float:
    """The README's validation loss, computed directly on a fresh model holding `parameters`."""
    model = task.make_model(1)
    with torch.no_grad():
        for p, value in zip(model.parameters(), parameters, strict=True):
            p.copy_(value)
    model.eval()
    with torch.no_grad():
        return sum(float(task.loss(model, b)) for b in batches) / len(batches)


async def test_after_a_committed_round_val_loss_is_the_mean_loss_of_the_global_parameters(
    lone_diloco: tuple[torch.nn.Module, Any], task: Task
) -> None:
    model, strategy = lone_diloco
    stop = asyncio.Event()
    rounds: list[RoundReport] = []

    def on_round(r: RoundReport) -> None:
        rounds.append(r)
        if r.committed:
            stop.set()  # the loop scores this round's model, then ends: nothing trains after

    trainer = Trainer(task, model, strategy, {"warmup_steps": 0}, shard=0, seed=0)
    trainer.on_round = on_round
    try:
        assert trainer.stats.val_loss is None
        async with asyncio.timeout(40):
            await trainer.run(stop)
    finally:
        trainer.close()
    assert rounds[-1].committed and trainer.stats.step % 3 == 0  # at a round's boundary
    assert trainer.stats.val_loss is not None and trainer.stats.val_loss_at is not None
    expected = mean_loss_of(task, strategy.globals, task.eval_batches(8))
    assert trainer.stats.val_loss == pytest.approx(expected, rel=1e-6)
    assert model.training  # scoring put the model back in training mode


async def test_validate_follows_the_schedule_unless_forced_and_batches_0_turns_it_off(
    lone_diloco: tuple[torch.nn.Module, Any], task: Task
) -> None:
    model, strategy = lone_diloco
    schedule = ValidationSchedule(min_interval_s=3600.0)
    trainer = Trainer(
        task,
        model,
        strategy,
        {},
        shard=0,
        seed=0,
        validation=Validation(task, batches=2, schedule=schedule),
    )
    off = Trainer(task, model, strategy, {}, shard=0, seed=0, validation=Validation(task, 0))
    try:
        first = await trainer.validate()
        assert first == pytest.approx(
            mean_loss_of(task, list(model.parameters()), task.eval_batches(2))
        )
        scored_at = trainer.stats.val_loss_at
        assert await trainer.validate() is None  # within the interval: skipped
        assert trainer.stats.val_loss_at == scored_at
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.5)
        forced = await trainer.validate(force=True)
        assert forced is not None and forced != first
        assert await off.validate(force=True) is None and off.stats.val_loss is None
    finally:
        trainer.close()
        off.close()


def test_the_held_out_batches_are_read_once(task: Task) -> None:
    validation = Validation(task, batches=3)
    first = validation.held_out()
    assert validation.held_out() is first and len(first) == 3
    assert all(torch.equal(a, b) for a, b in zip(first, task.eval_batches(3), strict=True))
