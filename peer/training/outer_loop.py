"""The outer part of training, shared by the daemon's trainer and the library's loops.

After every inner step (the daemon's AdamW in its worker thread, or the optimizer
of a user's own loop, `shoal.peer.library`), an `OuterLoop` counts the step (loss,
tokens, tokens/s) and gives the outer strategy its turn: a DiLoCo round every H
steps, its exact commit, a re-sync when this peer fell behind. A shutdown during
a round ends the round within `FINISH_TIMEOUT_S` instead of waiting for its deadline.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from shoal.averaging.outer import OuterStrategy, RoundReport

__all__ = ["FINISH_TIMEOUT_S", "HISTORY_POINTS", "RATE_WINDOW_S", "OuterLoop", "TrainerStats"]

log = logging.getLogger("shoal.trainer")

# Tokens/s is measured over this many seconds of recent steps.
RATE_WINDOW_S = 20.0
HISTORY_POINTS = 1000
# On shutdown, how long a round in flight may take to end (docker stop grants 10 s).
FINISH_TIMEOUT_S = 4.0


@dataclass
class TrainerStats:
    """What the status endpoint and the progress line show."""

    step: int = 0  # inner steps of this peer, since the experiment started (resumed included)
    tokens: int = 0
    loss: float | None = None  # smoothed
    last_loss: float | None = None
    tokens_per_s: float | None = None
    last_round: RoundReport | None = None
    last_round_at: float | None = None  # UNIX time
    last_commit_at: float | None = None  # UNIX time of the last committed round
    rounds: collections.Counter[str] = field(default_factory=collections.Counter)
    checkpoint_at: float | None = None
    # Why the last periodic checkpoint could not be written (None: it was); training
    # goes on, the last good checkpoint stays on disk.
    checkpoint_error: str | None = None
    # The mean loss over the task's held-out batches after a round (peer/training/validation.py).
    val_loss: float | None = None
    val_loss_at: float | None = None  # UNIX time
    history: collections.deque[dict[str, Any]] = field(
        default_factory=lambda: collections.deque(maxlen=HISTORY_POINTS)
    )


class OuterLoop:
    """Counts inner steps and runs the strategy's turn after each (in the event loop).

    Also what `PeerNode` reads of a training peer: `stats`, and `on_round`, told of
    every round that ended (the round ledger, the metrics)."""

    def __init__(
        self,
        strategy: OuterStrategy,
        stats: TrainerStats | None = None,
        on_round: Callable[[RoundReport], None] | None = None,
    ) -> None:
        self.strategy = strategy
        self.stats = stats or TrainerStats()
        self.on_round = on_round
        self.closed = False
        self._alone = False  # the last round committed alone (nobody else to average with)
        self._rate: collections.deque[tuple[float, int]] = collections.deque()

    async def after_step(
        self, loss: float, tokens: int, stop: asyncio.Event | None = None
    ) -> list[RoundReport]:
        """Count an inner step of `tokens` tokens (or samples) and its `loss` (NaN: none
        known), then the strategy's turn; the reports of the rounds that ended. `stop`:
        set, it ends a round in flight (`FINISH_TIMEOUT_S`) and no report comes back."""
        if self.closed:
            raise RuntimeError("this peer has shut down: no more steps")
        self._account(loss, tokens)
        reports = await self._turn(tokens, stop)
        for report in reports:
            self._record_round(report)
        return reports

    async def finish(self) -> None:
        """No new rounds; the round in flight ends (commit or abort) within its bound."""
        try:
            await self.strategy.finish()
        except Exception as e:  # whoever shuts down goes on (a checkpoint, the close)
            log.warning("ending the averaging round at shutdown failed: %r", e)

    def close(self) -> None:
        """The peer shut down (`PeerNode.aclose`): a later step raises."""
        self.closed = True

    async def _turn(self, tokens: int, stop: asyncio.Event | None) -> list[RoundReport]:
        if stop is None:
            return await self.strategy.after_inner_step(tokens)
        outer = asyncio.ensure_future(self.strategy.after_inner_step(tokens))
        stopped = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait({outer, stopped}, return_when=asyncio.FIRST_COMPLETED)
            if not outer.done():
                log.info("shutdown during an averaging round: ending it")
                try:
                    async with asyncio.timeout(FINISH_TIMEOUT_S):
                        await self.strategy.finish()
                        await asyncio.wait({outer})
                except TimeoutError:
                    log.info("the round did not end within %.0fs: abandoning it", FINISH_TIMEOUT_S)
                except Exception as e:
                    log.warning("ending the averaging round at shutdown failed: %r", e)
            if not outer.done():
                # The round aborts for us; the others see a failed member and go on.
                outer.cancel()
                await asyncio.gather(outer, return_exceptions=True)
                return []
            return outer.result()
        finally:
            stopped.cancel()
            if not outer.done():
                outer.cancel()
            await asyncio.gather(outer, stopped, return_exceptions=True)

    def _account(self, loss: float, tokens: int) -> None:
        s = self.stats
        s.step += 1
        s.tokens += tokens
        s.last_loss = loss
        if math.isfinite(loss):
            s.loss = loss if s.loss is None else 0.95 * s.loss + 0.05 * loss
        now = time.monotonic()
        self._rate.append((now, tokens))
        while len(self._rate) > 2 and now - self._rate[0][0] > RATE_WINDOW_S:
            self._rate.popleft()
        if len(self._rate) >= 2:
            span = now - self._rate[0][0]
            if span > 0:
                s.tokens_per_s = sum(t for _, t in list(self._rate)[1:]) / span

    def _record_round(self, report: RoundReport) -> None:
        s = self.stats
        s.last_round = report
        s.last_round_at = time.time()
        if report.committed:
            s.last_commit_at = s.last_round_at
        s.rounds[report.outcome.value] += 1
        alone = report.committed and report.group_size == 1
        if alone:
            # Said once per stretch, not at every boundary.
            if not self._alone:
                log.info("no other peer is training this experiment: taking outer steps alone")
        elif report.committed:
            log.info(
                "round committed: outer step %d, %d peers, %.2fs, fingerprint %s",
                report.outer_step,
                report.group_size,
                report.duration_s,
                (report.fingerprint or "")[:16],
            )
        else:
            log.info("round not committed: %s (%.2fs)", report.describe(), report.duration_s)
        self._alone = alone
        if self.on_round is not None:
            self.on_round(report)
