"""A stage server's computations: requests waiting together computed as one batch.

Requests of one kind (forward or backward) whose tensors fit together are
taken from the queue in order, up to `MAX_BATCH_SAMPLES` samples, and run
through the worker in one compute thread (`StageWorker.forward_many`,
`backward_many`); each request's answer gets its share of the batch's time.
A request whose caller gave up is dropped before it is computed (a backward
not computed is not counted; its trainer sends it to another peer), and a
backward whose attempt its trainer fenced fails with `Fenced` (`StageWorker.fence`:
its trainer asks another peer). Answers
a trainer asked a commitment for are sealed in a second thread (`seal`), so
the next batch need not wait for the hashing. While backwards are held
(`hold_backwards`: a peer within a memory budget, while its step averages) they
wait in order and the forwards behind them are computed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from shoal.transport.tasks import TaskSet

from .audit import AuditRequest
from .stage import StageWorker

__all__ = ["MAX_BATCH_SAMPLES", "ComputeQueue", "Fenced", "Job"]

log = logging.getLogger("shoal.pipeline")

MAX_BATCH_SAMPLES = 256


class Fenced(Exception):
    """A backward whose trainer gave up on it and fenced it: not applied."""


@dataclass
class Job:
    kind: str  # "forward" | "backward" | "dry" (a backward that counts nothing)
    request: Any  # the inputs tensor, or a BackwardRequest
    samples: int
    audit: AuditRequest | None = None  # seal the answer (the request asked for a commitment)
    sealed: bytes | None = None  # its commitment (made in the sealing thread)
    retried: bool = False  # a backward answered before: its old answer is not sealed
    attempt: bytes | None = None  # a backward's attempt, which its trainer may fence
    done: asyncio.Future[tuple[Any, float]] = field(repr=False, default=None)  # type: ignore[assignment]

    def fits(self, other: Job) -> bool:
        """Whether the two can be computed in one batch."""
        a = self.request if self.kind == "forward" else self.request[1]
        b = other.request if other.kind == "forward" else other.request[1]
        return self.kind == other.kind and a.shape[1:] == b.shape[1:] and a.dtype == b.dtype


def use_device_in_thread(device: torch.device) -> None:
    """Make `device` the thread's current CUDA device (a pool's initializer): a backward
    run first in a fresh thread otherwise finds no CUDA context there (torch warns
    "Attempting to run cuBLAS, but there was no current CUDA context"; seen on an
    H200). Never raises: an initializer that raises breaks the pool, and with it every
    computation of the stage, where the warning alone is harmless."""
    if device.type != "cuda":
        return
    try:
        torch.cuda.set_device(device)
    except Exception as e:  # (the first computation then reports what is wrong)
        log.warning("could not make %s this stage thread's device: %r", device, e)


class ComputeQueue:
    """Runs `worker`'s requests in batches; `seal(job, version, answer)` (in the sealing
    thread) makes the commitment of a job that asked for one."""

    def __init__(
        self, worker: StageWorker, stage: int, seal: Callable[[Job, int | None, Any], None]
    ) -> None:
        self.worker = worker
        self.stage = stage
        self.seal = seal
        self.batches = 0  # computations run (several requests may share one)
        self._jobs: list[Job] = []
        self._backwards_held = False
        self._wake = asyncio.Event()
        self._compute = ThreadPoolExecutor(
            1, thread_name_prefix=f"shoal-stage{stage}",
            initializer=use_device_in_thread, initargs=(worker.device,),
        )  # fmt: skip
        self._sealer = ThreadPoolExecutor(1, thread_name_prefix=f"shoal-seal{stage}")
        self._sealing = TaskSet(log, "stage sealing")

    @property
    def queued(self) -> int:
        return len(self._jobs)

    async def submit(self, job: Job) -> tuple[Any, float]:
        """`job`'s answer and its share of the batch's compute seconds."""
        job.done = asyncio.get_running_loop().create_future()
        self._jobs.append(job)
        self._wake.set()
        return await job.done

    def hold_backwards(self, held: bool) -> None:
        """Compute no backward while `held` (a stage peer within a memory budget, while
        its step averages: no bucket of the next step's gradients exists beside the
        step's and the round's result; `memory.StageLimits`). They wait in order."""
        self._backwards_held = held
        if not held:
            self._wake.set()

    async def in_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` on the compute thread, behind the batches already running."""
        return await asyncio.get_running_loop().run_in_executor(self._compute, fn, *args)

    def close(self) -> None:
        self._sealing.cancel()
        self._compute.shutdown(wait=False, cancel_futures=True)
        self._sealer.shutdown(wait=False, cancel_futures=True)
        for job in self._jobs:
            if not job.done.done():
                job.done.set_exception(ConnectionError("the stage server closed"))

    async def run(self) -> None:
        """Compute what is submitted, until cancelled."""
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._jobs:
                batch = self._take_batch()
                if not batch:  # (none left, or only held backwards: until a wake)
                    break
                try:
                    results, seconds, version = await loop.run_in_executor(
                        self._compute, _run, self.worker, batch
                    )
                    batch, results = _without_fenced(batch, results)
                except Exception as e:  # a request the module cannot compute: fail them all
                    log.info("stage %d: a %s batch of %d failed: %r (%s)", self.stage,
                             batch[0].kind, len(batch), e, _describe(batch))  # fmt: skip
                    for job in batch:
                        if not job.done.done():
                            job.done.set_exception(e)
                    continue
                self.batches += 1
                if any(job.audit is not None for job in batch):
                    # Sealed off the compute thread: the next batch need not wait for it.
                    self._sealing.spawn(self._seal_batch(batch, results, seconds, version))
                else:
                    _answer(batch, results, seconds)

    async def _seal_batch(
        self, batch: list[Job], results: list[Any], seconds: float, version: int | None
    ) -> None:
        answers = results if batch[0].kind == "forward" else [grad for grad, _ in results]

        def seal_all() -> None:
            for job, answer in zip(batch, answers, strict=True):
                self.seal(job, version, answer)

        try:
            await asyncio.get_running_loop().run_in_executor(self._sealer, seal_all)
        finally:
            _answer(batch, results, seconds)

    def _take_batch(self) -> list[Job]:
        """The first waiting job and those of its kind that fit with it, in order.
        Jobs whose callers gave up are dropped: a backward not computed is not
        counted, and its trainer sends it to another peer. Held backwards stay."""
        self._jobs = [j for j in self._jobs if not j.done.done()]
        takeable = [j for j in self._jobs if not self._held(j)]
        if not takeable:
            return []
        first = takeable[0]
        batch, rest, samples = [], [], 0
        for job in self._jobs:
            if self._held(job):
                rest.append(job)
            elif job.fits(first) and samples + job.samples <= max(MAX_BATCH_SAMPLES, first.samples):
                batch.append(job)
                samples += job.samples
            else:
                rest.append(job)
        self._jobs = rest
        return batch

    def _held(self, job: Job) -> bool:
        return self._backwards_held and job.kind == "backward"


def _describe(batch: list[Job]) -> str:
    tensors = [j.request if j.kind == "forward" else j.request[1] for j in batch]
    return ", ".join(f"{tuple(t.shape)} {t.dtype}" for t in tensors)


def _answer(batch: list[Job], results: list[Any], seconds: float) -> None:
    total = sum(job.samples for job in batch)
    for job, result in zip(batch, results, strict=True):
        if not job.done.done():
            job.done.set_result((result, seconds * job.samples / total))


def _without_fenced(batch: list[Job], results: list[Any]) -> tuple[list[Job], list[Any]]:
    """Fail the fenced jobs of a backward batch (their results are None); the others."""
    if batch[0].kind == "forward":
        return batch, results
    kept = [(job, result) for job, result in zip(batch, results, strict=True) if result is not None]
    for job, result in zip(batch, results, strict=True):
        if result is None and not job.done.done():
            job.done.set_exception(Fenced("the trainer fenced this attempt"))
    return [job for job, _ in kept], [result for _, result in kept]


def _run(worker: StageWorker, batch: list[Job]) -> tuple[list[Any], float, int | None]:
    """A batch of one kind through the worker (in the compute thread), timed, with the
    version of the weights it was computed with (None: unknown, mid-download)."""
    started = time.perf_counter()
    if batch[0].kind == "forward":
        with worker.lock:  # (re-entered by forward_many: the version is the computation's)
            version = worker.version
            results: list[Any] = worker.forward_many([job.request for job in batch])
    elif batch[0].kind == "dry":
        with worker.lock:
            version = worker.version
            grads = worker.input_gradients([job.request for job in batch])
        results = [(grad, None) for grad in grads]
    else:
        with worker.lock:
            version = worker.version
            # A retry's answer is the old one, computed at a version we may not hold now.
            retried = {job.request[0] for job in batch if worker.answered(job.request[0])}
            results = worker.backward_many(
                [job.request for job in batch], [job.attempt for job in batch]
            )
        for job in batch:
            if job.request[0] in retried:
                job.retried = True
    return results, time.perf_counter() - started, version
