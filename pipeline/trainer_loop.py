"""A trainer's loop: microbatches from its data, several in flight, paced by the stages.

The stages step when their peers together hold the experiment's global batch
(`stage_peer`). A trainer alone would otherwise race ahead of them and every
microbatch would be computed on parameters ever more steps old, so a trainer
starts microbatches only while what it started since it joined stays within
`lag + 1` global batches of the steps the slowest stage has taken since then.
With `lag` 0 and one trainer, every step takes exactly the next global batch
of the trainer's data, in order: training is the same as in one process. With
`lag` 1 the next batch flows while the stages average the last one, so their
peers never wait for the all-reduce.

A stage whose every peer died loses its state: the peer that serves it next
starts from its own parameters, at an older version. Pacing then counts from
the stage's new version (re-based, with what is still in flight), and the
loop's step count keeps what it had counted before.

A microbatch that no peer of some stage could take stays in the loop and
resumes where it stopped once the stage has peers again. A trainer that waits
for a stage's step with nothing left in flight (with `lag` 0, part of the
batch died with a peer) asks that stage to step with what it holds. When its
live peers hold nothing (the whole batch died with the peer that held it), that
flush cannot make them step, and the ledger replays the dead peer's microbatches
only once a step goes without it: the loop then starts one more microbatch than
the pace allows, for the live peers to step on, and one more after every second
flush that still changed nothing (that microbatch too may have gone to the peer
that was dying), never a global batch beyond the pace.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .trainer import Microbatch, PipelineTrainer, StageFailed

__all__ = ["TrainerLoop"]

log = logging.getLogger("shoal.pipeline")

REFRESH_S = 2.0  # the stage records are read this often (and whenever paced)
PACED_POLL_S = 0.1
LOSS_EMA = 0.05
WARN_EVERY_S = 30.0
FLUSH_AFTER_S = 3.0  # paced this long with nothing in flight: ask the slowest stage to step


class TrainerLoop:
    def __init__(
        self,
        trainer: PipelineTrainer,
        batches: Iterator[Any],
        *,
        inputs_of: Callable[[Any], torch.Tensor],
        loss_of: Callable[[torch.Tensor, Any], torch.Tensor],
        global_batch: int,
        lag: int = 1,
        concurrency: int | None = None,
    ) -> None:
        self.trainer = trainer
        self.batches = batches
        self.inputs_of = inputs_of
        self.loss_of = loss_of
        self.global_batch = global_batch
        self.lag = lag
        self.concurrency = concurrency or 2 * trainer.stages
        self.started_samples = 0
        self.base: int | None = None  # the slowest stage's version pacing counts from
        self._peak = 0  # the slowest stage's newest version since `base`
        self._steps_before = 0  # steps counted before the last re-base
        self._completed_base = 0  # the trainer's completed samples at the last re-base
        self.loss: float | None = None  # an EMA of the microbatches' losses
        self.last_loss: float | None = None
        self.on_microbatch: Callable[[Microbatch], None] | None = None
        self._next_id = 0
        self._refreshed = -float("inf")
        self._retry: list[Microbatch] = []
        self._warned = -float("inf")
        self._paced_since: float | None = None
        # (the slowest version a flush last asked to step from, flushes since it stepped)
        self._flushed: tuple[int, int] = (-1, 0)
        self._overdraft = 0  # samples the pace lets through beyond `lag` (see `_flush_if_stuck`)

    def new_id(self) -> int:
        """A fresh microbatch id (also for requests that are no microbatch, such as the
        held-out batches' forwards: their keys look like any other's)."""
        self._next_id += 1
        return self._next_id - 1

    @property
    def version(self) -> int:
        """The slowest stage's version: the optimizer steps the whole model has taken."""
        return min(self.trainer.versions)

    @property
    def steps(self) -> int:
        """Optimizer steps since this loop started."""
        if self.base is None:
            return 0
        return self._steps_before + max(0, self.version - self.base)

    @property
    def in_flight(self) -> int:
        """Samples started and not completed yet."""
        return self.started_samples - (self.trainer.counters.samples - self._completed_base)

    def _rebase_if_regressed(self) -> None:
        """Pace from the slowest stage's version again if it went back (a stage lost
        its state): pacing by steps from a version above the stage's would wait for
        steps it can never take."""
        version = self.version
        if self.base is None:
            return
        if version >= self._peak:
            self._peak = version
            return
        log.warning(
            "a stage went back from version %d to %d (its state was lost with its peers): "
            "training on from there",
            self._peak,
            version,
        )
        self._steps_before += max(0, self._peak - self.base)
        self.started_samples = self.in_flight
        self._completed_base = self.trainer.counters.samples
        self.base = self._peak = version

    async def run(self, stop: asyncio.Event | None = None, *, steps: int | None = None) -> None:
        """Train until `stop` is set or the stages took `steps` steps since the start."""
        stop = stop or asyncio.Event()
        await self._refresh(force=True)
        self.base = self._peak = self.version
        workers = [
            asyncio.ensure_future(self._worker(stop, steps)) for _ in range(self.concurrency)
        ]
        try:
            await asyncio.gather(*workers)
        finally:
            for w in workers:
                w.cancel()
            for w in workers:
                with contextlib.suppress(asyncio.CancelledError):
                    await w

    def _done(self, stop: asyncio.Event, steps: int | None) -> bool:
        return stop.is_set() or (steps is not None and self.steps >= steps)

    async def _worker(self, stop: asyncio.Event, steps: int | None) -> None:
        while not self._done(stop, steps):
            mb = self._retry.pop(0) if self._retry else await self._next(stop, steps)
            if mb is None:
                return
            try:
                await self.trainer.resume(mb)
            except StageFailed as e:
                now = time.monotonic()
                if now - self._warned >= WARN_EVERY_S:
                    self._warned = now
                    log.info("microbatches wait: %s", e)
                self._retry.append(mb)
                await asyncio.sleep(1.0)
                await self._refresh(force=True)
                continue
            assert mb.loss is not None
            self.last_loss = mb.loss
            self.loss = (
                mb.loss if self.loss is None else (1 - LOSS_EMA) * self.loss + LOSS_EMA * mb.loss
            )
            if self.on_microbatch is not None:
                self.on_microbatch(mb)
            await self._refresh()

    async def _next(self, stop: asyncio.Event, steps: int | None) -> Microbatch | None:
        """The next microbatch of our data, once the pace allows it (None: done)."""
        while not self._done(stop, steps):
            assert self.base is not None
            if self._overdraft and self.version > self._flushed[0]:
                self._overdraft = 0  # (it stepped: the pace is `lag`'s again)
            if self.started_samples < self._paced_allowance() + self._overdraft:
                batch = next(self.batches)
                mb = Microbatch(
                    self._next_id,
                    self.inputs_of(batch),
                    lambda y, b=batch: self.loss_of(y, b),
                    batch=batch,
                )
                self._next_id += 1
                self.started_samples += mb.samples
                self._paced_since = None
                return mb
            if self._paced_since is None:
                self._paced_since = time.monotonic()
            with contextlib.suppress(TimeoutError):  # a stage's step, pushed to us
                async with asyncio.timeout(PACED_POLL_S):
                    await self.trainer.changed.wait()
            await self._refresh(every=PACED_POLL_S)
            await self._flush_if_stuck()
        return None

    def _paced_allowance(self) -> int:
        """The samples the pace lets us start since `base`: `lag + 1` global batches
        beyond what the slowest stage stepped. Steps take all their peers hold, often
        more than a global batch: pace by the samples stepped, not by the steps."""
        assert self.base is not None
        stepped = min(
            self.trainer.stepped(s, self.base, self.global_batch)
            for s in range(self.trainer.stages)
        )
        return stepped + (1 + self.lag) * self.global_batch

    async def _flush_if_stuck(self) -> None:
        """Everything sent has come back and the slowest stage still has not stepped:
        part of its batch died with a peer. Ask it to step with what it has."""
        now = time.monotonic()
        if self._paced_since is None or now - self._paced_since < FLUSH_AFTER_S:
            return
        if self.in_flight > 0 or self._retry:
            return  # microbatches still on their way
        self._paced_since = now
        slowest = min(self.trainer.versions)
        flushed, times = self._flushed
        times = times + 1 if flushed == slowest else 1
        self._flushed = (slowest, times)
        beyond = self.started_samples - self._paced_allowance()
        if times % 2 == 0 and beyond < self.global_batch:
            # A flush came and went with nothing in flight, and the stage did not step:
            # its live peers hold nothing of this version (the batch died with a peer).
            # One fresh microbatch gives them something to step on; that step, without
            # the dead peer, is what replays its microbatches. Again every second flush
            # that changed nothing: the last such microbatch may have gone to the peer
            # that died (it was still serving, slow in the step the flushes waited
            # for), and a stage whose live peers hold nothing never steps. Never a
            # global batch beyond the pace: by then they hold one and need no flush.
            self._overdraft = beyond + 1
            log.info("stage version %d: its live peers hold nothing to step on; one "
                     "microbatch beyond the pace for them", slowest)  # fmt: skip
        for s, version in enumerate(self.trainer.versions):
            if version == slowest:
                agreed = await self.trainer.flush(s)
                log.info(
                    "stage %d has not stepped from %d: asked %d peers to step", s, version, agreed
                )

    async def _refresh(self, *, force: bool = False, every: float = REFRESH_S) -> None:
        now = time.monotonic()
        if force or now - self._refreshed >= every:
            self._refreshed = now
            try:
                await self.trainer.refresh()
            except Exception as e:  # the DHT will answer next time
                log.debug("reading the stage records failed: %r", e)
            self._rebase_if_regressed()
