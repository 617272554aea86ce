"""What a peer serving one stage computes: forward, backward by recomputation, accumulation.

Sans-I/O: the stage server (its RPC driver) hands requests to `StageWorker`
and sends back what it returns. A backward request carries the stage's
inputs again and recomputes the forward, so any peer of the stage can serve
the backward of a forward another peer served (SWARM's stateless backward),
and a peer that dies between the two loses nothing.

Parameter gradients accumulate weighted by the microbatch's samples, so that
the stage's all-reduce (a mean weighted by samples) gives the gradient of the
mean loss over the global batch whichever peers served which microbatch.
Backward requests are idempotent by key: a retry of one already applied (the
answer was lost on the way) returns the same input gradient and accumulates
nothing.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass

import torch

__all__ = ["Gradients", "StageWorker"]

RETAINED_ANSWERS = 4096  # backward answers kept for retries (per accumulation round)


@dataclass
class Gradients:
    """A stage peer's accumulated contribution to one optimizer step."""

    sums: list[torch.Tensor]  # sum over its microbatches of samples x parameter gradient
    samples: int
    keys: frozenset[Hashable]  # the backward requests counted in it


class StageWorker:
    def __init__(self, module: torch.nn.Module, *, device: torch.device | None = None) -> None:
        self.module = module
        self.device = device or torch.device("cpu")
        self.params = [p for p in module.parameters() if p.requires_grad]
        self._sums = [torch.zeros_like(p, dtype=torch.float32) for p in self.params]
        self._samples = 0
        self._answers: OrderedDict[Hashable, torch.Tensor | None] = OrderedDict()
        # Held by every computation and by the optimizer step (`StageOptimizer`), which
        # run in different threads: a request never sees half-updated parameters.
        self.lock = threading.Lock()

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """The stage's outputs for `inputs` (no graph kept)."""
        with self.lock, torch.no_grad():
            return self.module(inputs.to(self.device))

    def backward(
        self, key: Hashable, inputs: torch.Tensor, grad_outputs: torch.Tensor, samples: int
    ) -> torch.Tensor | None:
        """Recompute the forward, backpropagate `grad_outputs`; the input gradient
        (None for integer inputs such as token ids). Applied once per `key`."""
        with self.lock:
            return self._backward(key, inputs, grad_outputs, samples)

    def _backward(
        self, key: Hashable, inputs: torch.Tensor, grad_outputs: torch.Tensor, samples: int
    ) -> torch.Tensor | None:
        if key in self._answers:
            return self._answers[key]
        x = inputs.to(self.device)
        if x.is_floating_point():
            x = x.detach().requires_grad_(True)
        for p in self.params:
            p.grad = None
        outputs = self.module(x)
        outputs.backward(grad_outputs.to(device=self.device, dtype=outputs.dtype))
        with torch.no_grad():
            for acc, p in zip(self._sums, self.params, strict=True):
                if p.grad is not None:
                    acc.add_(p.grad, alpha=samples)
                p.grad = None
        self._samples += samples
        answer = x.grad.detach() if x.is_floating_point() else None
        self._answers[key] = answer
        while len(self._answers) > RETAINED_ANSWERS:
            self._answers.popitem(last=False)
        return answer

    def take_gradients(self) -> Gradients:
        """What was accumulated since the last call; the accumulators start again at zero."""
        with self.lock:
            out = Gradients(
                [s.clone() for s in self._sums], self._samples, frozenset(self._answers)
            )
            for s in self._sums:
                s.zero_()
            self._samples = 0
            self._answers.clear()
            return out

    def give_back(self, taken: Gradients) -> None:
        """Put gradients taken for a step that did not happen back into the sums."""
        with self.lock, torch.no_grad():
            for acc, total in zip(self._sums, taken.sums, strict=True):
                acc.add_(total)
        self._samples += taken.samples

    @property
    def samples(self) -> int:
        return self._samples
