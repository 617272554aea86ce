"""Which idle connections a host closes when it holds too many (sans-I/O).

A peer of a large swarm meets hundreds of others: every DHT lookup dials the
peers near a key, every averaging round its group's members, and a connection
stays open until it has been idle for `ConnectionConfig.idle_timeout` (5
minutes). Without a bound, a peer of a 1,000-peer swarm held hundreds of idle
connections after a minute of Moshpit rounds (each about 20 KB of buffers and
cipher state here, and socket buffers in the kernel) and would reach
`max_connections`, past which it refuses everyone, group members included.
Like libp2p's connection manager (its low and high watermarks and grace
period), a host past `high_water` established connections closes the ones idle
longest, down to `low_water`. A connection with an open stream is never
closed (a relay reservation, a round in progress, a state download), nor one
idle for less than `grace` seconds (the next request of a lookup or a round is
likely on its way); a closed one is dialed again when needed.

At `max_connections` itself, a host used to refuse every newcomer, and a group
member's dial with it: in a simulated 1,000-peer burst with a limit of 384,
the busiest peers (replicas of the cells' keys) sat at the limit with every
connection used within the grace, and the rounds that needed them aborted.
There a new connection now takes the slot of the connection idle longest (at
least `AT_LIMIT_GRACE_S`), which drains out of the count (`Admission.draining`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol, TypeVar


class Trimmable(Protocol):
    """What the trimmer reads of a connection (`Connection` is one)."""

    @property
    def is_open(self) -> bool: ...

    @property
    def idle_for(self) -> float | None: ...


C = TypeVar("C", bound=Trimmable)

# At the connection limit, a connection idle this long makes room for a new one.
AT_LIMIT_GRACE_S = 2.0


@dataclass(frozen=True, slots=True)
class TrimPolicy:
    high_water: int  # established connections past which idle ones are closed (0: never)
    low_water: int  # closed down to this many
    grace: float = 30.0  # seconds a connection must have been idle to be closed

    @classmethod
    def for_limit(cls, max_connections: int, grace: float = 30.0) -> TrimPolicy:
        """A host's default: trim past three quarters of its connection limit, to half."""
        return cls(max_connections * 3 // 4, max_connections // 2, grace)

    def __post_init__(self) -> None:
        if self.high_water and not 0 <= self.low_water <= self.high_water:
            raise ValueError("need 0 <= low_water <= high_water (high_water 0: never trim)")
        if self.grace < 0:
            raise ValueError("grace must be >= 0 seconds")

    def pick(self, connections: Iterable[C]) -> list[C]:
        """The connections to close now: none while at most `high_water` are open;
        else the ones idle longest (and at least `grace`), down to `low_water`."""
        open_ = [c for c in connections if c.is_open]
        if not self.high_water or len(open_) <= self.high_water:
            return []
        idle = [(c.idle_for, c) for c in open_]
        idle_enough = [(t, c) for t, c in idle if t is not None and t >= self.grace]
        idle_enough.sort(key=lambda tc: -tc[0])
        return [c for _, c in idle_enough[: len(open_) - self.low_water]]

    def room(self, connections: Iterable[C], grace: float) -> C | None:
        """At the connection limit: the open connection idle longest, if at least
        `grace` s (a shorter grace than trimming's: a connection nobody used for a few
        seconds against a peer refused, a group member's dial among them)."""
        best: tuple[float, C] | None = None
        for c in connections:
            t = c.idle_for if c.is_open else None
            if t is not None and t >= grace and (best is None or t > best[0]):
                best = (t, c)
        return None if best is None else best[1]


class Trimmer:
    """A policy applied at every new connection, without a scan of every connection each
    time: below the high water a count decides (no scan), and past it, a scan that found
    nothing idle enough to close is not repeated for `recheck_s` seconds.

    A host past its high water whose connections are all busy (a burst of rounds, where
    none has been idle for the grace yet) scanned all of them at every handshake: in a
    simulated 1,000-peer burst that was 18% of the wall time, to close nothing."""

    def __init__(self, policy: TrimPolicy, recheck_s: float = 1.0) -> None:
        self.policy = policy
        self.recheck_s = recheck_s
        self._quiet_until = float("-inf")  # no scan before this (the last one found none)
        self._room_quiet_until = float("-inf")  # the same for `room`
        self.scans = 0

    def pick(self, count: int, connections: Callable[[], Iterable[C]], now: float) -> list[C]:
        """The connections to close now, of `count` (an upper bound on the open ones;
        `connections()` lists them, called only when a scan is due)."""
        if not self.policy.high_water or count <= self.policy.high_water:
            return []
        if now < self._quiet_until:
            return []
        self.scans += 1
        picked = self.policy.pick(connections())
        if not picked:
            self._quiet_until = now + self.recheck_s
        return picked

    def room(self, connections: Callable[[], Iterable[C]], now: float) -> C | None:
        """At the connection limit: the connection to close for a new one, if any
        (`TrimPolicy.room`); a scan that found none is not repeated for `recheck_s`."""
        if now < self._room_quiet_until:
            return None
        victim = self.policy.room(connections(), AT_LIMIT_GRACE_S)
        if victim is None:
            self._room_quiet_until = now + self.recheck_s
        return victim
