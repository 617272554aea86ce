"""Re-running a segment of a peer's inner run, as an audit does: the same
batches, the same step code, from the committed start state.

The batches a peer trains on in a round are a deterministic function of
(experiment, peer ID, round) (`round_batch_seed`) and of the step within the
round, so an auditor regenerates exactly the ones of the segment it re-runs
(`segment_batches`). The step is the trainer's own (`inner.InnerOptimizer`):
the warmup schedule, clipping and precision match. A state (`SegmentState`:
parameters and inner-optimizer state) has one digest, which is what a
commitment's checkpoints hold.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from shoal.transport.identity import PeerID
from shoal.verification.commitment import state_digest

from ..training.inner import InnerOptimizer
from ..training.task import Task

__all__ = [
    "SegmentRunner",
    "SegmentState",
    "capture",
    "delta",
    "flat_difference",
    "optimizer_hash",
    "params_hash",
    "round_batch_seed",
    "segment_batches",
]

_BATCH_TAG = b"shoal/batches/1\0"
_PARAMS_TAG = b"shoal/params/1\0"
_OPTIMIZER_TAG = b"shoal/optimizer/1\0"


def round_batch_seed(experiment: str, peer: PeerID, round_index: int) -> int:
    """The seed of `peer`'s batches in round `round_index` of `experiment`."""
    h = hashlib.sha256(_BATCH_TAG + experiment.encode() + b"\0" + peer.to_bytes())
    h.update(round_index.to_bytes(8, "big"))
    return int.from_bytes(h.digest()[:8], "big") >> 1


def segment_batches(
    task: Task, shard: int, num_shards: int, seed: int, first: int, count: int
) -> list[Any]:
    """Batches `first` to `first + count` of the stream `task.batches(shard, num_shards, seed)`."""
    stream = task.batches(shard, num_shards, seed)
    for _ in range(first):
        next(stream)
    return [next(stream) for _ in range(count)]


@dataclass
class SegmentState:
    """Parameters (float32, on the CPU) and the inner optimizer's state at a step."""

    params: list[torch.Tensor]
    optimizer: dict[str, Any]

    def digest(self) -> bytes:
        """The hash a commitment's checkpoint holds (`commitment.state_digest`)."""
        return state_digest(params_hash(self.params), optimizer_hash(self.optimizer))

    def flat(self) -> torch.Tensor:
        return torch.cat([p.reshape(-1) for p in self.params])


def params_hash(params: Iterable[torch.Tensor]) -> bytes:
    """Every parameter's float32 bytes, in order (as on the CPU, from any device)."""
    h = hashlib.sha256(_PARAMS_TAG)
    for p in params:
        _update(h, p.detach().to(torch.float32))
    return h.digest()


def optimizer_hash(state_dict: dict[str, Any]) -> bytes:
    """The inner optimizer's per-parameter state (step, moments) in parameter order."""
    h = hashlib.sha256(_OPTIMIZER_TAG)
    state = state_dict["optimizer"]["state"]
    for index in sorted(state):
        for name in sorted(state[index]):
            value = state[index][name]
            h.update(name.encode() + b"\0")
            _update(h, value if isinstance(value, torch.Tensor) else torch.tensor(value))
    return h.digest()


def _update(h: Any, t: torch.Tensor) -> None:
    t = t.detach().to("cpu").contiguous()
    h.update(str(t.dtype).encode() + str(tuple(t.shape)).encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy())  # hashed in place, not copied


class SegmentRunner:
    """Runs inner steps of `task` from a given state, with the trainer's step code."""

    def __init__(
        self,
        task: Task,
        hyper: dict[str, Any],
        *,
        device: torch.device | None = None,
        precision: str = "fp32",
        model_seed: int = 0,
    ) -> None:
        self.task = task
        self.device = device or torch.device("cpu")
        self.model = task.make_model(model_seed).to(self.device)
        self.inner = InnerOptimizer(self.model, hyper, device=self.device, precision=precision)

    def capture(self) -> SegmentState:
        """The model's and optimizer's state now, copied to the CPU."""
        return capture(self.model, self.inner)

    def load(self, state: SegmentState, *, adopt: bool = False) -> None:
        """Start from `state`; with `adopt`, the optimizer steps `state`'s own state
        tensors where they are already ours in place and type (no copy of the moments:
        two model sizes with Adam), which leaves them changed."""
        with torch.no_grad():
            for p, s in zip(self.model.parameters(), state.params, strict=True):
                p.copy_(s)
        self.inner.load_state_dict(state.optimizer if adopt else _copied_to_cpu(state.optimizer))

    def run(self, start: SegmentState, batches: Iterable[Any], first_step: int) -> SegmentState:
        """The state after one inner step per batch from `start`; steps are numbered
        from `first_step` (the learning-rate warmup depends on it)."""
        with self.ran(start, batches, first_step):
            return self.capture()

    @contextlib.contextmanager
    def ran(
        self, start: SegmentState, batches: Iterable[Any], first_step: int, *, adopt: bool = False
    ) -> Iterator[list[torch.Tensor]]:
        """The model's parameters after one inner step per batch from `start`, valid
        inside the block (released after it). What an audit compares needs no copy of
        the end state: an audit holds a reveal of four model sizes already.
        `adopt`: as `load`'s, for a start state nobody reads again."""
        self.load(start, adopt=adopt)
        try:
            for i, batch in enumerate(batches):
                self.inner.step(lambda b=batch: self.task.loss(self.model, b), first_step + i)
            yield [p.detach() for p in self.model.parameters()]
        finally:
            self.release()

    def release(self) -> None:
        """Drop what a run leaves behind: the gradients and the optimizer's state (with
        Adam three times the parameters' bytes, on every peer of a verified experiment
        from its first audit on); the next run loads its start's again."""
        self.model.zero_grad(set_to_none=True)
        self.inner.optimizer.state.clear()


def capture(model: torch.nn.Module, inner: InnerOptimizer) -> SegmentState:
    """The model's parameters and the inner optimizer's state, copied to the CPU."""
    params = [p.detach().to("cpu", torch.float32, copy=True) for p in model.parameters()]
    return SegmentState(params, _copied_to_cpu(inner.state_dict()))


def _copied_to_cpu(obj: Any) -> Any:
    """A deep copy with every tensor copied by torch (which lets go of the interpreter
    while it copies; `copy.deepcopy` copies a tensor's storage holding it, a second at
    a time for a real model's optimizer state, against the event loop)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _copied_to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_copied_to_cpu(v) for v in obj)
    return copy.deepcopy(obj)


def delta(start: SegmentState, end: SegmentState) -> torch.Tensor:
    """What a segment moved the parameters by (start minus end, flat), as a pseudo-gradient."""
    return flat_difference(start.params, end.params)


def flat_difference(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> torch.Tensor:
    """`a` minus `b` (tensors of the same shapes, in order) as one flat float32 tensor
    on the CPU, written a tensor at a time: the same bits as concatenating each side
    and subtracting, without the two concatenations (a model size each)."""
    out = torch.empty(sum(x.numel() for x in a), dtype=torch.float32)
    offset = 0
    for x, y in zip(a, b, strict=True):
        if x.shape != y.shape:
            raise ValueError(f"tensors of shapes {list(x.shape)} and {list(y.shape)}")
        n = x.numel()
        cpu = torch.device("cpu")
        torch.sub(
            x.detach().reshape(-1).to(cpu, torch.float32),
            y.detach().reshape(-1).to(cpu, torch.float32),
            out=out[offset : offset + n],
        )
        offset += n
    return out
