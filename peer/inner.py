"""The inner step on a device: batches prefetched off the training thread, AdamW, precision.

`BatchPrefetcher` draws the task's batches in a thread of its own, so a slow
tokenizer or disk never leaves the device idle; on a CUDA device it puts them in
pinned host memory, and the training thread copies them with
``non_blocking=True`` (the copy overlaps the kernels queued before it).
`InnerOptimizer` runs one step: forward under autocast at the experiment's
precision, backward (through a gradient scaler for fp16, whose range is too
narrow for small gradients), clipping, AdamW with linear warmup. Parameters and
optimizer state stay float32 whatever the precision.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .device import autocast
from .priority import lower_this_thread

__all__ = ["BatchPrefetcher", "InnerOptimizer", "map_tensors", "to_device"]


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
    """AdamW with warmup, clipping and the experiment's precision, on the model's device."""

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
        self.optimizer = torch.optim.AdamW(
            model.parameters(),
            lr=hyper["inner_lr"],
            weight_decay=hyper["weight_decay"],
            betas=(0.9, hyper["adam_beta2"]),
        )
        # fp16 only: bf16 has float32's range and needs no scaling.
        self.scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")

    def step(self, loss_of: Callable[[], torch.Tensor], step_index: int) -> float:
        """One inner step; `loss_of()` runs the forward pass (under autocast). The loss."""
        warmup = self.hyper["warmup_steps"]
        scale = min(1.0, (step_index + 1) / warmup) if warmup else 1.0
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

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict(), "grad_scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load (a checkpoint written on any device: the optimizer moves its state to ours)."""
        self.optimizer.load_state_dict(state["optimizer"])
        scaler = state.get("grad_scaler")
        if scaler:
            self.scaler.load_state_dict(scaler)
