"""The pieces of an all-reduce round that need no network: the lane reducer (which
chunk can be reduced, in which order), the pluggable reductions, and the one table
that says what an error means on each side of a round; and the deadline that every
stage of a step (matchmaking, the round, a re-sync) shares."""

from __future__ import annotations

import asyncio

import pytest
import torch

from shoal.averaging.compression import get_codec
from shoal.averaging.deadline import Deadline
from shoal.averaging.reducer import CenteredClip, LaneReducer, WeightedMean, make_reduction
from shoal.averaging.round_errors import Action, Side, Veto, classify
from shoal.transport.errors import (
    ConnectionLost,
    ProtocolNotSupported,
    ProtocolViolation,
    RemoteError,
    RpcTimeout,
    StreamReset,
)
from shoal.verification.robust import centered_clip

CHUNKS = [(0, 4), (4, 8), (8, 10)]


def reducer(me: int = 1, window: int = 2, weight: float = 1.0) -> LaneReducer:
    return LaneReducer(me, CHUNKS, senders=[0, 2], window=window, weight=weight)


def test_nothing_is_reduced_before_every_sender_attached() -> None:
    r = reducer()
    assert r.attach(0, 1.0) is None
    r.arrived(0, 0)
    assert r.next_job() is None  # member 2 has not attached
    assert r.attach(2, 3.0) is None
    assert r.next_job() is None  # attached, but its chunk 0 is not here
    r.arrived(2, 0)
    job = r.next_job()
    assert job is not None and job.index == 0 and job.span == (0, 4)
    # Member order, weights normalized by the group's total.
    assert job.order == ((0, 0.2), (1, 0.2), (2, 0.6))


def test_a_robust_lane_counts_no_weight_above_twice_the_median() -> None:
    r = LaneReducer(1, CHUNKS, senders=[0, 2, 3], window=2, weight=2.0, caps_weights=True)
    r.attach(0, 1e12)  # the liar
    r.attach(2, 2.0)
    r.attach(3, 0.0)  # a member that brings nothing stays out of the median
    for i in (0, 2):
        r.arrived(i, 0)
    job = r.next_job()
    assert job is not None and job.order == ((0, 0.5), (1, 0.25), (2, 0.25))
    plain = reducer()
    plain.attach(0, 1e12)
    plain.attach(2, 2.0)
    plain.arrived(0, 0)
    plain.arrived(2, 0)
    assert plain.next_job().order[0][1] > 0.999  # type: ignore[union-attr]


def test_an_owner_written_lane_waits_for_every_sender_to_attach_but_for_no_data() -> None:
    """The union of slots: the others' contributions to our part are zeros, so they
    attach (their weights, which is how a member that never came is noticed) and send
    nothing; the part is our own input alone, even when our weight is 0."""
    r = LaneReducer(1, CHUNKS, senders=[0, 2], window=2, weight=0.0, owner_written=True)
    assert r.attach(0, 1.0) is None
    assert r.next_job() is None  # member 2 has not attached
    assert r.attach(2, 3.0) is None
    assert not r.contributes(0) and not r.contributes(2)
    for c in range(len(CHUNKS)):
        job = r.next_job()
        assert job is not None and job.index == c and job.order == ((1, 1.0),)
        r.finished(c)
    assert r.complete
    nobody = LaneReducer(1, CHUNKS, senders=[0], window=2, weight=0.0, owner_written=True)
    nobody.attach(0, 0.0)
    with pytest.raises(Veto):
        nobody.next_job()  # a group with nothing to average vetoes, as any round


def test_chunks_are_reduced_in_order_whatever_order_they_arrive_in() -> None:
    r = reducer(window=3)
    r.attach(0, 1.0)
    r.attach(2, 1.0)
    r.arrived(2, 0)
    r.arrived(2, 1)
    r.arrived(0, 0)
    assert r.next_job().index == 0  # type: ignore[union-attr]
    r.finished(0)
    assert r.next_job() is None  # chunk 1 of member 0 is missing
    r.arrived(0, 1)
    assert r.next_job().index == 1  # type: ignore[union-attr]


def test_a_slot_is_reused_only_after_the_chunk_it_held_was_reduced() -> None:
    r = reducer(window=2)
    r.attach(0, 1.0)
    r.attach(2, 1.0)
    assert r.slot(0) == r.slot(2) != r.slot(1)
    assert r.slot_free_after(2) == 1  # chunk 2 needs chunk 0 reduced
    r.arrived(0, 0)
    r.arrived(0, 1)
    with pytest.raises(AssertionError):
        r.arrived(0, 2)  # its slot still holds chunk 0


def test_members_of_weight_zero_are_not_waited_for_nor_averaged() -> None:
    r = reducer()
    r.attach(0, 0.0)
    r.attach(2, 1.0)
    r.arrived(2, 0)
    job = r.next_job()
    assert job is not None and job.order == ((1, 0.5), (2, 0.5))


def test_a_group_of_total_weight_zero_vetoes() -> None:
    r = reducer(weight=0.0)
    r.attach(0, 0.0)
    r.attach(2, 0.0)
    with pytest.raises(Veto, match="total weight"):
        r.next_job()


def test_a_second_weight_from_the_same_member_is_a_problem() -> None:
    r = reducer()
    assert r.attach(0, 1.0) is None
    assert r.attach(0, 2.0) == "inconsistent weight"


def test_the_lane_is_complete_after_its_last_chunk() -> None:
    r = reducer(window=3)
    r.attach(0, 1.0)
    r.attach(2, 1.0)
    for c in range(3):
        r.arrived(0, c)
        r.arrived(2, c)
        assert not r.complete
        r.finished(r.next_job().index)  # type: ignore[union-attr]
    assert r.complete and r.next_job() is None


def test_the_mean_is_float64_in_member_order_rounded_once() -> None:
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(1000, generator=g) * 10**k for k in range(3)]
    ws = [0.5, 0.25, 0.25]
    out = torch.empty(1000)
    WeightedMean().reduce(list(zip(xs, ws, strict=True)), out, get_codec("none"),
                          torch.empty(300, dtype=torch.float64))  # fmt: skip
    expect = sum(x.double() * w for x, w in zip(xs, ws, strict=True))
    assert torch.equal(out, expect.float())  # type: ignore[union-attr]


def test_centered_clip_bounds_a_scaled_contribution_and_matches_its_definition() -> None:
    g = torch.Generator().manual_seed(1)
    honest = [torch.randn(64, generator=g) * 0.01 + 1.0 for _ in range(4)]
    attacker = honest[0] * -100.0
    xs = [*honest, attacker]
    ws = [0.2] * 5
    out = torch.empty(64)
    CenteredClip().reduce(list(zip(xs, ws, strict=True)), out, get_codec("none"), None)
    assert torch.equal(out, centered_clip(xs, ws))
    assert (out - 1.0).abs().max() < 0.5  # the mean would sit near -19
    assert make_reduction("centered_clip").name == "centered_clip"
    with pytest.raises(ValueError):
        make_reduction("median-of-means")


@pytest.mark.parametrize(
    ("error", "side", "action", "blame"),
    [
        (ProtocolViolation("bad frame"), Side.SEND, Action.VETO, True),
        (ProtocolViolation("bad frame"), Side.SERVE, Action.VETO, True),
        (ProtocolNotSupported("no handler"), Side.SEND, Action.VETO, True),
        (StreamReset("gave up"), Side.SEND, Action.VETO, False),
        (StreamReset("gave up"), Side.SERVE, Action.VETO_IF_NEEDED, False),
        (RemoteError("UnknownRound", "x"), Side.SEND, Action.VETO, True),
        (RemoteError("RoundOver", "x"), Side.SEND, Action.VETO, False),
        (RemoteError("BadRequest", "x"), Side.SEND, Action.VETO, False),
        (RemoteError("BadRequest", "x"), Side.CONTROL, Action.IGNORE, False),
        (ConnectionLost("closed"), Side.SEND, Action.SUSPECT, False),
        (ConnectionLost("closed"), Side.SERVE, Action.SUSPECT, False),
        (RpcTimeout("slow"), Side.CONTROL, Action.SUSPECT, False),
        (OSError("unreachable"), Side.SEND, Action.SUSPECT, False),
        (KeyError("a bug"), Side.SEND, Action.RAISE, False),
        (asyncio.CancelledError(), Side.SERVE, Action.RAISE, False),
    ],
)
def test_one_table_says_what_an_error_means_on_each_side(
    error: BaseException, side: Side, action: Action, blame: bool
) -> None:
    verdict = classify(error, side, "peer7")
    assert (verdict.action, verdict.blame) == (action, blame)
    if action in (Action.VETO, Action.VETO_IF_NEEDED):
        assert verdict.reason.startswith("member peer7 ")
    if action is Action.SUSPECT:
        assert "peer7" not in verdict.reason  # the commit protocol names the member


def test_a_timeout_of_a_control_message_reads_as_stalled() -> None:
    assert "stalled" in classify(RpcTimeout("slow"), Side.CONTROL, "p").reason


def test_a_veto_keeps_its_reason_and_blame() -> None:
    verdict = classify(Veto("codec error in part 2", (2,)), Side.SEND, "p")
    assert verdict.action is Action.VETO and verdict.reason == "codec error in part 2"


async def test_a_deadline_is_a_point_in_loop_time_shared_by_every_stage() -> None:
    loop = asyncio.get_running_loop()
    d = Deadline.after(5.0)
    assert d.at is not None and abs(d.at - (loop.time() + 5.0)) < 0.5
    assert not d.expired() and 4.0 < (d.remaining() or 0) <= 5.0
    assert d.within(1.0).at < d.at  # type: ignore[operator]  # the earlier one wins
    assert d.within(60.0) == d
    assert Deadline.never().remaining() is None and not Deadline.never().expired()
    assert Deadline.never().within(2.0).at is not None
    passed = Deadline.after(0.0)
    assert passed.expired() and passed.remaining() == 0.0
    with pytest.raises(TimeoutError):
        async with passed.scope():
            await asyncio.Event().wait()  # never set: only the deadline ends it
