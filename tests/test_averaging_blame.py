"""Whom a retry leaves out after an abort: a veto's blame is its vetoer's word.

A member that vetoes names whom it blames (a member it lost, one that sent it
invalid data). Believed by everyone, a lone liar could keep an honest member out
of every retry of a step, a new one each time. So each member judges the blame
itself (`Votes.blame`, then a ping in `StepRunner`): what it saw itself, what two
vetoers agree on and a veto against itself are believed; a lone vetoer's word
about a member that still answers us costs both of them their place.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
import torch

from shoal.averaging.allreduce import AllReduceConfig
from shoal.averaging.averager import Averager, AveragerConfig
from shoal.averaging.commit import CommitProtocol
from shoal.averaging.matchmaking import MatchmakingConfig
from shoal.averaging.votes import READY, VETO, Votes
from shoal.dht.node import DHTNode

FAST = {"heartbeat_interval": 0.05, "stall_timeout": 1.0, "decision_timeout": 0.3}


def votes_with(*vetoes: tuple[int, tuple[int, ...]]) -> Votes:
    v = Votes()
    for src, blamed in vetoes:
        v.heard(src, VETO, "member sent invalid data", blamed, True, 0.0)
    return v


def test_what_we_saw_ourselves_is_left_out_without_asking() -> None:
    blame = votes_with().blame(me=0, ours={2, 3, 0})
    assert blame.certain == {2, 3} and dict(blame.contested) == {}


def test_a_lone_vetoers_blame_is_contested_with_its_vetoer_named() -> None:
    blame = votes_with((1, (2,))).blame(me=0, ours=())
    assert blame.certain == frozenset() and dict(blame.contested) == {2: {1}}


def test_two_vetoers_blaming_one_member_are_believed() -> None:
    blame = votes_with((1, (3,)), (2, (3,))).blame(me=0, ours=())
    assert blame.certain == {3} and dict(blame.contested) == {}


def test_a_veto_blaming_us_leaves_its_vetoer_out() -> None:
    blame = votes_with((1, (0,))).blame(me=0, ours=())
    assert blame.certain == {1} and dict(blame.contested) == {}


def test_a_blame_of_what_we_already_suspect_needs_no_asking() -> None:
    blame = votes_with((1, (2,))).blame(me=0, ours={2})
    assert blame.certain == {2} and dict(blame.contested) == {}


def test_members_named_only_by_the_decision_are_asked_with_nobody_to_blame() -> None:
    # (A veto that never reached us: only the decider's failed set names them.)
    v = votes_with()
    v.heard(3, READY, "", (), False, 0.0)
    blame = v.blame(me=0, ours=(), decided_failed={2, 0})
    assert blame.certain == frozenset() and dict(blame.contested) == {2: frozenset()}


@pytest.mark.timeout(90)
async def test_a_liars_veto_blaming_an_honest_member_costs_the_liar_its_place_too(
    make_host: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four peers; one vetoes every round it is in, blaming an honest member it names
    at random (it claims that member sent it invalid data). The honest members it
    did not blame leave both out and commit among themselves at the first retry;
    before, they believed the blame, retried with the liar, which then blamed the
    next one, and no honest pair ever committed."""
    hosts = sorted([await make_host(max_connections_per_ip=10_000) for _ in range(4)],
                   key=lambda h: h.peer_id)  # fmt: skip
    dhts: list[DHTNode] = []
    for h in hosts:
        boot = [str(dhts[0].host.addresses()[0])] if dhts else []
        dhts.append(await DHTNode.create(h, bootstrap=boot, hop_timeout=1.0))
    liar = hosts[-1].peer_id.short()
    blamed: list[str] = []
    honest_ready = CommitProtocol.ready

    def lie_instead_of_voting_ready(self: CommitProtocol, now: float, results: bytes) -> None:
        if self.names[self.me] != liar:
            return honest_ready(self, now, results)
        j = min(j for j in range(self.n) if j != self.me)
        blamed.append(self.names[j])
        return self.fail(f"member {self.names[j]} sent invalid data", (j,), now)

    monkeypatch.setattr(CommitProtocol, "ready", lie_instead_of_voting_ready)
    mm = MatchmakingConfig(min_group_size=2, target_group_size=4, matchmaking_time=2.0)
    avgs = [
        Averager(d, "blame", [torch.full((1000,), float(i + 1))],
                 config=AveragerConfig(matchmaking=mm, allreduce=AllReduceConfig(**FAST),
                                       max_retries=3))
        for i, d in enumerate(dhts)
    ]  # fmt: skip
    try:
        results = await asyncio.gather(*(a.step(timeout=8.0) for a in avgs))
        assert blamed, "the liar was never in a round"
        first_blamed = blamed[0]
        by_name = {h.peer_id.short(): r for h, r in zip(hosts, results, strict=True)}
        full = {h.peer_id.short(): str(h.peer_id) for h in hosts}
        assert not by_name[liar].committed
        others = [r for name, r in by_name.items() if name not in (liar, first_blamed)]
        for r in others:
            assert r.committed and r.group_size == 2, (r.reason, r.attempt_log)
            first, second = r.attempt_log
            assert first.group_size == 4 and "sent invalid data" in first.outcome
            # Both the liar and the member it blamed were left out of the retry.
            assert set(second.excluded) == {full[liar], full[first_blamed]}
        # The pair committed the mean of their own inputs: nothing of the two left out.
        pair = [a for h, a in zip(hosts, avgs, strict=True)
                if h.peer_id.short() not in (liar, first_blamed)]  # fmt: skip
        assert torch.equal(pair[0].tensors[0], pair[1].tensors[0])
    finally:
        for a in avgs:
            await a.aclose()
        for d in dhts:
            await d.aclose()
