"""What a stage's requests and answers may hold: samples, and elements per sample in and out.

A request's header names its samples and each tensor's header its shape: claims of
the sender, which would make the receiver allocate (and a stage compute on) what
they say. `StageBounds` is what the receiver expects instead, from the model
itself: at most `max_samples` samples a request, and per sample the elements of the
stage's inputs (what the stage before it outputs) and of its outputs (the
gradient a backward brings). A stage server refuses a request past them before
it reads or allocates anything of it (`PayloadTooLarge`, counted); a trainer
refuses such an answer, and a referee such an audit request, the same way.

`probe_bounds` measures the elements per sample by running one sample of the
task's held-out data through the stages, on PyTorch's meta device (shapes only:
no memory, no compute), or, where a task's layers do not run there, on the CPU.
A task that builds its stages alone (`stage_build`) has them built one at a time,
each freed before the next, so that a peer holds no stage but its own for real
(meta builds allocate and initialize nothing; a stage that does not run on the
meta device is built on the CPU, said in the log).
It assumes what every pipelined task keeps (`peer.task`): one sample's inputs
have the same shape in every batch. An honest request holds one task batch,
at most the experiment's ``global_batch`` samples (or the probed batch's,
should a task's batch be larger).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import torch

from shoal.transport.errors import PayloadTooLarge

from .stage_build import build_stage, builds_stages_alone

__all__ = ["StageBounds", "probe_bounds"]

log = logging.getLogger("shoal.pipeline")


@dataclass(frozen=True)
class StageBounds:
    """The most one request of a stage holds (elements are per sample)."""

    max_samples: int
    input_elements: int  # one sample of the stage's inputs
    output_elements: int  # one sample of its outputs (a backward's output gradient)
    # Bytes autograd keeps for one sample's backward inside the stage (0: not probed):
    # what a memory budget counts for its activations (`memory.stage_memory`).
    activation_bytes: int = 0
    # Whether the stage's inputs are floating point (a backward then answers with their
    # gradient, which the worker keeps for retries: `stage.RETAINED_ANSWERS`).
    input_floating: bool = True
    # Elements of the stage's largest parameter (0: not probed): what the gradient
    # of one parameter and AdamW's per-parameter temporaries cost (`memory`).
    largest_parameter: int = 0

    def check_samples(self, samples: int) -> None:
        """Refuse a request of more samples than a microbatch holds, before its tensors."""
        if samples > self.max_samples:
            raise PayloadTooLarge(f"{samples} samples in a request, at most {self.max_samples}")

    def inputs(self, samples: int | None = None) -> int:
        """Elements of `samples` samples of inputs (None: of the largest request)."""
        return (self.max_samples if samples is None else samples) * self.input_elements

    def outputs(self, samples: int | None = None) -> int:
        return (self.max_samples if samples is None else samples) * self.output_elements


def probe_bounds(task: Any, seed: int, stages: int, global_batch: int) -> list[StageBounds]:
    """The bounds of every stage of `task`'s pipeline (blocking: call it in a thread)."""
    batch = task.eval_batches(1)[0]
    inputs = task.stage_inputs(batch)
    max_samples = max(global_batch, int(inputs.shape[0]))
    if builds_stages_alone(task):
        sizes, kept, largest = _per_sample_alone(task, seed, stages, inputs[:1])
    else:
        try:
            sizes, kept, largest = _per_sample(task, seed, stages, inputs[:1], torch.device("meta"))
        except _NOT_ON_META as e:
            log.info("the stages do not run on the meta device (%r): probing on the CPU", e)
            sizes, kept, largest = _per_sample(task, seed, stages, inputs[:1], torch.device("cpu"))
    floating = inputs.is_floating_point()
    return [
        StageBounds(max_samples, sizes[k], sizes[k + 1], kept[k], floating or k > 0, largest[k])
        for k in range(stages)
    ]


_NOT_ON_META = (NotImplementedError, RuntimeError, TypeError, ValueError)


def _per_sample(
    task: Any, seed: int, stages: int, x: torch.Tensor, device: torch.device
) -> tuple[list[int], list[int], list[int]]:
    """Elements of one sample at each boundary (stage 0's inputs, then each output),
    the bytes each stage keeps for that sample's backward, and each stage's largest
    parameter (elements)."""
    with device:
        modules = task.make_stages(seed, stages)
    x = x.to(device)
    sizes, kept = [_elements(x)], []
    for module in modules:
        saved, out = saved_bytes(module, x)
        x = out.detach()
        kept.append(saved)
        sizes.append(_elements(x))
    return sizes, kept, [_largest_parameter(m) for m in modules]


def _largest_parameter(module: torch.nn.Module) -> int:
    return max((p.numel() for p in module.parameters()), default=0)


def saved_bytes(module: torch.nn.Module, x: torch.Tensor) -> tuple[int, torch.Tensor]:
    """Bytes autograd keeps for the backward of `module(x)` (each storage once, the
    parameters not; on the meta device too: nothing is allocated) and the output."""
    # (A storage's identity: on the meta device every data pointer is 0.)
    own = {p.untyped_storage()._cdata for p in module.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage._cdata not in own:
            seen[storage._cdata] = storage.nbytes()
        return t

    if x.is_floating_point():
        x = x.detach().requires_grad_(True)
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(x)
    return sum(seen.values()), out


def _per_sample_alone(
    task: Any, seed: int, stages: int, x: torch.Tensor
) -> tuple[list[int], list[int], list[int]]:
    """As `_per_sample`, each stage built alone and freed before the next."""
    sizes, kept, largest = [_elements(x)], [], []
    for k in range(stages):
        try:
            with torch.device("meta"):
                module = build_stage(task, seed, stages, k)
                saved, out = saved_bytes(module, x.to("meta"))
        except _NOT_ON_META as e:
            log.info("stage %d does not run on the meta device (%r): probing on the CPU", k, e)
            with torch.device("cpu"):
                module = build_stage(task, seed, stages, k)
            # (The shapes are what counts.)
            saved, out = saved_bytes(module, torch.zeros(x.shape, dtype=x.dtype))
        x = out.detach()
        largest.append(_largest_parameter(module))
        del module, out
        kept.append(saved)
        sizes.append(_elements(x))
    return sizes, kept, largest


def _elements(t: torch.Tensor) -> int:
    return max(1, math.prod(t.shape[1:]))
