"""Who of a round's members was heard from when, and the heartbeats (sans-IO).

The liveness half of the commit protocol (`commit.py`): when each member was
last heard from, which ones have been silent for ``stall_timeout`` (suspects)
or for a third of it (quiet at an abort), when our next heartbeat is due, and
whether the silence was ours (a long gap between ticks: we were stopped). It
decides nothing: `CommitProtocol` suspects whom it names.
"""

from __future__ import annotations

from collections.abc import Container

__all__ = ["Liveness"]


class Liveness:
    """The silence of `n` members as member `me` sees it; time is the caller's clock."""

    def __init__(
        self, n: int, me: int, now: float, *, heartbeat_interval: float, stall_timeout: float
    ) -> None:
        self.n = n
        self.me = me
        self.heartbeat_interval = heartbeat_interval
        self.stall_timeout = stall_timeout
        self.last_heard = [now] * n
        # Our own data phase: the watchdog vetoes when it moves no more for this long.
        self.watchdog = 1.5 * stall_timeout
        self.progress = 0  # (bytes received)
        self.data_at = now  # when it last moved
        # What each member's status said last: (vote, progress, decision, ...).
        self._views: list[tuple[object, ...] | None] = [None] * n
        self.next_heartbeat = now
        self.last_tick = now

    def heard(self, src: int, now: float) -> None:
        self.last_heard[src] = max(self.last_heard[src], now)

    def others(self, suspected: Container[int]) -> list[int]:
        """The other members not suspected."""
        return [j for j in range(self.n) if j != self.me and j not in suspected]

    def first_stall(self, suspected: Container[int]) -> float | None:
        """When the first of the members not suspected will have been silent too long."""
        alive = [self.last_heard[j] for j in self.others(suspected)]
        return min(alive) + self.stall_timeout if alive else None

    def quiet(self, now: float) -> tuple[int, ...]:
        """The other members not heard from for a third of `stall_timeout` (and three
        heartbeats at least), suspected or not. An adaptive stall is three times a
        chunk's transfer, and a live member is heard at least once per chunk; one that
        is silent this long at an abort has likely stopped. None when every other
        member is: then the silence is more likely ours."""
        threshold = max(self.stall_timeout / 3, 3 * self.heartbeat_interval)
        others = [j for j in range(self.n) if j != self.me]
        quiet = tuple(j for j in others if now - self.last_heard[j] > threshold)
        return () if len(quiet) == len(others) else quiet

    def resumed(self, now: float) -> bool:
        """A tick at `now`: True when the gap since the last one says we were the ones
        not running (SIGSTOP, a blocked loop). The silence is ours then, so everyone
        gets a fresh `stall_timeout` to be heard from again."""
        gap = now - self.last_tick > max(self.stall_timeout / 2, 2 * self.heartbeat_interval)
        if gap:
            for j in range(self.n):
                self.last_heard[j] = max(self.last_heard[j], now)
            self.data_at = now
        self.last_tick = now
        return gap

    def data_progress(self, value: int, now: float) -> bool:
        """Our data phase's progress counter is `value`: True when it moved."""
        if value == self.progress:
            return False
        self.progress, self.data_at = value, now
        return True

    def data_stuck(self, now: float) -> bool:
        """Our data phase has not moved for `watchdog`."""
        return now >= self.data_at + self.watchdog

    def reported(self, src: int, view: tuple[object, ...]) -> bool:
        """Member `src`'s status says `view`: True when it changed (progress)."""
        if view == self._views[src]:
            return False
        self._views[src] = view
        return True

    def reported_decision(self, src: int) -> bool:
        """Member `src`'s last status carried a decision."""
        view = self._views[src]
        return view is not None and view[2] is not None

    def stalled(self, now: float, suspected: Container[int]) -> list[tuple[int, float]]:
        """The members not suspected that were silent for `stall_timeout`, with how long."""
        return [
            (j, now - self.last_heard[j])
            for j in self.others(suspected)
            if now >= self.last_heard[j] + self.stall_timeout
        ]

    def heartbeat_due(self, now: float) -> bool:
        """Our heartbeat is due at `now` (the next one is scheduled if so)."""
        if now < self.next_heartbeat:
            return False
        self.next_heartbeat = now + self.heartbeat_interval
        return True
