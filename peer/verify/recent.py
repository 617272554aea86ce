"""Something per committed round, kept for the audits' window."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["RecentRounds"]

T = TypeVar("T")


class RecentRounds(Generic[T]):
    """Something per committed round, kept `retain_s` after the round was added and
    the last `keep` rounds added however old.

    A prover answers reveals as long as its work log keeps the work (`retain_s`):
    referees may ask that late (their audits queue behind each other), and a prover
    that answers "no work of round N" inside the window is left out of their rounds
    as one that withheld. A count alone forgets rounds seconds after their commit
    when rounds are fast.

    A round index may be committed twice, by a peer that re-synced onto another
    lineage at a lower commit count: each is kept under its `tag` (the global state
    it started from), so that each round's referees are answered from its own."""

    def __init__(
        self,
        keep: int,
        retain_s: float,
        clock: Callable[[], float] = time.monotonic,
        *,
        at_most: int | None = None,
        on_drop: Callable[[T], None] | None = None,
    ) -> None:
        """`at_most`: past this many rounds, the oldest beyond the last `keep` go even
        inside `retain_s` (a bound on what they hold); `on_drop`: called with each
        item let go (a replaced one too)."""
        if keep < 1 or (at_most is not None and at_most < keep):
            raise ValueError("keep >= 1 and at_most >= keep")
        self.keep, self.retain_s, self._clock = keep, retain_s, clock
        self.at_most = at_most
        self._on_drop = on_drop
        self._items: dict[tuple[int, bytes], tuple[float, T]] = {}

    def add(self, round_index: int, item: T, tag: bytes = b"") -> None:
        now = self._clock()
        key = (round_index, tag)
        replaced = self._items.pop(key, None)
        self._items[key] = (now, item)
        if replaced is not None:
            self._dropped(replaced[1])
        # (By when they were added: a lineage re-synced onto may count from lower.)
        older = list(self._items)[: -self.keep]
        over = 0 if self.at_most is None else max(0, len(self._items) - self.at_most)
        for i, old in enumerate(older):
            if i < over or now - self._items[old][0] > self.retain_s:
                self._dropped(self._items.pop(old)[1])

    def _dropped(self, item: T) -> None:
        if self._on_drop is not None:
            self._on_drop(item)

    def get(self, round_index: int, tag: bytes | None = None) -> T | None:
        """The item of `round_index` under `tag`; with no tag, the one added last."""
        if tag is not None:
            kept = self._items.get((round_index, tag))
            return None if kept is None else kept[1]
        mine = self.of_round(round_index)
        return mine[-1] if mine else None

    def of_round(self, round_index: int) -> list[T]:
        """The items of `round_index` (one per tag), the one added last at the end."""
        return [item for (r, _), (_, item) in self._items.items() if r == round_index]

    def oldest(self) -> int | None:
        return min((r for r, _ in self._items), default=None)

    def __len__(self) -> int:
        return len(self._items)
