"""Audits of training work: a referee re-runs a committed segment of a peer's
inner run (the same batches, the trainer's own step) and judges the result by
LSH signatures. Honest re-executions pass, on another thread count too; every
cheat of the issue fails."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from shoal.peer.trainer import check_hyperparameters
from shoal.peer.training.tasks.bytegpt import ByteGPTTask, make_task
from shoal.peer.verify.segments import (
    SegmentRunner,
    SegmentState,
    delta,
    round_batch_seed,
    segment_batches,
)
from shoal.transport.identity import Identity
from shoal.verification.audit import AuditPolicy, judge
from shoal.verification.evidence import Result

pytestmark = pytest.mark.timeout(120)

TASK = {"d_model": 32, "n_layers": 1, "n_heads": 2, "context": 32, "batch_size": 8}
SHARDS = 8
STEPS = 3  # the default segment length (AuditPolicy.segment_steps)
FIRST_STEP = 300  # past the warmup: full-size steps


@pytest.fixture(scope="module")
def task() -> ByteGPTTask:
    return make_task(TASK)


@pytest.fixture(scope="module")
def hyper() -> dict[str, Any]:
    return check_hyperparameters({"inner_lr": 3e-3})


@pytest.fixture(scope="module")
def states(task: ByteGPTTask, hyper: dict[str, Any]) -> tuple[SegmentState, SegmentState]:
    """An older global state, and the round's start 5 steps later (so that Adam's
    moments are not empty)."""
    runner = SegmentRunner(task, hyper)
    older = runner.capture()
    warm = segment_batches(task, 0, SHARDS, seed=1, first=0, count=5)
    return older, runner.run(older, warm, first_step=FIRST_STEP - 5)


@pytest.fixture(scope="module")
def start(states: tuple[SegmentState, SegmentState]) -> SegmentState:
    return states[1]


@pytest.fixture
def threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def honest_segment(
    task: ByteGPTTask,
    hyper: dict[str, Any],
    start: SegmentState,
    seed: int,
    *,
    shard: int = 3,
    steps: int = STEPS,
) -> SegmentState:
    batches = segment_batches(task, shard, SHARDS, seed, first=0, count=steps)
    return SegmentRunner(task, hyper).run(start, batches, FIRST_STEP)


def test_a_peers_batches_are_a_function_of_experiment_peer_and_round(task: ByteGPTTask) -> None:
    peer = Identity.from_seed(b"\x01" * 32).peer_id
    other = Identity.from_seed(b"\x02" * 32).peer_id
    seed = round_batch_seed("shoal/x/abc", peer, 4)
    assert seed == round_batch_seed("shoal/x/abc", peer, 4)
    assert len({seed, round_batch_seed("shoal/x/abc", peer, 5),
                round_batch_seed("shoal/x/abc", other, 4),
                round_batch_seed("shoal/x/abd", peer, 4)}) == 4  # fmt: skip
    # Segment 1 of the stream is what a trainer drew after segment 0.
    whole = segment_batches(task, 2, SHARDS, seed, first=0, count=2 * STEPS)
    later = segment_batches(task, 2, SHARDS, seed, first=STEPS, count=STEPS)
    assert all(torch.equal(a, b) for a, b in zip(whole[STEPS:], later, strict=True))


def test_the_same_machine_reproduces_a_segment_bit_for_bit(
    task: ByteGPTTask, hyper: dict[str, Any], start: SegmentState
) -> None:
    a = honest_segment(task, hyper, start, seed=11)
    b = honest_segment(task, hyper, start, seed=11)
    assert a.digest() == b.digest()  # what a checkpoint hash binds
    assert a.digest() != start.digest()
    assert honest_segment(task, hyper, start, seed=12).digest() != a.digest()


def test_a_runner_keeps_no_gradients_or_optimizer_state_between_runs_and_reruns_alike(
    task: ByteGPTTask, hyper: dict[str, Any], start: SegmentState
) -> None:
    """(An auditor's second model: between audits it holds its parameters only, not
    Adam's moments, three times more.)"""
    runner = SegmentRunner(task, hyper)
    batches = segment_batches(task, 3, SHARDS, 11, first=0, count=STEPS)
    first = runner.run(start, batches, FIRST_STEP)
    assert not runner.inner.optimizer.state
    assert all(p.grad is None for p in runner.model.parameters())
    assert runner.run(start, batches, FIRST_STEP).digest() == first.digest()


def test_honest_re_executions_on_other_thread_counts_pass(
    task: ByteGPTTask, hyper: dict[str, Any], start: SegmentState, threads: None
) -> None:
    for i in range(100):
        torch.set_num_threads(1)
        mine = delta(start, honest_segment(task, hyper, start, seed=100 + i))
        torch.set_num_threads(2)
        theirs = delta(start, honest_segment(task, hyper, start, seed=100 + i))
        verdict = judge(mine, theirs, seed=b"fresh %d" % i)
        assert verdict.result is Result.PASS, verdict


CHEATS = (
    "sign_flip",
    "scale_x30",
    "random",
    "zeros",
    "stale_start",
    "fewer_steps",
    "other_shard",
    "noise_1e-2",
)


def cheat(
    name: str,
    task: ByteGPTTask,
    hyper: dict[str, Any],
    states: tuple[SegmentState, SegmentState],
    honest: torch.Tensor,
    seed: int,
) -> torch.Tensor:
    """What a cheater reveals instead of the `honest` pseudo-gradient."""
    older, start = states
    g = torch.Generator().manual_seed(seed)
    if name == "sign_flip":
        return -honest
    if name == "scale_x30":
        return honest * 30
    if name == "random":
        r = torch.randn(honest.shape, generator=g)
        return r * honest.norm() / r.norm()
    if name == "zeros":
        return torch.zeros_like(honest)
    if name == "stale_start":  # trained from an older global state, revealed as if from `start`
        return delta(older, honest_segment(task, hyper, older, seed=seed))
    if name == "fewer_steps":
        return delta(start, honest_segment(task, hyper, start, seed=seed, steps=STEPS - 1))
    if name == "other_shard":
        return delta(start, honest_segment(task, hyper, start, seed=seed, shard=5))
    if name == "noise_1e-2":  # relative noise 1e-2 added to the parameters after every step
        runner = SegmentRunner(task, hyper)
        runner.load(start)
        for i, batch in enumerate(segment_batches(task, 3, SHARDS, seed, first=0, count=STEPS)):
            runner.inner.step(lambda b=batch: task.loss(runner.model, b), FIRST_STEP + i)
            with torch.no_grad():
                for p in runner.model.parameters():
                    n = torch.randn(p.shape, generator=g)
                    p.add_(n * 1e-2 * p.norm() / n.norm())
        return delta(start, runner.capture())
    raise ValueError(name)


@pytest.mark.parametrize("name", CHEATS)
def test_every_cheat_fails_its_audit(
    task: ByteGPTTask, hyper: dict[str, Any], states: tuple[SegmentState, SegmentState], name: str
) -> None:
    policy = AuditPolicy()
    start = states[1]
    for trial in range(100):  # per-audit detection >= 0.999: 100 of 100
        honest = delta(start, honest_segment(task, hyper, start, seed=200 + trial))
        forged = cheat(name, task, hyper, states, honest, seed=200 + trial)
        verdict = judge(forged, honest, seed=b"after the reveal %d" % trial, policy=policy)
        assert verdict.result is Result.FAIL, (name, trial, verdict)
