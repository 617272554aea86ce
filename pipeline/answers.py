"""The answers a stage peer keeps for retries: each applied backward's key and epoch,
and the newest input gradients within a byte bound.

Sans-I/O. A backward is applied once per key (`stage.StageWorker`): a retry of a
key applied before must not count again, so its key and epoch are kept for the
last `keys` backwards whatever their size. Its input gradient is what a retry
or a fence gets back; those are kept newest first up to `tensor_bytes` (at least
the newest one), since `keys` of them would be far more than a stage's budget at
a real model's width (4096 gradients of 8 samples x 2048 x 128 float32: 1 GiB).
A key whose gradient was dropped answers `GONE`: a retry gets a dry recomputation
(unsealed, as every retry), a fence reports the backward in doubt, which the
stage's step log settles (`fencing`, `ledger.Doubt`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

import torch

__all__ = ["GONE", "Answer", "AnswerStore", "Gone"]


class Gone:
    """An applied backward whose input gradient was dropped for room."""

    def __repr__(self) -> str:
        return "GONE"


GONE = Gone()
Answer = tuple[torch.Tensor | Gone | None, int]  # (input gradient, epoch)


class AnswerStore:
    def __init__(self, keys: int, tensor_bytes: int) -> None:
        if keys < 1 or tensor_bytes < 0:
            raise ValueError("keys >= 1 and tensor_bytes >= 0")
        self.keys = keys
        self.tensor_bytes = tensor_bytes
        self._answers: OrderedDict[Hashable, Answer] = OrderedDict()
        self._held: OrderedDict[Hashable, int] = OrderedDict()  # keys with a tensor -> bytes
        self.bytes = 0  # of the gradients held
        self.dropped = 0  # gradients dropped for room (their keys kept)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._answers

    def __len__(self) -> int:
        return len(self._answers)

    def get(self, key: Hashable) -> Answer | None:
        return self._answers.get(key)

    def put(self, key: Hashable, grad: torch.Tensor | None, epoch: int) -> None:
        self.pop(key)
        self._answers[key] = (grad, epoch)
        if grad is not None:
            size = grad.numel() * grad.element_size()
            self._held[key] = size
            self.bytes += size
        while len(self._answers) > self.keys:
            self.pop(next(iter(self._answers)))
        while self.bytes > self.tensor_bytes and len(self._held) > 1:
            oldest, size = self._held.popitem(last=False)
            self.bytes -= size
            self.dropped += 1
            self._answers[oldest] = (GONE, self._answers[oldest][1])

    def pop(self, key: Hashable) -> Answer | None:
        answer = self._answers.pop(key, None)
        size = self._held.pop(key, None)
        if size is not None:
            self.bytes -= size
        return answer
