"""What a peer serving one stage computes: forward, backward by recomputation, accumulation.

Sans-I/O: the stage server (its RPC driver) hands requests to `StageWorker`
and sends back what it returns. A backward request carries the stage's
inputs again and recomputes the forward, so any peer of the stage can serve
the backward of a forward another peer served (SWARM's stateless backward),
and a peer that dies between the two loses nothing.

Parameter gradients accumulate weighted by the microbatch's samples, so that
the stage's all-reduce (a mean weighted by samples) gives the gradient of the
mean loss over the global batch whichever peers served which microbatch. Each
parameter's gradient is added the moment autograd has it and freed at once (a
hook), so a backward never holds a whole second copy of the gradients; an
epoch's sums live in one flat buffer (`Gradients.flat`) that the stage's
all-reduce sends as it is (`stage_optimizer`).

Gradients accumulate per *epoch*: the stage version whose optimizer step they
go into. While the step from version v is being averaged, new backwards
accumulate for v + 1, and each answer says which epoch it went into, so a
trainer knows which step has to include it (and replays it elsewhere when that
step committed without this peer). Backward requests are idempotent by key: a
retry of one already applied (the answer was lost on the way) returns the same
input gradient and accumulates nothing.

A step that did not commit gives its gradients back to their epoch; after an
abort what arrives joins them, but after a round whose outcome this peer never
learned (it may have committed with them) backwards go on accumulating for the
epoch after it: a backward answered with an epoch is in that epoch's gradients
only, whatever the step's outcome.

A *dry* backward (`input_gradients`) computes the input gradient and counts
nothing: the trainer's way on when a peer that may have applied the backward
cannot be asked (`ledger`: the microbatch's count is then that peer's to tell).

Across peers, a backward is applied at most once per trainer attempt that the
trainer still waits for: a trainer whose attempt failed without an answer (a
deadline, a lost connection) *fences* it (`fence`) before it tries another
peer. From then on that attempt is never applied here, and the fence tells
whether it was applied before (then its answer stands, and no other peer is
asked), so a slow peer that applies a request after its trainer gave up
cannot count it a second time.
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from collections.abc import Collection, Hashable
from dataclasses import dataclass, field
from typing import Any

import torch

from .answers import Answer, AnswerStore, Gone

__all__ = ["BackwardRequest", "Gradients", "StageWorker"]

RETAINED_ANSWERS = 4096  # applied backwards whose keys (and epochs) are kept for retries
RETAINED_ANSWER_BYTES = 64 << 20  # of their input gradients, the newest kept (`answers`)
RETAINED_FENCES = 4096  # fenced attempts remembered (a fenced request may still arrive)

# (idempotency key, the stage's inputs, gradient of its outputs, samples)
BackwardRequest = tuple[Hashable, torch.Tensor, torch.Tensor, int]


@dataclass
class Gradients:
    """A stage peer's accumulated contribution to one optimizer step."""

    sums: list[torch.Tensor]  # sum over its microbatches of samples x parameter gradient
    samples: int
    keys: frozenset[Hashable]  # the backward requests counted in it
    epoch: int = 0  # the stage version whose step they are for
    # The one buffer `sums` are views of, in parameter order (None: the parameters
    # differ in dtype or device, each sum is a tensor of its own).
    flat: torch.Tensor | None = None


@dataclass
class _Bucket:
    sums: list[torch.Tensor]
    flat: torch.Tensor | None = None
    samples: int = 0
    keys: set[Hashable] = field(default_factory=set)


def _zero_bucket(params: list[torch.Tensor]) -> _Bucket:
    """An epoch's empty sums: views of one flat buffer when the parameters share a
    dtype and device (the all-reduce then sends it without a copy)."""
    if len({(p.dtype, p.device) for p in params}) != 1:
        return _Bucket([torch.zeros_like(p) for p in params])
    flat = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype,
                       device=params[0].device)  # fmt: skip
    views, offset = [], 0
    for p in params:
        views.append(flat[offset : offset + p.numel()].view(p.shape))
        offset += p.numel()
    return _Bucket(views, flat)


class StageWorker:
    def __init__(
        self,
        module: torch.nn.Module,
        *,
        device: torch.device | None = None,
        pass_samples: int | None = None,
        answer_bytes: int = RETAINED_ANSWER_BYTES,
    ) -> None:
        """`pass_samples`: the most samples one pass through the module takes (a
        computation of more runs in passes of at most that many, its parameter
        gradients added up: what autograd keeps for a backward is then bounded by a
        memory budget, `memory.fit_stage`; None: a computation is one pass);
        `answer_bytes`: the input gradients kept for retries (`answers.AnswerStore`)."""
        if pass_samples is not None and pass_samples < 1:
            raise ValueError("pass_samples >= 1")
        self.module = module
        self.device = device or torch.device("cpu")
        self.pass_samples = pass_samples
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.epoch = 0  # where backwards accumulate now
        # The stage version the parameters hold (set under `lock` by whoever changes
        # them; None while a download replaces them): what audits recompute at.
        self.version: int | None = 0
        self._buckets: dict[int, _Bucket] = {}
        self._answers = AnswerStore(RETAINED_ANSWERS, answer_bytes)
        # Attempts their trainers gave up on (never applied from then on) and the keys
        # being computed now; with `_answers`, under `_fence_lock`, which `fence` takes
        # alone: a fence must not wait for `lock` (a state download holds it for long).
        self._fenced: OrderedDict[bytes, None] = OrderedDict()
        self._computing: set[Hashable] = set()
        self._fence_lock = threading.Lock()
        # Held by every computation, by the optimizer step (`StageOptimizer`) and by
        # a state download, which run in different threads: a request never sees
        # half-updated parameters.
        self.lock = threading.RLock()
        # While `_backward` runs (under `lock`): the bucket each parameter's gradient
        # goes into as autograd finishes it (None: dropped) and the factor it is added with.
        self._target: tuple[_Bucket | None, float] | None = None
        for i, p in enumerate(self.params):
            p.register_post_accumulate_grad_hook(functools.partial(self._accumulated, i))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """The stage's outputs for `inputs` (no graph kept)."""
        return self.forward_many([inputs])[0]

    def forward_many(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """The outputs of several requests, computed as one batch (samples are
        independent: the stage's layers never mix samples)."""
        with self.lock, torch.no_grad():
            x = inputs[0].to(self.device) if len(inputs) == 1 else torch.cat(
                [x.to(self.device) for x in inputs])  # fmt: skip
            parts = x.split(self._pass_length(len(x)))
            outputs = self.module(x) if len(parts) == 1 else torch.cat(
                [self.module(part) for part in parts])  # fmt: skip
            return [outputs] if len(inputs) == 1 else list(
                outputs.split([len(x) for x in inputs]))  # fmt: skip

    def _pass_length(self, samples: int) -> int:
        """Samples a pass of a computation of `samples` takes (all, without a limit)."""
        return max(1, min(samples, self.pass_samples or samples))

    def answered(self, key: Hashable) -> bool:
        """Whether a backward of `key` was applied already (a retry gets its old answer)."""
        return key in self._answers

    def backward(
        self, key: Hashable, inputs: torch.Tensor, grad_outputs: torch.Tensor, samples: int
    ) -> torch.Tensor | None:
        """Recompute the forward, backpropagate `grad_outputs`; the input gradient
        (None for integer inputs such as token ids). Applied once per `key`."""
        answer = self.backward_many([(key, inputs, grad_outputs, samples)])[0]
        assert answer is not None  # (no attempt: never fenced)
        return answer[0]

    def backward_many(
        self, requests: list[BackwardRequest], attempts: list[bytes | None] | None = None
    ) -> list[tuple[torch.Tensor | None, int] | None]:
        """Several backwards computed as one batch; per request its input gradient
        and the epoch its parameter gradients went into, or None for a request
        whose attempt (`attempts`, one per request) was fenced: not applied."""
        with self.lock:
            with self._fence_lock:
                fenced = {i for i, a in enumerate(attempts or ()) if a in self._fenced}
                fresh: dict[Hashable, BackwardRequest] = {}
                for i, request in enumerate(requests):
                    if i not in fenced and request[0] not in self._answers:
                        fresh.setdefault(request[0], request)
                self._computing |= fresh.keys()
            computed: dict[Hashable, tuple[torch.Tensor | None, int]] = {}
            try:
                if fresh:
                    bucket = self._bucket(self.epoch)
                    answers = self._backward(list(fresh.values()), bucket)
                    with self._fence_lock:
                        for key, answer in zip(fresh, answers, strict=True):
                            bucket.keys.add(key)
                            self._answers.put(key, answer, self.epoch)
                            computed[key] = (answer, self.epoch)
            finally:
                with self._fence_lock:
                    self._computing -= fresh.keys()
            return self._answered(requests, fenced, computed)

    def _answered(
        self, requests: list[BackwardRequest], fenced: set[int], computed: dict[Hashable, Any]
    ) -> list[tuple[torch.Tensor | None, int] | None]:
        """(Under `lock`:) each request's answer: computed now (`computed`: its own, even
        if dropped from the store meanwhile), kept from before, or, for a retry of a
        backward whose gradient was dropped for room, recomputed dry (counted once:
        its parameter gradients went into its epoch the first time)."""
        out: list[tuple[torch.Tensor | None, int] | None] = []
        for i, request in enumerate(requests):
            with self._fence_lock:
                answer = computed.get(request[0]) or self._answers.get(request[0])
            if i in fenced or answer is None:
                out.append(None)
            elif isinstance(answer[0], Gone):
                out.append((self._backward([request], None)[0], answer[1]))
            else:
                out.append((answer[0], answer[1]))
        return out

    def input_gradients(self, requests: list[BackwardRequest]) -> list[torch.Tensor | None]:
        """The input gradients of `requests` as `backward_many` computes them, applied
        nowhere: no gradient accumulates, no key is remembered (a dry backward)."""
        with self.lock:
            return self._backward(requests, None)

    def fence(self, key: Hashable, attempt: bytes) -> tuple[bool, Answer | None]:
        """Never apply `attempt` from now on (its trainer gave up waiting for it).
        Whether a backward of `key` is being computed right now (ask again shortly),
        and its answer and epoch if one was applied (its answer GONE: dropped for room)."""
        with self._fence_lock:
            self._fenced[attempt] = None
            while len(self._fenced) > RETAINED_FENCES:
                self._fenced.popitem(last=False)
            return key in self._computing, self._answers.get(key)

    def _bucket(self, epoch: int) -> _Bucket:
        if epoch not in self._buckets:
            self._buckets[epoch] = _zero_bucket(self.params)
        return self._buckets[epoch]

    def _accumulated(self, i: int, p: torch.Tensor) -> None:
        """(Autograd's hook: parameter i's gradient of a backward is complete in
        `p.grad`.) In a backward of ours, add it to its bucket and free it at once,
        so that autograd's gradients never all exist beside the buckets (the same
        sums, added in the same way, as once the backward returned)."""
        target = self._target
        if target is None or p is not self.params[i]:  # (not ours: left as autograd made it)
            return
        into, alpha = target
        if into is not None and p.grad is not None:
            with torch.no_grad():
                into.sums[i].add_(p.grad, alpha=alpha)
        p.grad = None

    def _backward(
        self, requests: list[BackwardRequest], into: _Bucket | None
    ) -> list[torch.Tensor | None]:
        """Backpropagate requests as one batch. Each output gradient is scaled by its
        request's samples first, so that the parameter gradients add up as the sum of
        samples x gradient (the weighting of the stage's mean), and the input
        gradients are scaled back. `into` None: the parameter gradients are dropped."""
        alone = len(requests) == 1
        x = torch.cat([r[1].to(self.device) for r in requests])
        grads = torch.cat([r[2].to(self.device) * (1 if alone else r[3]) for r in requests])
        for p in self.params:
            p.grad = None
        self._target = (into, requests[0][3] if alone else 1)
        # (Each parameter's gradient goes to `_accumulated`, pass after pass. Should
        # autograd's engine fail half-way, an allocation failing, the parameters it
        # finished are in the bucket though the backward counts nowhere: its samples
        # and key are not added.)
        try:
            step = self._pass_length(len(x))
            passes = zip(x.split(step), grads.split(step), strict=True)
            input_grads = [self._one_pass(xs, gs) for xs, gs in passes]
        finally:
            self._target = None
            for p in self.params:
                p.grad = None
        if into is not None:
            into.samples += sum(r[3] for r in requests)
        if not x.is_floating_point():
            return [None] * len(requests)
        whole = input_grads[0] if len(input_grads) == 1 else torch.cat(input_grads)
        parts = whole.split([len(r[1]) for r in requests])
        return [g if alone else g / r[3] for g, r in zip(parts, requests, strict=True)]

    def _one_pass(self, x: torch.Tensor, grads: torch.Tensor) -> torch.Tensor | None:
        """Forward and backward of one pass (`_target` set); its input gradient."""
        if x.is_floating_point():
            x = x.detach().requires_grad_(True)
        outputs = self.module(x)
        outputs.backward(grads.to(outputs.dtype))
        return x.grad.detach() if x.is_floating_point() else None

    def take_gradients(self, epoch: int | None = None) -> Gradients:
        """The gradients accumulated for `epoch` (default: the current one); from now
        on backwards accumulate for the epoch after it."""
        with self.lock:
            epoch = self.epoch if epoch is None else epoch
            bucket = self._buckets.pop(epoch, None) or _zero_bucket(self.params)
            self.epoch = max(self.epoch, epoch + 1)
            keys = frozenset(bucket.keys)
            return Gradients(bucket.sums, bucket.samples, keys, epoch, bucket.flat)

    def give_back(self, taken: Gradients, *, reopen: bool = True) -> None:
        """Gradients taken for a step that did not commit here: they are again for the
        step from `taken.epoch`. `reopen`: nobody committed it (an abort), so what
        arrives from now on joins them. Not when the round's outcome is unknown (we
        were in doubt: it may have committed with them, out of our sight): then what
        arrives stays for the epoch after it, as what arrived during the step, or a
        step that never held it would claim it (the trainer counts a backward in the
        step of its epoch when we are among that step's members)."""
        with self.lock, torch.no_grad():
            if taken.epoch not in self._buckets:  # (its own tensors become the bucket again)
                self._buckets[taken.epoch] = _Bucket(list(taken.sums), taken.flat)
                bucket = self._buckets[taken.epoch]
            else:
                bucket = self._buckets[taken.epoch]
                for acc, total in zip(bucket.sums, taken.sums, strict=True):
                    acc.add_(total)
            bucket.samples += taken.samples
            bucket.keys |= taken.keys
            if reopen:
                self.epoch = taken.epoch

    def drop_before(self, epoch: int, taken: Collection[Hashable] = ()) -> int:
        """Forget gradients for steps before `epoch` (the stage took those steps without
        this peer: its trainers replay them elsewhere); the samples dropped. `taken`:
        the keys of gradients taken for a step that went without us (they are in no
        bucket now, and were dropped with the step)."""
        with self.lock:
            dropped = 0
            with self._fence_lock:
                for key in taken:  # a replay here must count again (not get its old answer)
                    self._answers.pop(key)
            for e in [e for e in self._buckets if e < epoch]:
                bucket = self._buckets.pop(e)
                dropped += bucket.samples
                with self._fence_lock:
                    for key in bucket.keys:  # (as above)
                        self._answers.pop(key)
            self.epoch = max(self.epoch, epoch)
            return dropped

    def samples_for(self, epoch: int) -> int:
        bucket = self._buckets.get(epoch)
        return 0 if bucket is None else bucket.samples

    @property
    def samples(self) -> int:
        """Samples accumulated for the current epoch."""
        return self.samples_for(self.epoch)
