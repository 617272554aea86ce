"""Something per committed round, kept for the audits' window."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["RecentRounds"]

T = TypeVar("T")


class RecentRounds(Generic[T]):
    """Something per committed round, kept `retain_s` after the round was added and
    the last `keep` rounds however old.

    A prover answers reveals as long as its work log keeps the work (`retain_s`):
    referees may ask that late (their audits queue behind each other), and a prover
    that answers "no work of round N" inside the window is left out of their rounds
    as one that withheld. A count alone forgets rounds seconds after their commit
    when rounds are fast."""

    def __init__(
        self, keep: int, retain_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.keep, self.retain_s, self._clock = keep, retain_s, clock
        self._items: dict[int, tuple[float, T]] = {}

    def add(self, round_index: int, item: T) -> None:
        now = self._clock()
        self._items[round_index] = (now, item)
        for old in sorted(self._items)[: -self.keep]:
            if now - self._items[old][0] > self.retain_s:
                del self._items[old]

    def get(self, round_index: int) -> T | None:
        kept = self._items.get(round_index)
        return None if kept is None else kept[1]

    def oldest(self) -> int | None:
        return min(self._items, default=None)

    def __len__(self) -> int:
        return len(self._items)
