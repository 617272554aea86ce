"""The inner step on a device: batches prefetched off its thread, the optimizer, precision.

`BatchPrefetcher` draws the task's batches in a thread of its own, so a slow
tokenizer or disk never leaves the device idle; on a CUDA device it puts them in
pinned host memory, and the training thread copies them with
``non_blocking=True`` (the copy overlaps the kernels queued before it).
`InnerOptimizer` runs one step: forward under autocast at the experiment's
precision, backward (through a gradient scaler for fp16, whose range is too
narrow for small gradients), clipping, the experiment's optimizer (AdamW unless
its manifest names another, `optimizers.py`) at the learning rate of
`learning_rate_scale`. Parameters and optimizer state stay float32 whatever the
precision.

The learning-rate schedule is a pure function of the inner step number and the
manifest's hyperparameters, so every peer (and an auditor replaying a segment)
computes the same rate at the same step. A swarm has no known end: the decaying
schedules decay over a planned length (`total_steps` inner steps per peer) and
then stay flat at `lr_floor` for as long as the swarm goes on.
"""

from __future__ import annotations

import math
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .device import autocast
from .optimizers import DEFAULT_INNER_OPTIMIZER, make_inner_optimizer, state_layout
from .priority import lower_this_thread
from .state_codes import round_trip_

__all__ = [
    "LR_SCHEDULES",
    "WSD_DECAY_FRACTION",
    "BatchPrefetcher",
    "InnerOptimizer",
    "learning_rate_scale",
    "map_tensors",
    "to_device",
]

# constant: linear warmup, then the peak rate for ever (the schedule of manifests
#   without `lr_schedule`).
# cosine: warmup, then a half cosine from the peak down to `lr_floor` x peak at
#   step `total_steps`, flat at the floor after.
# wsd (warmup-stable-decay): warmup, the peak until the last `WSD_DECAY_FRACTION`
#   of the steps before `total_steps`, then a linear decay to the floor, flat after.
# inverse_sqrt: warmup, then peak x sqrt(warmup / step), never below the floor
#   (needs no planned length).
LR_SCHEDULES = ("constant", "cosine", "wsd", "inverse_sqrt")
WSD_DECAY_FRACTION = 0.2


def learning_rate_scale(hyper: dict[str, Any], step_index: int) -> float:
    """The inner lr at inner step `step_index` (from 0), as a fraction of `inner_lr`.

    `hyper` as `check_hyperparameters` returns it (a missing `lr_schedule` reads
    as "constant", what manifests before it meant)."""
    warmup = hyper["warmup_steps"]
    step = step_index + 1  # steps taken once this one is
    if warmup and step < warmup:
        return step / warmup
    schedule = hyper.get("lr_schedule", "constant")
    if schedule == "constant":
        return 1.0
    floor = hyper["lr_floor"]
    if schedule == "inverse_sqrt":
        return max(floor, math.sqrt(max(warmup, 1) / step))
    total = hyper["total_steps"]
    if schedule == "cosine":
        progress = min(1.0, max(0.0, (step - warmup) / max(1, total - warmup)))
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if schedule == "wsd":
        decay = max(1, round(WSD_DECAY_FRACTION * (total - warmup)))
        progress = min(1.0, max(0.0, (step - (total - decay)) / decay))
        return 1.0 - (1.0 - floor) * progress
    raise ValueError(f"unknown lr_schedule {schedule!r}; known: {', '.join(LR_SCHEDULES)}")


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """`fn` applied to every tensor in a batch (a tensor, or lists, tuples, dicts of them)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(map_tensors(v, fn) for v in obj)
    return obj


def to_device(batch: Any, device: torch.device) -> Any:
    if device.type == "cpu":
        return batch
    return map_tensors(batch, lambda t: t.to(device, non_blocking=True))


_DONE = object()


class BatchPrefetcher:
    """An iterator over `batches` that stays `depth` batches ahead, in a daemon thread."""

    def __init__(self, batches: Iterator[Any], device: torch.device, *, depth: int = 2) -> None:
        self._source = batches
        self._device = device
        self._pin = device.type == "cuda"
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._fill, name="shoal-batches", daemon=True)
        self._thread.start()

    def _fill(self) -> None:
        lower_this_thread()  # like the training thread it feeds
        try:
            for drawn in self._source:
                batch = map_tensors(drawn, lambda t: t.pin_memory()) if self._pin else drawn
                while not self._stopped.is_set():
                    try:
                        self._queue.put(batch, timeout=0.2)
                        break
                    except queue.Full:
                        continue
                if self._stopped.is_set():
                    return
            self._put_final(_DONE)
        except BaseException as e:  # handed to the consumer, raised in its thread
            self._put_final(e)

    def _put_final(self, item: Any) -> None:
        while not self._stopped.is_set():
            try:
                self._queue.put(item, timeout=0.2)
                return
            except queue.Full:
                continue

    def __iter__(self) -> BatchPrefetcher:
        return self

    def __next__(self) -> Any:
        item = self._queue.get()
        if item is _DONE:
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        return to_device(item, self._device)

    def close(self, *, wait: bool = True) -> None:
        """Stop drawing batches; `wait=False` leaves the thread to end by itself (within
        0.2 s), for a caller that must not stall (the trainer switching streams)."""
        self._stopped.set()
        if wait:
            self._thread.join(timeout=5.0)


class InnerOptimizer:
    """The experiment's optimizer with the lr schedule, clipping and precision, on its device."""

    def __init__(
        self,
        model: torch.nn.Module,
        hyper: dict[str, Any],
        *,
        device: torch.device,
        precision: str = "fp32",
    ) -> None:
        self.model = model
        self.hyper = hyper
        self.device = device
        self.precision = precision
        self.optimizer = make_inner_optimizer(model.parameters(), hyper)
        # fp16 only: bf16 has float32's range and needs no scaling.
        self.scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")

    def step(self, loss_of: Callable[[], torch.Tensor], step_index: int) -> float:
        """One inner step; `loss_of()` runs the forward pass (under autocast). The loss."""
        scale = learning_rate_scale(self.hyper, step_index)
        for group in self.optimizer.param_groups:
            group["lr"] = self.hyper["inner_lr"] * scale
        self.model.train()
        with autocast(self.device, self.precision):
            loss = loss_of()
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        if self.hyper["grad_clip"] > 0:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.hyper["grad_clip"])
        self.scaler.step(self.optimizer)
        self.scaler.update()
        # The one host-device synchronization of a step: the loss for the log.
        return float(loss.detach())

    def reset(self) -> None:
        """Forget the optimizer's per-parameter state (moments, step counts): the next
        step starts it afresh, as on a new peer (`inner_state` "reset"). The lr
        schedule goes on: it follows the trainer's step count."""
        self.optimizer.state.clear()

    def quantize_state(self) -> None:
        """Round every floating state tensor of more than one element (the moments; a
        step count stays) to what its 8-bit codes decode to (`state_codes`): the state
        a round starts from with `inner_state` "quantize", which a reveal then carries
        in codes."""
        for per_param in self.optimizer.state.values():
            for value in per_param.values():
                if isinstance(value, torch.Tensor) and value.numel() > 1:
                    round_trip_(value)

    def state_layouts(self) -> list[dict[str, tuple[int, ...]]]:
        """Per parameter, the state tensors (name -> shape) the optimizer keeps once it
        has stepped: what a reveal of this experiment's work may hold."""
        choice = self.hyper.get("inner_optimizer") or DEFAULT_INNER_OPTIMIZER
        return [state_layout(choice, p.shape) for p in self.model.parameters()]

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict(), "grad_scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load (a checkpoint written on any device: the optimizer moves its state to ours)."""
        self.optimizer.load_state_dict(state["optimizer"])
        scaler = state.get("grad_scaler")
        if scaler:
            self.scaler.load_state_dict(scaler)
