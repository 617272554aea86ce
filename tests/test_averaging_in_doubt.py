"""A member in doubt: it voted READY and learned no decision before giving up.

Others may have committed with its input, so it must never offer that input
again; it asks the others for their decision once more (Paxos' learner), keeps
accepting proposals (the others may need its acceptance to decide), and its
averager and outer strategy drop the input when the answer stays unknown.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import torch

from shoal.averaging.allreduce import AllReduceConfig
from shoal.averaging.averager import Averager, AveragerConfig, StepResult
from shoal.averaging.commit import (
    READY,
    CommitProtocol,
    Decision,
    Status,
    learned_decision,
    parse_message,
)
from shoal.averaging.diloco import DiLoCo
from shoal.averaging.matchmaking import MatchmakingConfig
from shoal.averaging.outer import RoundOutcome
from shoal.averaging.strategies import make_strategy
from shoal.dht.node import DHTNode
from shoal.transport.host import Host

# ------------------------------------------------------------------------ what is learned

COMMIT_0 = Decision(0, True, "", frozenset({2}))
ABORT_4 = Decision(4, False, "member #0 stalled", frozenset({0}))


def status(decision: Decision | None = None, accepted: Decision | None = None) -> Status:
    return Status(READY, "", (), False, decision, 0, 100, accepted)


def test_a_commit_anyone_decided_is_learned_even_beside_a_higher_abort() -> None:
    """Two sides that suspected each other may both have decided: the side that
    committed holds our input, whatever the other did."""
    assert learned_decision([status(ABORT_4), status(COMMIT_0), status()]) == COMMIT_0


def test_aborts_with_no_commit_in_sight_are_learned_as_the_highest_ballots() -> None:
    abort_0 = Decision(0, False, "vetoed", frozenset())
    assert learned_decision([status(abort_0), status(ABORT_4), status()]) == ABORT_4


def test_an_accepted_undecided_commit_proposal_leaves_the_answer_unknown() -> None:
    """Its decider may have decided it since: a retry with our input is not safe."""
    assert learned_decision([status(ABORT_4), status(accepted=COMMIT_0)]) is None


def test_nothing_is_learned_from_members_that_have_not_decided() -> None:
    assert learned_decision([status(), status()]) is None
    assert learned_decision([]) is None


# ------------------------------------------------------------------------ the state machine


def test_a_member_that_gave_up_in_doubt_still_accepts_and_takes_the_decision() -> None:
    """Member 1 of 2 voted READY; member 0 (the decider) is heard but says nothing
    new for `give_up_after`: 1 gives up in doubt. When 0 then proposes COMMIT, 1
    accepts it (0 needs that to decide) and takes the decision that follows."""
    me = CommitProtocol(2, 1, 0.0, heartbeat_interval=0.5, stall_timeout=5.0, decision_timeout=5.0)
    quiet = ["S", 0, "", [], False, None, 0, 100, None]
    me.ready(0.0)
    t = 0.0
    while not me.decided:
        t += 0.5
        me.on_message(0, *parse_message(quiet, 2), t)
        me.tick(t)
    assert me.decision is not None and me.decision.in_doubt
    assert t >= me.give_up_after
    me.take_messages()  # (heartbeats and the vote, sent while it was running)

    proposing = ["S", 1, "", [], False, None, 0, 100, [0, True, "", []]]
    reply = me.on_message(0, *parse_message(proposing, 2), t + 1)
    assert reply[8] == [0, True, "", []]  # "accepted": our acceptance travels in the reply
    decided = ["S", 1, "", [], False, [0, True, "", []], 0, 100, None]
    me.on_message(0, *parse_message(decided, 2), t + 2)
    assert me.decision == Decision(0, True, "", frozenset())
    assert me.take_messages() == []  # nothing relayed: our driver has stopped sending


# ------------------------------------------------------------------------ over loopback

# The member in doubt gives up 2.3 s after anything last changed (2 x stall + decision);
# the others' data watchdog (1.5 x stall) is 6 s, far beyond.
# The doubter gives up in doubt after 2 x 1.5 + 1 = 4 s without progress, long before
# the patient members would (9 s). A control message it sends still gets a second to
# be answered: with 0.3 s, a loaded CI runner's pause made it suspect a member before
# it had voted READY, and the round aborted instead (a retry, not a doubt).
IMPATIENT = {"heartbeat_interval": 0.05, "stall_timeout": 1.5, "decision_timeout": 1.0}
PATIENT = {"heartbeat_interval": 0.05, "stall_timeout": 4.0, "decision_timeout": 1.0}


async def averagers(
    make_host: Callable[..., Any], configs: list[AllReduceConfig], key: str
) -> tuple[list[Averager], list[DHTNode]]:
    hosts: list[Host] = [await make_host(max_connections_per_ip=10_000) for _ in configs]
    hosts.sort(key=lambda h: h.peer_id)  # a group's members are ordered by peer ID
    dhts: list[DHTNode] = []
    for h in hosts:
        boot = [str(dhts[0].host.addresses()[0])] if dhts else []
        dhts.append(await DHTNode.create(h, bootstrap=boot, hop_timeout=1.0))
    mm = MatchmakingConfig(min_group_size=3, target_group_size=3, matchmaking_time=2.0)
    out = [
        Averager(
            d,
            key,
            [torch.full((1000,), float(i + 1))],
            config=AveragerConfig(matchmaking=mm, allreduce=c, max_retries=3),
        )
        for i, (d, c) in enumerate(zip(dhts, configs, strict=True))
    ]
    return out, dhts


@pytest.fixture
async def closing() -> AsyncIterator[list[Any]]:
    things: list[Any] = []
    yield things
    for a in things:
        await a.aclose()


@pytest.mark.timeout(60)
async def test_in_doubt_the_input_is_dropped_and_never_offered_again_while_the_others_commit(
    make_host: Callable[..., Any], closing: list[Any]
) -> None:
    """The last member (not the decider) gives up in doubt while the others hold
    back their READY votes; asked, they have not decided, so its step ends with its
    input discarded and no retry. Released, the others still commit, with its input
    and its acceptance: its input is counted exactly once, by them."""
    gave_up = asyncio.Event()

    async def hold_ready(point: str) -> None:
        if point == "before_ready":
            await gave_up.wait()

    patient = AllReduceConfig(fault_hook=hold_ready, **PATIENT)
    configs = [patient, patient, AllReduceConfig(**IMPATIENT)]
    avgs, dhts = await averagers(make_host, configs, "in-doubt")
    closing.extend(avgs + dhts)
    *others, doubter = avgs
    input_before = doubter.tensors[0].clone()

    async def doubter_step() -> StepResult:
        try:
            return await doubter.step(timeout=30.0)
        finally:
            gave_up.set()

    results = await asyncio.gather(doubter_step(), *(a.step(timeout=30.0) for a in others))
    mine, *theirs = results
    assert mine.discarded and not mine.committed and not mine.resynced
    assert mine.reason.startswith("in doubt"), mine.reason
    assert mine.attempts == 1 and mine.aborted_rounds == ()  # never offered again
    assert torch.equal(doubter.tensors[0], input_before)
    assert doubter.commits == 0
    me = doubter.dht.host.peer_id
    for r in theirs:
        assert r.committed and r.group_size == 3, r.reason
        assert r.weights.get(me) == 1.0  # our input is in their result, once
    assert all(torch.allclose(a.tensors[0], torch.full((1000,), 2.0)) for a in others)


# ------------------------------------------------------------------------ the strategy


@pytest.mark.timeout(30)
async def test_diloco_drops_a_discarded_input_and_counts_its_next_one_from_there(
    make_host: Callable[..., Any], closing: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step that ends with the input discarded leaves the parameters back on the
    globals (the work may be in the swarm's state already) and the round's ledger
    says no inner step was contributed; the next round's input starts from there."""
    host = await make_host()
    dht = await DHTNode.create(host, bootstrap=[], hop_timeout=1.0)
    closing.append(dht)
    params = [torch.zeros(8), torch.zeros(3, 4)]
    strategy = make_strategy("diloco", dht, "exp/doubt", params, {"inner_steps": 2})
    assert isinstance(strategy, DiLoCo)
    closing.append(strategy)
    await strategy.start(join=False)
    globals_before = [g.clone() for g in strategy.globals]
    in_doubt = StepResult(False, "in doubt: voted READY but learned no decision", discarded=True)

    async def step_in_doubt(weight: float = 1.0, *, timeout: float | None = None) -> StepResult:
        return in_doubt

    monkeypatch.setattr(strategy.averager, "step", step_in_doubt)
    reports = []
    for _ in range(2):
        with torch.no_grad():
            for p in params:
                p.add_(1.0)
        reports += await strategy.after_inner_step(8)
    (report,) = reports
    assert report.outcome is RoundOutcome.ABORTED and report.detail == in_doubt.reason
    assert report.contribution == (2, 2)  # nothing contributed: the work is dropped
    assert strategy.samples_since_sync == 0 and strategy.synced_at_step == 2
    assert all(torch.equal(p, g) for p, g in zip(params, globals_before, strict=True))
    assert all(torch.equal(g, b) for g, b in zip(strategy.globals, globals_before, strict=True))
