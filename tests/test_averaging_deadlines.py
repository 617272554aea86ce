"""Deadlines follow the links a peer measured, between the configured floors and ceilings."""

from __future__ import annotations

import pytest
import torch

from shoal.averaging.butterfly import AllReduceConfig
from shoal.averaging.deadlines import (
    CEILINGS,
    PRIOR_RATE,
    SLACK,
    AdaptiveDeadlines,
    AveragerDeadlines,
    Deadlines,
)
from shoal.averaging.matchmaking_round import MatchmakingConfig

FLOORS = Deadlines(
    matchmaking_time=5.0, join_timeout=7.0, round_timeout=30.0, stall_timeout=5.0,
    state_timeout=120.0,
)  # fmt: skip
MB = 1 << 20


def policy(payload: int = 2 * MB, state: int = 4 * MB, chunk: int = 4 * MB) -> AdaptiveDeadlines:
    return AdaptiveDeadlines(FLOORS, payload_bytes=payload, state_bytes=state, chunk_bytes=chunk)


def test_on_a_fast_link_the_configured_deadlines_hold() -> None:
    p = policy()
    for _ in range(5):
        p.observe_transfer(100 * MB, 1.0)  # 100 MB/s
        p.observe_rtt(0.001)
    d = p.deadlines(group_size=4)
    assert (d.stall_timeout, d.state_timeout) == (5.0, 120.0)
    # The rest gain what a millisecond of RTT and a state download at 100 MB/s take.
    assert d.matchmaking_time == pytest.approx(5.0, abs=0.01)
    assert d.join_timeout == pytest.approx(7.0, abs=0.02)
    assert d.round_timeout == pytest.approx(30.0, abs=0.2)


def test_before_any_measurement_the_state_size_at_the_prior_rate_raises_the_floors() -> None:
    p = policy(payload=400 * MB, state=800 * MB)
    d = p.deadlines(group_size=4)
    download = SLACK * 800 * MB / PRIOR_RATE
    assert d.state_timeout == pytest.approx(download)
    assert d.round_timeout == 30.0  # (grows only by what was measured)
    # A 4 MB chunk to each of 3 others over a shared 10 Mbit/s uplink.
    assert d.stall_timeout == pytest.approx(SLACK * 4 * MB * 3 / PRIOR_RATE)


def test_a_slow_link_lengthens_stall_and_state_deadlines_in_proportion() -> None:
    p = policy(payload=40 * MB, state=80 * MB)
    rate = 5e6 / 8  # 5 Mbit/s
    p.observe_transfer(10 * MB, 10 * MB / rate)
    p.observe_rtt(0.3)
    d = p.deadlines(group_size=2)
    chunk_time = 4 * MB / rate
    assert d.stall_timeout == pytest.approx(SLACK * (chunk_time + 0.6))
    assert d.state_timeout == pytest.approx(SLACK * (80 * MB / rate + 1.2))
    assert d.round_timeout == pytest.approx(30.0 + 8 * 0.3 + 4 * 0.3 + SLACK * 80 * MB / rate)
    assert d.matchmaking_time == pytest.approx(5.0 + 8 * 0.3)
    assert d.join_timeout == pytest.approx(d.matchmaking_time + 2.0 + 1.2)


def test_the_slowest_recent_rate_and_the_largest_recent_rtt_count() -> None:
    p = policy()
    p.observe_transfer(10 * MB, 1.0)
    p.observe_transfer(10 * MB, 10.0)
    p.observe_transfer(10 * MB, 2.0)
    p.observe_rtt(0.05)
    p.observe_rtt(0.2)
    p.observe_rtt(0.1)
    assert p.rate == pytest.approx(1 * MB)
    assert p.rtt == pytest.approx(0.2)
    for _ in range(5):  # old samples age out
        p.observe_transfer(10 * MB, 1.0)
        p.observe_rtt(0.01)
    assert p.rate == pytest.approx(10 * MB)
    assert p.rtt == pytest.approx(0.01)


def test_tiny_transfers_say_nothing_about_the_rate() -> None:
    p = policy()
    p.observe_transfer(1000, 0.5)  # a few KB: latency, not bandwidth
    assert p.rate is None


def test_no_deadline_grows_past_its_ceiling() -> None:
    p = policy(payload=100_000 * MB, state=200_000 * MB)
    p.observe_transfer(1 * MB, 100.0)  # 10 KB/s
    p.observe_rtt(30.0)
    assert p.deadlines(group_size=64) == CEILINGS


def test_a_floor_above_the_ceiling_wins() -> None:
    floors = Deadlines(1.0, 2.0, 3.0, 500.0, 4.0)
    p = AdaptiveDeadlines(floors, payload_bytes=MB, state_bytes=MB, chunk_bytes=MB)
    assert p.deadlines().stall_timeout == 500.0


def test_a_round_is_timed_for_the_group_it_formed_not_the_last_one() -> None:
    # Before any round the last group is taken to be `min_group_size` (2); a first
    # round among 4 members shares each uplink three ways, so a chunk may take 3x.
    payload = [torch.zeros(25 * MB // 4)]  # (a 25 MB float32 pseudo-gradient)
    averager = AveragerDeadlines(
        MatchmakingConfig(min_group_size=2), AllReduceConfig(stall_timeout=5.0), 120.0,
        payload, payload,
    )  # fmt: skip
    before = averager.next_round().stall_timeout
    assert before == pytest.approx(SLACK * 4 * MB / PRIOR_RATE)
    assert averager.stall_timeout(4) == pytest.approx(3 * before)
    assert averager.stall_timeout(2) == pytest.approx(before)
