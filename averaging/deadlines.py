"""Deadlines of an averaging round, from what this peer measured (sans-I/O).

Fixed timeouts tuned on fast links fail on slow ones both ways: too short, they
abort healthy rounds (a member sending a 4 MB chunk over 5 Mbit/s is silent for
7 s, a 400 MB state takes 11 minutes to download); too long, they let a crashed
peer stall everyone. `AdaptiveDeadlines` keeps what the peer measured:

- the throughput of its links: bytes received by the all-reduce over its
  duration (a pessimistic figure: it includes latency and waiting), and state
  downloads; the smallest of the recent samples counts;
- the round-trip time to the group's members (the transport's pings), the
  largest of the recent samples;

and sets each deadline to `SLACK` times what the work should take, between a
floor (the configured value, which works on a fast link, so measurements never
shorten it) and a ceiling (how long a crash or an unanswered message may go
unnoticed at most). Before anything was measured the floors hold, raised by
what the size of the state needs at `PRIOR_RATE`, a modest home uplink.

- stall (an all-reduce member silent this long is dead; also how long a control
  message may stay unanswered): a chunk's transfer time plus two RTTs. Members
  send to all the others at once, so a stream gets a share of the uplink;
- matchmaking (a leader waits this long for the peers it expects): the floor
  plus the DHT's latency (a declaration and a poll, each a few RTTs);
- joining (a follower waits for its leader's answer): matchmaking, plus 2 s and
  four RTTs;
- the round (matchmaking and a re-sync): the floor, plus what matchmaking
  gained, four RTTs, and a state download at the measured rate (never the
  prior: a caller's short round timeout stays short until something is known);
- the state download: the state's size at the measured rate.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shoal.transport.host import Host

from .butterfly import AllReduceConfig
from .group import Group
from .matchmaking_round import MatchmakingConfig

__all__ = [
    "CEILINGS",
    "PRIOR_RATE",
    "SLACK",
    "AdaptiveDeadlines",
    "AveragerDeadlines",
    "Deadlines",
    "nbytes",
]

SLACK = 3.0  # a deadline is this many times the expected duration
# Bytes/s assumed before any measurement: 10 Mbit/s, a modest home uplink.
PRIOR_RATE = 10e6 / 8
SAMPLES = 5  # recent measurements kept per kind
# DHT operations a matchmaking round waits on (declare, poll, confirm), in RTTs.
MATCHMAKING_RTTS = 8


@dataclass(frozen=True)
class Deadlines:
    """Seconds each wait of a round may last."""

    matchmaking_time: float
    join_timeout: float
    round_timeout: float
    stall_timeout: float
    state_timeout: float


# How long any of them may grow: a crash goes unnoticed at most this long.
CEILINGS = Deadlines(
    matchmaking_time=60.0,
    join_timeout=90.0,
    round_timeout=3600.0,
    stall_timeout=120.0,
    state_timeout=7200.0,
)


def _clamp(value: float, low: float, high: float) -> float:
    return min(max(value, low), max(low, high))


class AdaptiveDeadlines:
    """The deadlines of the next round, from recent measurements (see the module doc).

    `floors`: the configured deadlines (never shortened). `state_bytes`: the size of
    what a re-sync downloads; `payload_bytes`: what one all-reduce averages (both
    may be updated with `sizes`)."""

    def __init__(
        self,
        floors: Deadlines,
        *,
        payload_bytes: int,
        state_bytes: int,
        chunk_bytes: int,
        ceilings: Deadlines = CEILINGS,
    ) -> None:
        self.floors = floors
        self.ceilings = ceilings
        self.payload_bytes = payload_bytes
        self.state_bytes = state_bytes
        self.chunk_bytes = chunk_bytes
        self._rates: deque[float] = deque(maxlen=SAMPLES)  # bytes/s
        self._rtts: deque[float] = deque(maxlen=SAMPLES)  # seconds

    # ------------------------------------------------------------ measurements

    def observe_transfer(self, nbytes: int, seconds: float) -> None:
        """Bytes received over a busy period (an all-reduce, a state download).
        Transfers too small to say anything about the rate are ignored."""
        if nbytes >= 64 * 1024 and seconds > 0:
            self._rates.append(nbytes / seconds)

    def observe_rtt(self, seconds: float | None) -> None:
        if seconds is not None and seconds >= 0:
            self._rtts.append(seconds)

    @property
    def rate(self) -> float | None:
        """Bytes/s to count on (the slowest recent sample), None before any."""
        return min(self._rates) if self._rates else None

    @property
    def rtt(self) -> float:
        return max(self._rtts) if self._rtts else 0.0

    # ------------------------------------------------------------ the deadlines

    def deadlines(self, group_size: int = 2) -> Deadlines:
        """The deadlines for a round among about `group_size` peers."""
        floors, caps, rtt = self.floors, self.ceilings, self.rtt
        rate = self.rate or PRIOR_RATE
        others = max(1, group_size - 1)
        # What one member owns and sends to each other member, a chunk at a time,
        # each stream with its share of the link.
        chunk = min(self.chunk_bytes, self.payload_bytes / max(1, group_size))
        chunk_time = chunk * others / rate
        stall = _clamp(SLACK * (chunk_time + 2 * rtt), floors.stall_timeout, caps.stall_timeout)
        matchmaking = _clamp(
            floors.matchmaking_time + MATCHMAKING_RTTS * rtt,
            floors.matchmaking_time,
            caps.matchmaking_time,
        )
        join = _clamp(matchmaking + 2.0 + 4 * rtt, floors.join_timeout, caps.join_timeout)
        download = SLACK * (self.state_bytes / rate + 4 * rtt)
        state = _clamp(download, floors.state_timeout, caps.state_timeout)
        # The round (matchmaking, then a re-sync) grows only by what was measured: the
        # DHT's latency, and a download at the measured rate (a caller's short round
        # timeout on a link it knows nothing of yet stays as it is).
        measured = 0.0 if self.rate is None else SLACK * self.state_bytes / self.rate
        round_ = _clamp(
            floors.round_timeout + (matchmaking - floors.matchmaking_time) + 4 * rtt + measured,
            floors.round_timeout,
            caps.round_timeout,
        )
        return Deadlines(matchmaking, join, round_, stall, state)


def nbytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class AveragerDeadlines:
    """An averager's adaptive deadlines: the configured ones as floors, its tensors' and
    state's sizes, and what its rounds and downloads measured.

    `next_round` writes the matchmaking deadlines into `matchmaking` (the averager's
    own copy of its config, which its matchmaker reads) and returns the round's."""

    def __init__(
        self,
        matchmaking: MatchmakingConfig,
        allreduce: AllReduceConfig,
        state_timeout: float,
        tensors: Sequence[torch.Tensor],
        state: Sequence[torch.Tensor],
    ) -> None:
        self.matchmaking = matchmaking
        floors = Deadlines(
            matchmaking.matchmaking_time,
            matchmaking.join_timeout,
            0.0,  # the round's: what the links add to the caller's step timeout
            allreduce.stall_timeout,
            state_timeout,
        )
        self.policy = AdaptiveDeadlines(
            floors,
            payload_bytes=nbytes(tensors),
            state_bytes=nbytes(state),
            chunk_bytes=allreduce.chunk_bytes,
        )
        self.group_size = matchmaking.min_group_size  # of our last round
        self.current = self.policy.deadlines(self.group_size)

    def next_round(self) -> Deadlines:
        self.current = d = self.policy.deadlines(self.group_size)
        self.matchmaking.matchmaking_time = d.matchmaking_time
        self.matchmaking.join_timeout = d.join_timeout
        return d

    @property
    def state_timeout(self) -> float:
        return self.policy.deadlines(self.group_size).state_timeout

    def stall_timeout(self, group_size: int) -> float:
        """The stall timeout of a round among `group_size` members, once its group is
        formed: each member's chunks share its uplink with every other member's, so
        the round's group, not the last one's, sets how long a chunk may take (a first
        round among 4 timed for `min_group_size` 2 allowed a third of what it needed)."""
        return self.policy.deadlines(group_size).stall_timeout

    def observe_round(self, host: Host, group: Group, received: int, seconds: float) -> None:
        """What an all-reduce showed of our links: its rate and the members' round trips."""
        self.group_size = group.size
        self.policy.observe_transfer(received, seconds)
        rtts = [c.rtt for p in group.peer_ids if (c := host.connection(p)) is not None]
        self.policy.observe_rtt(max((r for r in rtts if r is not None), default=None))

    def observe_download(self, tensors: Sequence[torch.Tensor], seconds: float) -> None:
        self.policy.observe_transfer(nbytes(tensors), seconds)
