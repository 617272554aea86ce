"""A referee rebuilds a segment's start instead of reading it from the prover.

A round whose work started from a fresh inner optimizer (`inner_state` "reset")
starts from the round's global state, which the referee holds: re-running the
prover's own batches up to the drawn segment reaches the prover's start bit for
bit, and the audit then needs no more than a header from the prover. Whatever
the referee cannot vouch for (a carried optimizer state, another global state,
a checkpoint the prover's steps do not reach) gives no rebuilt start: the
referee asks for the whole reveal, as before. On the wire, a 2.7 prover
withholds the start only when asked; a 2.6 prover sends it anyway and the
asker reads it."""

from __future__ import annotations

import copy
import hashlib
from typing import Any

import pytest
import torch
from verification_round import proved_round

from shoal.peer.trainer import check_hyperparameters
from shoal.peer.training.task import load_task
from shoal.peer.verify.audit_round import AuditRound, check_segment_exact
from shoal.peer.verify.rebuild import EMPTY_OPTIMIZER, rebuild_start, rebuildable
from shoal.peer.verify.reveals import (
    Replay,
    Reveal,
    RevealError,
    fetch_reveal,
    reveal_of,
    send_reveal,
)
from shoal.peer.verify.segments import SegmentRunner, SegmentState
from shoal.peer.verify.verifier import parse_reveal_parts
from shoal.transport import rpc
from shoal.transport.host import Host, HostConfig
from shoal.transport.identity import Identity
from shoal.verification.commitment import Commitment
from shoal.verification.evidence import Result

pytestmark = pytest.mark.timeout(120)

NS = "shoal/x/rebuild"
ROUND = 3
SHARDS = 8
EVERY = 3
STEPS = 8  # two full segments and a sealed tail of 2


@pytest.fixture(scope="module")
def task():  # type: ignore[no-untyped-def]
    return load_task("bytegpt", {"d_model": 16, "n_layers": 1, "n_heads": 2, "context": 16,
                                 "batch_size": 2})  # fmt: skip


def prove(task, *, carried: bool = False):  # type: ignore[no-untyped-def]
    """A verified round of a prover whose optimizer starts fresh, as a reset leaves it
    (`carried`: with the moments of a step taken before the round, as "carry" keeps)."""
    hyper = check_hyperparameters({"warmup_steps": 0, "inner_state": "reset"})
    me = Identity.from_seed(hashlib.sha256(b"rebuild prover").digest())
    work, verified, c, rnd, runner = proved_round(
        task, hyper, me, namespace=NS, shards=SHARDS, every=EVERY, round_index=ROUND,
        steps=STEPS, steps_before=1 if carried else 0,
    )  # fmt: skip
    return hyper, work, verified, c, rnd, runner.inner.state_dict()


def rebuilt(task, hyper, rnd: AuditRound, c: Commitment, segment: int, template):  # type: ignore[no-untyped-def]
    return rebuild_start(SegmentRunner(task, hyper), task, SHARDS, NS, rnd, c, segment, template)


@pytest.mark.parametrize("segment", [0, 1, 2])
def test_a_reset_round_s_start_is_rebuilt_bit_for_bit_and_its_audit_needs_no_state(  # type: ignore[no-untyped-def]
    task, segment: int
) -> None:
    hyper, work, verified, c, rnd, template = prove(task)
    assert c.optimizer == EMPTY_OPTIMIZER and rebuildable(c)
    start = rebuilt(task, hyper, rnd, c, segment, template)
    assert start is not None and start.digest() == c.segment_start(segment)
    # The prover's own state there is the same, bit for bit.
    replay = Replay(SegmentRunner(task, hyper), task, verified, SHARDS)
    first, end = c.segment_bounds(segment)
    own = replay.state_after(work, first)
    assert all(torch.equal(a, b) for a, b in zip(start.params, own.params, strict=True))
    # The audit from the rebuilt start and a reveal of neither start nor end: a pass.
    reveal = reveal_of(None, replay.state_after(work, end), with_end=False)
    reveal.start = start
    finding = check_segment_exact(SegmentRunner(task, hyper), task, SHARDS, NS, rnd, c, segment,
                                  reveal, consume=True)  # fmt: skip
    assert finding.result is Result.PASS and "bit for bit" in finding.why, finding


def test_a_carried_optimizer_state_is_not_rebuilt(task) -> None:  # type: ignore[no-untyped-def]
    """The moments a prover carried into the round are its own: nobody else holds them."""
    hyper, _, _, c, rnd, template = prove(task, carried=True)
    assert not rebuildable(c)
    assert rebuilt(task, hyper, rnd, c, 1, template) is None


def test_a_prover_whose_checkpoint_its_steps_do_not_reach_has_its_start_fetched(task) -> None:  # type: ignore[no-untyped-def]
    """A prover that lied before the drawn segment (or a machine that rounds otherwise):
    the state the referee reaches is not the committed one, and it proves nothing
    either way; the referee then asks for the whole reveal."""
    hyper, _, _, c, rnd, template = prove(task)
    checkpoints = list(c.checkpoints)
    checkpoints[0] = hashlib.sha256(b"another state").digest()
    lied = Commitment(**{**c.__dict__, "checkpoints": tuple(checkpoints), "signature": b""})
    assert rebuilt(task, hyper, rnd, lied, 1, template) is None
    assert rebuilt(task, hyper, rnd, lied, 0, template) is not None  # (before the lie)


def test_a_round_that_started_elsewhere_than_our_global_state_is_not_rebuilt(task) -> None:  # type: ignore[no-untyped-def]
    hyper, _, _, c, rnd, template = prove(task)
    assert isinstance(rnd.start_params, list) or callable(rnd.start_params)
    params = rnd.start_params if isinstance(rnd.start_params, list) else rnd.start_params()
    other = copy.copy(rnd)
    other.start_params = [p + 1 for p in params]
    assert rebuilt(task, hyper, other, c, 0, template) is None


def test_a_reveal_request_says_whether_the_start_goes_with_it() -> None:
    """Before 2.7 a request says nothing of the start: it goes."""
    assert parse_reveal_parts({"round": 3, "segment": 1}) == (True, False, True)
    assert parse_reveal_parts({"end": False, "start": False}) == (False, False, False)
    with pytest.raises(ValueError):
        parse_reveal_parts({"start": "no"})


def _state(model: torch.nn.Module) -> SegmentState:
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    return SegmentState([p.detach().clone() for p in model.parameters()],
                        {"optimizer": opt.state_dict(), "grad_scaler": None})  # fmt: skip


@pytest.mark.asyncio
@pytest.mark.parametrize("prover_withholds", [True, False], ids=["2.7", "2.6"])
async def test_a_start_is_withheld_only_when_asked_and_said(prover_withholds: bool) -> None:
    """A 2.7 prover asked without the start sends a header and no state; a 2.6 prover
    sends it anyway, and the asker reads it. A header that withholds the start but
    names optimizer state is malformed."""
    model = torch.nn.Linear(4, 2)
    start = _state(model)
    config = HostConfig(listen=("/ip4/127.0.0.1/tcp/0",))
    referee = Host(Identity.generate(), config)
    prover = Host(Identity.generate(), config)
    asked: list[Any] = []
    malformed = [False]

    @rpc.RpcService(prover, "/shoal/audit/1.0.0").stream("reveal")
    async def reveal(ctx: rpc.CallContext, payload: Any) -> Any:
        asked.append(payload)
        _, _, with_start = parse_reveal_parts(payload)
        sent = Reveal(None if prover_withholds and not with_start else start, None, b"e" * 32,
                      parameters=len(start.params))  # fmt: skip
        if malformed[0]:
            await ctx.send_item({"params": 2, "keys": [[0, "exp_avg"]], "end_opt": b"e" * 32,
                                 "start": False, "end": False})  # fmt: skip
        else:
            await send_reveal(ctx, sent)
        yield {"done": True}

    try:
        await referee.start()
        await prover.start()
        await referee.connect(prover.addresses()[0])
        template = {"optimizer": start.optimizer["optimizer"], "grad_scaler": None}
        shapes = [p.shape for p in model.parameters()]
        got = await fetch_reveal(referee, prover.peer_id, 1, 0, template, shapes, timeout=10,
                                 end=False, start=False)  # fmt: skip
        assert asked[0]["start"] is False
        if prover_withholds:
            assert got.start is None
        else:
            assert got.start is not None and got.start.digest() == start.digest()
        whole = await fetch_reveal(referee, prover.peer_id, 1, 0, template, shapes, timeout=10,
                                   end=False)  # fmt: skip
        assert "start" not in asked[1] and whole.start is not None
        assert whole.start.digest() == start.digest()
        if prover_withholds:
            malformed[0] = True
            with pytest.raises(RevealError):
                await fetch_reveal(referee, prover.peer_id, 1, 0, template, shapes,
                                   timeout=10, end=False, start=False)  # fmt: skip
    finally:
        await referee.aclose()
        await prover.aclose()
