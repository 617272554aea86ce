"""The swarm's history: a bounded time series per peer of what the peers report.

`PeerNode` feeds `SwarmHistory.record` the rows of /peers (the DHT reports it
reads anyway, and its own live row) every `SWARM_SAMPLE_INTERVAL_S`; /swarm
serves `snapshot()`, and the status page draws every peer's loss from it.

Bounded three ways, so that a long run or a large swarm costs a fixed amount:

- at most `max_points` points per peer: when a series is full, every other
  point of its older half goes, so the recent past keeps its full resolution
  and the whole run stays visible, ever coarser towards its start;
- points older than `max_age_s` go: a peer that left keeps its series (the
  page shows where it got to) until its last point ages out;
- at most `max_peers` series: a new peer replaces the one heard from longest ago.

A row is a new point only when its report is new (its `updated_at` changed):
reading the same DHT record twice adds nothing. Sans-I/O: the clock is injected.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "DEFAULT_MAX_AGE_S",
    "DEFAULT_MAX_PEERS",
    "DEFAULT_MAX_POINTS",
    "SwarmHistory",
]

DEFAULT_MAX_PEERS = 64
DEFAULT_MAX_POINTS = 240  # an hour at one point per 15 s before thinning
DEFAULT_MAX_AGE_S = 24 * 3600.0


@dataclass
class _Series:
    points: list[dict[str, Any]] = field(default_factory=list)  # oldest first
    last_report: float | None = None  # the report time of the newest point


class SwarmHistory:
    def __init__(
        self,
        *,
        max_peers: int = DEFAULT_MAX_PEERS,
        max_points: int = DEFAULT_MAX_POINTS,
        max_age_s: float = DEFAULT_MAX_AGE_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if max_peers < 1 or max_points < 4 or max_age_s <= 0:
            raise ValueError("need max_peers >= 1, max_points >= 4 and max_age_s > 0")
        self.max_peers = max_peers
        self.max_points = max_points
        self.max_age_s = max_age_s
        self._clock = clock
        self._series: dict[str, _Series] = {}

    def record(self, rows: Iterable[Mapping[str, Any]]) -> int:
        """Add a point per row with a new report; rows are /peers entries (peer_id,
        step, loss, val_loss, updated_at: the report's UNIX time, or now when missing).
        Then drop what aged out. Returns the number of points added."""
        now = self._clock()
        added = 0
        for row in rows:
            peer = row.get("peer_id")
            if not isinstance(peer, str) or not peer:
                continue
            reported = _number(row.get("updated_at"))
            reported = now if reported is None else float(reported)
            if self._add(peer, reported, now, row):
                added += 1
        self._age(now)
        return added

    def _add(self, peer: str, reported: float, now: float, row: Mapping[str, Any]) -> bool:
        series = self._series.get(peer)
        last_report = None if series is None else series.last_report
        if last_report is not None and reported <= last_report:
            return False  # the same report read again (or an older one)
        # A peer's clock may run ahead of ours: never a point in our future.
        t = min(reported, now)
        if series is not None and series.points and t <= series.points[-1]["t"]:
            return False
        if t < now - self.max_age_s:
            return False
        if series is None:
            if len(self._series) >= self.max_peers:
                self._evict_quietest()
            series = self._series[peer] = _Series()
        series.last_report = reported
        series.points.append(
            {
                "t": t,
                "step": _number(row.get("step")),
                "loss": _number(row.get("loss")),
                "val_loss": _number(row.get("val_loss")),
            }
        )
        if len(series.points) > self.max_points:
            half = len(series.points) // 2
            series.points = series.points[:half:2] + series.points[half:]
        return True

    def _evict_quietest(self) -> None:
        quietest = min(self._series, key=lambda p: self._series[p].points[-1]["t"])
        del self._series[quietest]

    def _age(self, now: float) -> None:
        oldest = now - self.max_age_s
        for peer in list(self._series):
            points = self._series[peer].points
            keep = next((i for i, p in enumerate(points) if p["t"] >= oldest), len(points))
            if keep == len(points):
                del self._series[peer]
            elif keep:
                del points[:keep]

    def snapshot(self) -> dict[str, list[dict[str, Any]]]:
        """{peer_id: [{t, step, loss, val_loss}, ...]}, oldest first, aged as of now. Copies
        of the lists (the points themselves are never changed once recorded)."""
        self._age(self._clock())
        return {peer: list(series.points) for peer, series in self._series.items()}

    def __len__(self) -> int:
        return len(self._series)


def _number(value: object) -> float | int | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return value if math.isfinite(value) else None
