"""DiLoCo's overlapped rounds: the next inner steps run while a round averages.

With ``overlap_steps`` K > 0 a round begins at its H boundary as always (the
pseudo-gradient of the steps since the last sync, weighted by their samples),
but in the background: training goes on from the local parameters, which are
kept (the *anchor*) as they were when the round began. The round is merged after
the first inner step that ends with it done, and at the latest K inner steps after
it began, waited for then if it is still running (bounded by its own deadlines):

- committed: the outer step moved the global parameters; the local ones move with
  them and keep the K steps taken meanwhile, ``local += globals - anchor``. The
  next pseudo-gradient, ``globals - local``, is then exactly those steps and the
  ones after: nothing counted twice, nothing lost. (The delayed outer update of
  overlapped DiLoCo variants: Streaming DiLoCo overlaps the same way per fragment
  but mixes, ``a*local + (1-a)*global``, which drops part of the steps it overlapped.)
- aborted or no group: nothing moved; the round's samples go back into the next
  round's weight (its pseudo-gradient covers both, as without overlap).
- re-synced or discarded: the local parameters restart from the globals.

What this buys: a round costs about a second of latency whatever it carries
(matchmaking's minimum, the DHT's and the all-gather's round trips), which a small
sparse round cannot amortize at a low H; overlapped, that second is spent training.
What it costs: each outer step lands K steps late, on parameters that moved on.

A verified round cannot overlap: an audit re-runs a segment from the state the
peer's work log starts at, and a merge in the middle of a segment moves it by
what the round committed (`diloco_options.DiLoCoOptions.check_together`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .averager import Averager
from .fragments import FragmentOutcome
from .host_state import copy_into, host_clone, numel, off_loop
from .outer import RoundReport
from .strategy_base import OuterStrategyBase, round_bound

__all__ = ["OverlappingRounds", "PendingRound"]


@dataclass(eq=False)
class PendingRound:
    """A round running in the background, and what its merge needs."""

    task: asyncio.Task[FragmentOutcome]
    weight: int  # the samples its pseudo-gradient carries
    started_at: int  # inner steps taken when it began
    synced_at: int  # the inner step our input counts from
    commits: int  # the averager's commits when it began ...
    version: bytes  # ... and its state version

    def moved(self, averager: Averager) -> bool:
        """The global state changed since the round began (a commit or a re-sync): the
        local parameters are behind it until the merge."""
        return averager.commits != self.commits or averager.state_version != self.version

    async def cancel(self) -> None:
        """Cancel the round (a no-op once it ended)."""
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


def anchors_like(params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Host float32 buffers for the local parameters at a round's start."""
    with torch.no_grad():
        return [host_clone(p) for p in params]


class OverlappingRounds(OuterStrategyBase):
    """The schedule of a strategy whose rounds may overlap the next inner steps (DiLoCo).

    The strategy supplies `_prepare` (the pseudo-gradient; the samples it carries),
    `_run_round` (the averager's step and what follows it) and `_settle` (the outcome
    applied to the parameters and the counters, moving them by ``globals - anchor``
    when overlapped), and has `averager` and `globals`. Without overlap the base's
    schedule runs: the round inside `after_inner_step`."""

    averager: Averager
    globals: list[torch.Tensor]

    def _init_overlap(self, steps: int) -> None:
        self.overlap_steps = steps
        self._pending: PendingRound | None = None  # a round in flight
        self._anchor: list[torch.Tensor] | None = None  # the parameters it began from
        # A checkpoint taken between a commit and its merge: the parameters saved beside
        # it are behind the globals, and restart from them (`start`).
        self._params_behind = False

    async def _prepare(self) -> int:
        raise NotImplementedError

    async def _run_round(self, weight: int) -> FragmentOutcome:
        raise NotImplementedError

    async def _settle(
        self, done: FragmentOutcome, weight: int, started_at: int, synced_at: int, *,
        overlapped: bool,
    ) -> RoundReport:  # fmt: skip
        raise NotImplementedError

    async def after_inner_step(self, samples: int) -> list[RoundReport]:
        """Without overlap, the base's schedule (the round inside this call). With
        `overlap_steps` K: a round begins at the H boundary in the background and is
        merged once it is done, at the latest K inner steps later."""
        if not self.overlap_steps:
            return await super().after_inner_step(samples)
        self.inner_steps += 1
        self.samples_since_sync += samples
        if self._gate.closing:
            return []
        reports = []
        with self._gate:
            pending = self._pending
            if pending is not None and (
                pending.task.done() or self.inner_steps >= pending.started_at + self.overlap_steps
            ):
                reports.append(await self._merge())
            if self.inner_steps % self.inner_steps_per_round == 0:
                await self._begin()
            elif self._pending is None:
                await self._between_rounds()
        return reports

    async def _begin(self) -> None:
        """Start a round in the background, keeping the local parameters
        it began from."""
        started_at, synced_at = self.inner_steps, self.synced_at_step
        weight = await self._prepare()
        if self._anchor is None:
            self._anchor = anchors_like(self.params)
        else:
            await off_loop(lambda: copy_into(self._anchor, self.params), numel(self.params))
        task = asyncio.get_running_loop().create_task(self._run_round(weight), name=self.key)
        avg = self.averager
        self._pending = PendingRound(
            task, weight, started_at, synced_at, avg.commits, avg.state_version
        )

    async def _merge(self) -> RoundReport:
        """Wait for the round in flight (bounded by its own deadlines) and apply it."""
        pending = self._pending
        assert pending is not None
        # (Shielded: a caller cancelled meanwhile leaves the round pending, for
        # `_drop_pending` to give its samples back or set the parameters right.)
        done = await asyncio.shield(pending.task)
        self._pending = None
        return await self._settle(
            done, pending.weight, pending.started_at, pending.synced_at, overlapped=True
        )

    async def finish(self) -> None:
        """No new rounds; one in flight ends (bounded) and is merged."""
        await super().finish()
        pending = self._pending
        if pending is None:
            return
        done, _ = await asyncio.wait([pending.task], timeout=round_bound(self.options))
        if done:
            await self._merge()
        else:
            await self._drop_pending()

    async def _drop_pending(self) -> None:
        """Cancel the round in flight: its samples are not synchronized yet, or, when
        the globals moved meanwhile, the local parameters restart from them."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        await pending.cancel()
        if pending.moved(self.averager):
            copy_into(self.params, self.globals)
            self._synced_now()
        else:
            self.samples_since_sync += pending.weight

    def _unsynced(self) -> dict[str, Any]:
        """The samples not yet synchronized, counting a round in flight as not done
        (its weight); when the globals moved under one (committed, not yet merged),
        the parameters saved with them are behind: they restart from the globals."""
        samples, pending = self.samples_since_sync, self._pending
        if pending is None:
            return {"samples_since_sync": samples}
        if pending.moved(self.averager):
            return {"samples_since_sync": 0, "params_behind": True}
        return {"samples_since_sync": samples + pending.weight}
