"""What serving one stage costs a peer in memory, estimated before the stage is built.

Sans-I/O: the caller gives the stage's parameter elements (`stage_build.stage_size`,
from the task's config: nothing built), its bounds (`bounds.StageBounds`: elements
per sample at its two boundaries) and how many samples its trainers keep in
flight; this counts every copy the code keeps of them. With B the bytes of the
stage's parameters (float32: 4 per element):

- parameters: B;
- gradients: the worker's accumulation bucket that backwards fill (`stage.
  StageWorker`: B), and one parameter's worth at a time beside it (L, the
  stage's largest parameter: autograd's gradient, added to the bucket and freed
  the moment it is complete, or AdamW's per-parameter temporaries, never both
  at once: 2L);
- optimizer: AdamW's two moments (2B); in a file (`StageLimits.moments_on_disk`),
  what a step holds of them: two slices of the parameter it steps
  (`averaging.paged_adamw`: 1 MiB each, or the largest parameter when smaller),
  whose temporaries are as small (within the 2L above);
- averaging (`stage_optimizer.StageOptimizer`, `averaging.Averager`): while a step
  averages (beside the next step's bucket in `gradients`, unless backwards wait
  meanwhile: `StageLimits.backwards_while_averaging`), its own bucket, which the
  all-reduce sends as it is (scaled in place: B), the round's result vector that
  the all-reduce's pool keeps from one round to the next (B), the receive slots of
  each other member's stream (bounded by the chunking), the connection's buffers of
  each other member's two streams (what waits for its reader: a flow-control window
  each, `transport.connection.bulk_buffer_bytes`; 2 MiB for a peer held to a budget,
  `transport.mux.LEAN_MAX_WINDOW`), and one transient copy of
  the parameters and moments (3B): the committed state is served to downloaders and
  checkpointed from the live tensors (`Averager(live_state=True)`), copied only
  when a commit comes while a download reads it, and a re-sync drops that copy
  before it downloads its own (the downloaded tensors). With a folder for them (a
  daemon's `<data dir>/state-copies/`: `state_sync.StateServer(copies_dir)` and
  `state_sync.downloads_in`) both live in a file the kernel writes back and may
  drop, not in the process's memory: 0. Parameters on a device (a GPU) cost two
  more (2B): the host buffer the bucket is copied into for the round (which the
  step then reads), and the float32 host copy of the parameters that the step
  runs on, by the CPU's code, for the same bits as a CPU peer's
  (`stage_optimizer`; the moments live on the host with it);
- audits (an experiment that verifies its stages): the answers' full-precision
  results a stage peer keeps for its trainers' audits (`audit.OutputStore`: five
  minutes, at most `RETENTION_BYTES`);
- activations: what a pass through the stage keeps for its backward, for the
  samples a pass takes: those of one computation (`compute_queue.MAX_BATCH_SAMPLES`,
  or the trainers' samples in flight when fewer), or fewer within a budget
  (`StageLimits.pass_samples`); and the boundary tensors (inputs and output
  gradients) of every request waiting in the queue;
- answers kept for retries: the input gradients of the last
  `stage.RETAINED_ANSWERS` backwards (a retry gets the same answer), each of
  up to a request's samples, within `stage.RETAINED_ANSWER_BYTES` or less within
  a budget (`StageLimits.answer_bytes`; none for a stage whose inputs are ids);
- the server's own (`SERVER_BYTES`): the heaps of its compute, sealing and
  worker threads and its bookkeeping, which a process that serves no stage
  does not have (measured: a stage peer's peak came within 3 MiB over the rest
  of the estimate above a trainer's, the largest of eight).

A peer with a budget serves a stage that fits only leanly with the limits
`fit_stage` chooses (fewer answers kept, then backwards that wait while a step
averages, then AdamW's moments in a file, then passes of fewer samples).

So a stage costs about 9B plus its activations, 6B with its copies on disk (5B
when backwards also wait while a step averages, 3B with AdamW's moments in a file
too: `StageLimits.moments_on_disk`)
(11B while the step copied its bucket into a buffer of the averager's and
autograd's gradients all existed before they were added; 20B while every
commit froze a copy for downloads). What
autograd keeps per sample is measured where the bounds are probed
(`bounds.probe_bounds`: one sample through the stages on the meta device, shapes
only, with a hook on what autograd saves: `StageBounds.activation_bytes`);
bounds that lack it (0) take
`PRIOR_ACTIVATION_FACTOR` times the stage's two boundary tensors.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from shoal.averaging.butterfly import AllReduceConfig
from shoal.averaging.paged_adamw import slice_bytes
from shoal.averaging.reducer import float64_scratch
from shoal.transport.connection import bulk_buffer_bytes
from shoal.transport.mux import DEFAULT_MAX_WINDOW, MuxLimits

from .audit import RETENTION_BYTES
from .bounds import StageBounds
from .compute_queue import MAX_BATCH_SAMPLES
from .stage import RETAINED_ANSWER_BYTES, RETAINED_ANSWERS

__all__ = [
    "DEFAULT_LIMITS",
    "PRIOR_ACTIVATION_FACTOR",
    "SERVER_BYTES",
    "StageLimits",
    "StageMemory",
    "fit_stage",
    "stage_memory",
    "stages_that_fit",
    "trainer_memory",
]

# Activations a stage keeps per sample for its backward when its bounds were not
# probed for them, as a multiple of its two boundary tensors (a transformer block
# keeps about 16 hidden-state sized tensors: this covers a few blocks).
PRIOR_ACTIVATION_FACTOR = 64
FLOAT32 = 4
SERVER_BYTES = 16 << 20


@dataclass(frozen=True)
class StageMemory:
    """Bytes serving one stage costs, by what holds them (`total`: their sum)."""

    parameters: int
    gradients: int
    optimizer: int
    averaging: int
    activations: int
    audits: int = 0
    answers: int = 0
    server: int = SERVER_BYTES

    @property
    def total(self) -> int:
        held = self.parameters + self.gradients + self.optimizer + self.averaging
        return held + self.activations + self.audits + self.answers + self.server

    def as_dict(self) -> dict[str, int]:
        return {
            "parameters": self.parameters,
            "gradients": self.gradients,
            "optimizer": self.optimizer,
            "averaging": self.averaging,
            "activations": self.activations,
            "audits": self.audits,
            "answers": self.answers,
            "server": self.server,
            "total": self.total,
        }


@dataclass(frozen=True)
class StageLimits:
    """How a stage peer within a memory budget computes and what it keeps
    (`fit_stage`): the most samples one pass through its layers takes (None: a
    computation is one pass; `stage.StageWorker.pass_samples`) and the bytes of input
    gradients kept for retries (`answers.AnswerStore`: at least the newest one)."""

    pass_samples: int | None = None
    answer_bytes: int = RETAINED_ANSWER_BYTES
    # Whether backwards are computed while a step averages (False: they wait,
    # `compute_queue.ComputeQueue.hold_backwards`, and no bucket of the next step's
    # gradients exists beside the step's and the round's result: B less).
    backwards_while_averaging: bool = True
    # Whether AdamW's moments live in a file of the peer's data directory, their pages
    # given back after each use (`averaging.paged`, `StageOptimizer(moments_dir=...)`):
    # one slice's moments held at a time instead of all of them (2B less).
    moments_on_disk: bool = False

    def as_dict(self) -> dict[str, int | bool | None]:
        return {
            "pass_samples": self.pass_samples,
            "answer_bytes": self.answer_bytes,
            "backwards_while_averaging": self.backwards_while_averaging,
            "moments_on_disk": self.moments_on_disk,
        }


DEFAULT_LIMITS = StageLimits()


def computed_samples(bounds: StageBounds, in_flight: int) -> int:
    """Samples one computation of the stage takes at most: the compute queue joins
    waiting requests up to MAX_BATCH_SAMPLES (one request may be larger)."""
    return min(max(MAX_BATCH_SAMPLES, bounds.max_samples), max(1, in_flight))


def stage_memory(
    parameters: int,
    bounds: StageBounds,
    *,
    in_flight: int,
    activation_bytes_per_sample: int | None = None,
    group_size: int = 2,
    element_bytes: int = FLOAT32,
    allreduce: AllReduceConfig | None = None,
    audits: bool = False,
    on_device: bool = False,
    copies_on_disk: bool = False,
    limits: StageLimits = DEFAULT_LIMITS,
    window: int = DEFAULT_MAX_WINDOW,
) -> StageMemory:
    """The bytes serving a stage of `parameters` elements costs (see the module doc).

    `in_flight`: samples the trainers keep in flight (requests that may wait in
    the queue at once); `activation_bytes_per_sample`: what autograd keeps per
    sample in this stage (None: the bounds' probe, else `PRIOR_ACTIVATION_FACTOR`
    x its boundaries);
    `group_size`: the peers of the stage's all-reduce (the receive slots); `audits`:
    the experiment verifies its stages (their answers are kept for audits);
    `on_device`: the parameters live on a device (a GPU), not in host memory;
    `copies_on_disk`: the transient copy of the parameters and moments (3B) goes to
    a file, not to memory (a peer with a data directory: `copies_dir`); `limits`:
    the samples a pass takes, the answers kept (`fit_stage` chooses them); `window`:
    the receive window of our connections (`MuxLimits.max_window`)."""
    if parameters < 0 or in_flight < 0 or group_size < 1:
        raise ValueError("parameters >= 0, in_flight >= 0 and group_size >= 1")
    b = parameters * element_bytes
    boundary = (bounds.input_elements + bounds.output_elements) * FLOAT32
    per_sample = activation_bytes_per_sample
    if per_sample is None:
        per_sample = bounds.activation_bytes or PRIOR_ACTIVATION_FACTOR * boundary
    computed = computed_samples(bounds, in_flight)
    in_pass = min(computed, limits.pass_samples or computed)
    # A pass's activations, and the boundaries of every request waiting, of the
    # computation's, and of its answers (input gradients, outputs).
    activations = in_pass * per_sample + 2 * max(in_flight, computed) * boundary
    # One parameter's gradient or AdamW temporaries (bounds that lack the largest
    # parameter: as much as the whole stage's gradients).
    one_parameter = 2 * bounds.largest_parameter * element_bytes or b
    paged_slice = slice_bytes(bounds.largest_parameter * element_bytes or b, element_bytes)
    # The step's bucket and the round's result; the next step's bucket, which backwards
    # fill while the step averages, is `gradients` (none then when they wait).
    held = 0 if limits.backwards_while_averaging else 1
    round_buffers = (2 - held + (2 if on_device else 0)) * b
    return StageMemory(
        parameters=b,
        gradients=b + one_parameter,
        # (On disk: the pages of the two moments' slices being stepped.)
        optimizer=2 * paged_slice if limits.moments_on_disk else 2 * b,
        averaging=round_buffers
        + (0 if copies_on_disk else 3 * b)
        + _receive_slots(parameters, group_size, allreduce)
        + _connection_buffers(group_size, window),
        activations=activations,
        audits=RETENTION_BYTES if audits else 0,
        answers=_retained_answers(bounds, in_flight, limits.answer_bytes),
    )


def _retained_answers(bounds: StageBounds, in_flight: int, answer_bytes: int) -> int:
    """Bytes of the input gradients the worker keeps for retries: those of the last
    RETAINED_ANSWERS backwards, each of at most one request's samples, within
    `answer_bytes` (and at least the newest one: `answers.AnswerStore`)."""
    if not bounds.input_floating:
        return 0
    samples = min(bounds.max_samples, max(1, in_flight))
    one = samples * bounds.input_elements * FLOAT32
    return min(RETAINED_ANSWERS * one, answer_bytes + one)


def fit_stage(
    parameters: int, bounds: StageBounds, *, budget: int | None, **options: Any
) -> tuple[StageMemory, StageLimits]:
    """The limits a stage peer with `budget` bytes serves the stage with, and their
    cost (`options`: `stage_memory`'s). The defaults when they fit (or with no budget).
    Else, cheapest in speed first: the answers kept shrink, to the newest one (a retry
    whose answer was dropped only costs a recomputation: `answers`); then backwards wait
    while a step averages (B less: the next step's bucket; they are late by the round's
    time, nothing is recomputed); then, for a peer with a data directory
    (`copies_on_disk`) and the parameters on the CPU, AdamW's moments go to a file (2B
    less: a step reads and writes them through the page cache, and the disk when the
    kernel drops them); then passes take the most samples that fit (one at the
    least: activations grow with the samples a pass takes, while the state does not
    shrink at all). The answers get back what is left, up to their default. The cost is
    over the budget only when the stage does not fit at all (one sample a pass, one
    answer kept, backwards waiting, moments on disk where they can be)."""

    def cost(
        pass_samples: int | None, answer_bytes: int, during: bool, disk: bool = False
    ) -> StageMemory:
        limits = StageLimits(pass_samples, answer_bytes, during, disk)
        return stage_memory(parameters, bounds, limits=limits, **options)

    def fitted(
        pass_samples: int | None, during: bool, disk: bool = False
    ) -> tuple[StageMemory, StageLimits]:
        spare = budget - cost(pass_samples, 0, during, disk).total
        answer_bytes = min(RETAINED_ANSWER_BYTES, spare)
        limits = StageLimits(pass_samples, answer_bytes, during, disk)
        return cost(pass_samples, answer_bytes, during, disk), limits

    default = stage_memory(parameters, bounds, **options)
    if budget is None or default.total <= budget:
        return default, DEFAULT_LIMITS
    for during in (True, False):
        if cost(None, 0, during).total <= budget:
            return fitted(None, during)
    # Moments in a file need the data directory's folder (the copies' one) and the
    # parameters on the CPU.
    disk = bool(options.get("copies_on_disk")) and not options.get("on_device")
    if disk and cost(None, 0, False, disk).total <= budget:
        return fitted(None, False, disk)
    if cost(1, 0, False, disk).total > budget:
        return cost(1, 0, False, disk), StageLimits(1, 0, False, disk)
    low, high = 1, computed_samples(bounds, options.get("in_flight", 1))
    while low < high:  # (the most samples a pass: cost grows with them)
        mid = (low + high + 1) // 2
        fits = cost(mid, 0, False, disk).total <= budget
        low, high = (mid, high) if fits else (low, mid - 1)
    return fitted(low, False, disk)


def _receive_slots(parameters: int, group_size: int, cfg: AllReduceConfig | None) -> int:
    """Bytes of the all-reduce's receive slots and its float64 scratch, for our part
    of a round of `group_size` (see `butterfly._round_info`, `lanes`, `lane_sums`)."""
    if group_size <= 1 or parameters == 0:
        return 0
    cfg = cfg or AllReduceConfig()
    chunk = max(1, cfg.chunk_bytes // 4)
    streams = cfg.streams_per_peer
    senders = (group_size - 1) * streams
    lane = math.ceil(parameters / group_size / streams)
    chunks = max(1, math.ceil(lane / chunk))
    window = max(2, min(cfg.window_chunks, (64 << 20) // (chunk * 4 * max(1, senders))))
    slots = senders * min(window, chunks) * chunk * 4
    return slots + streams * float64_scratch(chunk) * 8


def _connection_buffers(group_size: int, window: int) -> int:
    """Bytes the connections to the other members of a round buffer at most: each
    carries two of the round's streams (its contribution to our part, our part's
    result from its)."""
    if group_size <= 1:
        return 0
    return (group_size - 1) * bulk_buffer_bytes(MuxLimits(max_window=window), streams=2)


def trainer_memory(bounds: Sequence[StageBounds], in_flight: int) -> int:
    """Bytes a trainer keeps for its microbatches in flight: each stage's inputs
    (kept for the backward and for replays), outputs and the gradients coming back."""
    per_sample = sum(2 * (b.input_elements + b.output_elements) * FLOAT32 for b in bounds)
    return max(1, in_flight) * per_sample


def stages_that_fit(costs: Sequence[int], budget: int) -> list[int]:
    """The stages whose cost is within `budget` (bytes)."""
    return [k for k, cost in enumerate(costs) if cost <= budget]
