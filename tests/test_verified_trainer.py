"""A verified trainer's work log follows what its strategy does to the parameters.

A round's work starts from the global state, and every segment of it must be
recomputable from its revealed start. When the strategy sets the parameters
back to the global state in the middle of a round without a commit (a re-sync
that loaded a state of the same version: two groups committed the same round,
and ours lost), the steps before are gone: the round's work starts again, with
its batch stream from the beginning, and every segment of the re-run passes
its audit. Between the reset and the new run (where DiLoCo's catch-up round
runs), there is no current work: members' commitments are not checked
against a run from a state we no longer hold. (The CI soak convicted an honest
peer when the log went on across such a reset: the segment after it was
recomputed from a state the parameters no longer held, "959 of 1408 bits
differ"; and members refused each other's input, "work started from another
global state".)
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from shoal.averaging.group import Group, Member, make_round_id
from shoal.averaging.outer import RoundOutcome, RoundReport
from shoal.peer.trainer import Trainer, check_hyperparameters
from shoal.peer.training.state_codes import code_state
from shoal.peer.training.task import load_task, shard_of
from shoal.peer.verify.audit_round import AuditRound, RoundShape, check_segment
from shoal.peer.verify.rebuild import EMPTY_OPTIMIZER, rebuild_start
from shoal.peer.verify.reveals import Replay, reveal_of
from shoal.peer.verify.segments import SegmentRunner, params_hash
from shoal.peer.verify.work_log import VerifiedWork, WorkLog
from shoal.transport.identity import Identity
from shoal.verification.audit import AuditPolicy
from shoal.verification.commitment import Commitment
from shoal.verification.evidence import Result
from shoal.verification.referees import RoundDraw, new_secret, seed_commit

pytestmark = pytest.mark.timeout(120)

NS = "shoal/x/reset"
ROUND = 5
EVERY = 3
RESET_AT = 6  # inner steps before the re-sync: two whole segments
AFTER = 7  # inner steps after it: two segments and a sealed tail of 1
TINY = {"d_model": 16, "n_layers": 1, "n_heads": 2, "context": 16, "batch_size": 2}


class ResyncingStrategy:
    """A strategy in a round of version `ROUND` that, after `RESET_AT` inner steps,
    sets the parameters back to the global state without a commit, as DiLoCo does
    when its round ends in a re-sync to a state of the same version."""

    name = "diloco"
    outer_steps = ROUND

    def __init__(self, params: list[torch.Tensor], stop: asyncio.Event) -> None:
        self.params = params
        self.globals = [p.detach().clone() for p in params]
        self.stop = stop
        self.inner_steps = 0
        self.resets = 0
        self.work: VerifiedWork | None = None
        self.work_during_reset: Any = "never asked"

    async def after_inner_step(self, samples: int) -> list[RoundReport]:
        self.inner_steps += 1
        if self.inner_steps == RESET_AT:
            with torch.no_grad():
                for p, g in zip(self.params, self.globals, strict=True):
                    p.copy_(g)
            self.resets += 1
            # Where DiLoCo's catch-up round runs, and members' commitments are checked
            # against our work: the run before the reset is not from the state held now.
            assert self.work is not None
            self.work_during_reset = self.work.current()
        if self.inner_steps == RESET_AT + AFTER:
            self.stop.set()
        return []

    async def finish(self) -> None:
        pass


def commitment_of(work: Any, me: Identity, final: torch.Tensor, shape: RoundShape) -> tuple:  # type: ignore[type-arg]
    start = work.snapshots[0]
    secret = new_secret()
    c = Commitment(
        NS, me.peer_id, ROUND, work.start_params, work.start_optimizer, work.first_step,
        work.steps, EVERY, work.commit_checkpoints(), shape.delta_root(start.flat() - final),
        1, b"", seed_commit(secret),
    ).signed(me)  # fmt: skip
    return c, secret


async def train_through_a_resync(
    task: Any, hyper: dict[str, Any], me: Identity
) -> tuple[Trainer, ResyncingStrategy, VerifiedWork]:
    """A verified trainer run through `ResyncingStrategy`'s round, its end sealed."""
    model = task.make_model(0)
    stop = asyncio.Event()
    strategy = ResyncingStrategy(list(model.parameters()), stop)
    log = WorkLog(EVERY)
    shard = shard_of(me.peer_id.to_bytes(), hyper["num_shards"])
    work_of = VerifiedWork(log, NS, me.peer_id, shard, lambda: strategy.outer_steps,
                           lambda: strategy.resets)  # fmt: skip
    strategy.work = work_of
    trainer = Trainer(task, model, strategy, hyper,  # type: ignore[arg-type]
                      shard=work_of.shard, seed=0, work=work_of)  # fmt: skip
    try:
        await asyncio.wait_for(trainer.run(stop), 60)
        await asyncio.get_running_loop().run_in_executor(
            trainer._worker, lambda: log.seal(model, trainer.inner)
        )
    finally:
        trainer.close()
    return trainer, strategy, work_of


# The inner optimizer's state stays the peer's own through a re-sync (only the
# parameters are set back): audits of the re-run reproduce it, AdamW's or SGD's.
@pytest.mark.parametrize(
    "inner_optimizer", [{"name": "AdamW"}, {"name": "SGD", "momentum": 0.9}], ids=["AdamW", "SGD"]
)
async def test_a_reset_to_the_global_state_mid_round_starts_the_rounds_work_again(
    inner_optimizer: dict[str, Any],
) -> None:
    task = load_task("bytegpt", dict(TINY))
    hyper = check_hyperparameters({"warmup_steps": 0, "inner_optimizer": inner_optimizer})
    me = Identity.from_seed(b"r" * 32)
    shards = hyper["num_shards"]
    trainer, strategy, work_of = await train_through_a_resync(task, hyper, me)
    model, log = trainer.model, work_of.log
    work = log.current
    assert work is not None and work.round == ROUND
    assert type(trainer.optimizer).__name__ == inner_optimizer["name"]
    assert (work.first_step, work.steps) == (RESET_AT, AFTER), "the work restarted at the reset"
    assert work.start_params == params_hash(strategy.globals), "from the global state"
    assert strategy.work_during_reset is None, "the stale run is not the current work"
    assert work_of.current() is work

    group = Group("k", make_round_id("k", [me.peer_id], b"n"), (Member(me.peer_id),))
    shape = RoundShape.of(group, 1, 4096, "none")
    final = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    c, secret = commitment_of(work, me, final, shape)
    draw = RoundDraw.from_reveals([c], {me.peer_id: secret})
    rnd = AuditRound(ROUND, shape, {me.peer_id: c}, {me.peer_id: secret}, draw, strategy.globals)
    replay = Replay(SegmentRunner(task, hyper), task, work_of, shards)
    for segment in range(c.segments):
        first, end = c.segment_bounds(segment)
        reveal = reveal_of(replay.state_after(work, first), replay.state_after(work, end),
                           replay.state_after(work, work.steps))  # fmt: skip
        finding = check_segment(SegmentRunner(task, hyper), task, shards, NS, rnd, c, segment,
                                reveal, b"seed", AuditPolicy())  # fmt: skip
        assert finding.result is Result.PASS and finding.flips == 0, (segment, finding)


@pytest.mark.parametrize("inner_state", ["carry", "reset", "quantize"])
async def test_a_reset_inner_state_starts_each_rounds_work_from_a_state_its_referees_rebuild(
    inner_state: str,
) -> None:
    """With `inner_state` "reset" the work after the re-sync starts with no optimizer
    state at all (what a referee can rebuild: the global state and nothing else), and
    every segment's start is rebuilt bit for bit from it; "quantize" keeps the moments
    of the steps before, rounded to codes, from which every start is rebuilt too;
    "carry" keeps them as they are, which only the prover holds."""
    task = load_task("bytegpt", dict(TINY))
    hyper = check_hyperparameters({"warmup_steps": 0, "inner_state": inner_state})
    me = Identity.from_seed(b"s" * 32)
    shards = hyper["num_shards"]
    trainer, strategy, work_of = await train_through_a_resync(task, hyper, me)
    model = trainer.model
    work = work_of.log.current
    assert work is not None and work.first_step == RESET_AT
    assert (work.start_optimizer == EMPTY_OPTIMIZER) is (inner_state == "reset")
    began = Replay(SegmentRunner(task, hyper), task, work_of, shards).state_after(work, 0)
    moments = code_state(began.optimizer["optimizer"]["state"])
    assert (moments is not None) is (inner_state != "carry")

    group = Group("k", make_round_id("k", [me.peer_id], b"n"), (Member(me.peer_id),))
    shape = RoundShape.of(group, 1, 4096, "none")
    final = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    c, secret = commitment_of(work, me, final, shape)
    draw = RoundDraw.from_reveals([c], {me.peer_id: secret})
    rnd = AuditRound(ROUND, shape, {me.peer_id: c}, {me.peer_id: secret}, draw, strategy.globals)
    template = SegmentRunner(task, hyper).inner.state_dict()
    for segment in range(c.segments):
        start = rebuild_start(SegmentRunner(task, hyper), task, shards, NS, rnd, c, segment,
                              template, moments or None)  # fmt: skip
        if inner_state == "carry":
            assert start is None
        else:
            assert start is not None and start.digest() == c.segment_start(segment), segment


def test_an_inner_state_other_than_carry_reset_or_quantize_is_refused() -> None:
    with pytest.raises(ValueError, match="inner_state must be one of carry, reset, quantize"):
        check_hyperparameters({"inner_state": "keep"})
    assert check_hyperparameters({})["inner_state"] == "carry"


class CommittingStrategy:
    """An unverified strategy whose round commits after every `H` inner steps; it
    records AdamW's step count of the first parameter after each inner step."""

    name = "diloco"
    H = 4

    def __init__(self, stop: asyncio.Event) -> None:
        self.stop = stop
        self.optimizer: torch.optim.Optimizer | None = None
        self.inner_steps = 0
        self.outer_steps = 0
        self.adam_steps: list[int] = []

    async def after_inner_step(self, samples: int) -> list[RoundReport]:
        self.inner_steps += 1
        assert self.optimizer is not None
        first = next(iter(self.optimizer.state.values()))
        self.adam_steps.append(int(first["step"]))
        if self.inner_steps == 3 * self.H:
            self.stop.set()
        if self.inner_steps % self.H:
            return []
        self.outer_steps += 1
        return [RoundReport(self.outer_steps, RoundOutcome.COMMITTED, "", 2, 0.1, "f", 0)]

    async def finish(self) -> None:
        pass


@pytest.mark.parametrize("inner_state", ["carry", "reset", "quantize"])
async def test_an_unverified_trainer_resets_its_inner_state_at_each_new_global_state(
    inner_state: str,
) -> None:
    """Without a work log, "reset" starts the optimizer afresh after every round that
    changed the model (a commit or a re-sync); "carry" keeps counting, and so does
    "quantize", whose moments are rounded to codes there (the last round committed)."""
    task = load_task("bytegpt", dict(TINY))
    hyper = check_hyperparameters({"warmup_steps": 0, "inner_state": inner_state})
    model = task.make_model(0)
    stop = asyncio.Event()
    strategy = CommittingStrategy(stop)
    trainer = Trainer(task, model, strategy, hyper, shard=0, seed=0)  # type: ignore[arg-type]
    strategy.optimizer = trainer.optimizer
    try:
        await asyncio.wait_for(trainer.run(stop), 60)
    finally:
        trainer.close()
    if inner_state == "reset":
        assert strategy.adam_steps == [1, 2, 3, 4] * 3
    else:
        assert strategy.adam_steps == list(range(1, 13))
    rounded = bool(code_state(trainer.optimizer.state_dict()["state"]))  # (reset: empty)
    assert rounded is (inner_state == "quantize")
