"""Activation compression shoal inserts at the stage boundaries of a model it did not write.

An experiment's ``codec`` ``WIRE+lowrankR`` (e.g. ``int8+lowrank16``; `options`)
wraps every stage the task builds (`boundary_task`), so a user's model gets it
without being edited:

- a stage that sends hidden states on ends with a learned projection of them to R
  coordinates (`LowRankOut`, d -> R), followed by the token ids of the positions as
  one more channel, whole numbers that `wire` sends exactly (a byte each for byte
  ids);
- the stage that receives them starts with the projection back (`LowRankIn`,
  R -> d) plus its own learned embeddings of those ids and of their positions, so
  which token is where, which R coordinates could not carry, is never lost on the
  way (the token embeddings Pluralis' protocol models recompute at every stage, here
  learned per stage: IOTA's bottleneck layers, inserted from outside).

Both the hidden states and their gradients then cross the network R + 1 wide (the
gradient of the ids channel is all zeros, which costs no bytes), and WIRE (int8,
bf16, ...) compresses them further. The two projections start as a basis of
nearly orthogonal unit columns (random signs over sqrt(d)) and its transpose (the
residual stream's scale about kept), the embeddings at zero; all are drawn from the
experiment's seed and the boundary's index by the CPU generator, with no linear
algebra, so every peer of a stage builds the same bytes on any machine. They are
parameters of the stages they sit in: trained, all-reduced, checkpointed and
fingerprinted with the rest, so the peers of a stage keep committing the same bits
as before (no state outside the stages, nothing to keep in step besides).

It changes what the model computes (a different model, with more parameters, than
the task's own stages), so an experiment trains from scratch with it, and its loss
is measured against float32 (`bench/pipeline.py`). What it needs of the model: a
feature dimension at every boundary (the last one of the hidden states) wider than
R; the ids channel also needs the first stage to take integer token ids whose shape
is that of the hidden states less the feature dimension (a sequence model: the
usual ``[batch, length]``), and is left out otherwise.

The widths are probed once per task (`probe_boundaries`): one sample through each
stage, each built on PyTorch's meta device (no memory, no compute), or on the CPU
where a task's layers do not run there.
"""

from __future__ import annotations

import hashlib
import logging
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .options import CodecSpec, parse_codec
from .stage_build import builds_stages_alone

__all__ = [
    "Boundaries",
    "BoundaryTask",
    "CompressedStage",
    "LowRankIn",
    "LowRankOut",
    "boundary_task",
    "probe_boundaries",
]

log = logging.getLogger("shoal.pipeline")

# The entry's embeddings start small and random (GPT-2's scale): distinct ids from the
# first step, where zeros would leave the next stage blind to them until learned.
EMBEDDING_STD = 0.02


@dataclass(frozen=True)
class Boundaries:
    """What the adapters need of a task's pipeline: per boundary (between stage k and
    k + 1) the feature width; whether token ids come along, how many tokens there are
    and at most how many positions a sample has."""

    widths: list[int]
    vocab: int  # 0: no ids channel
    positions: int  # positions per sample (the ids' last dimension), 0 without ids


class LowRankOut(nn.Module):
    """Where a stage before a boundary ends: d -> rank, then the ids as one more channel."""

    def __init__(self, width: int, rank: int) -> None:
        super().__init__()
        self.down = nn.Linear(width, rank, bias=False)

    def forward(self, x: torch.Tensor, ids: torch.Tensor | None) -> torch.Tensor:
        y = self.down(x)
        if ids is None:
            return y
        return torch.cat([y, ids.to(y.dtype).unsqueeze(-1)], dim=-1)


class LowRankIn(nn.Module):
    """Where a stage after a boundary starts: rank -> d, plus its own embeddings of the
    ids that came along (the last channel) and of their positions."""

    def __init__(self, rank: int, width: int, vocab: int, positions: int) -> None:
        super().__init__()
        self.rank = rank
        self.vocab = vocab
        self.up = nn.Linear(rank, width, bias=False)
        self.token_embedding = nn.Embedding(vocab, width) if vocab else None
        self.position_embedding = nn.Embedding(positions, width) if vocab else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        wide = self.rank + (1 if self.vocab else 0)
        if x.shape[-1] != wide:  # (a request's shape is the sender's claim)
            raise ValueError(f"{x.shape[-1]} channels at a boundary of {wide}")
        if self.token_embedding is None or self.position_embedding is None:
            return self.up(x), None
        # (whatever a peer sent, NaN included, an index stays within the table)
        ids = torch.nan_to_num(x[..., -1].detach()).round().clamp(0, self.vocab - 1).long()
        length = ids.shape[-1]
        if length > self.position_embedding.num_embeddings:
            raise ValueError(
                f"{length} positions, at most {self.position_embedding.num_embeddings}"
            )
        positions = torch.arange(length, device=x.device)
        hidden = (
            self.up(x[..., :-1]) + self.token_embedding(ids) + self.position_embedding(positions)
        )
        return hidden, ids


class CompressedStage(nn.Module):
    """A task's stage between the adapters of its boundaries: `entry` (all but the first
    stage) takes the narrow hidden states, `outlet` (all but the last) makes them."""

    def __init__(
        self, inner: nn.Module, entry: LowRankIn | None, outlet: LowRankOut | None, ids: bool
    ) -> None:
        super().__init__()
        self.inner = inner
        self.entry = entry
        self.outlet = outlet
        self.carries_ids = ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = x if self.carries_ids else None  # (the first stage's input is the ids)
        if self.entry is not None:
            x, ids = self.entry(x)
        y = self.inner(x)
        if self.outlet is not None:
            y = self.outlet(y, ids)
        return y


def probe_boundaries(task: Any, seed: int, count: int) -> Boundaries:
    """The widths at `task`'s boundaries and its ids (blocking), each stage built alone
    on the meta device (or on the CPU where the task's layers do not run there)."""
    x = task.stage_inputs(task.eval_batches(1)[0])[:1]
    try:
        shapes = _shapes(task, seed, count, x, torch.device("meta"))
    except (NotImplementedError, RuntimeError, TypeError, ValueError) as e:
        log.info("the stages do not run on the meta device (%r): probing on the CPU", e)
        shapes = _shapes(task, seed, count, x, torch.device("cpu"))
    widths = []
    for shape in shapes:
        if len(shape) < 2:
            raise ValueError("a stage's outputs have no feature dimension to compress")
        widths.append(shape[-1])
    carries = not x.is_floating_point() and all(s[:-1] == list(x.shape) for s in shapes)
    vocab = _vocab(task, seed, count, x) if carries else 0
    return Boundaries(widths, vocab, x.shape[-1] if vocab else 0)


def _shapes(
    task: Any, seed: int, count: int, x: torch.Tensor, device: torch.device
) -> list[list[int]]:
    """The shape of one sample at each boundary (stage k's outputs, k < count - 1)."""
    x = x.to(device)
    shapes = []
    with torch.no_grad():
        for k in range(count - 1):
            with device:
                module = _build(task, seed, count, k)
            x = module(x)
            del module
            shapes.append(list(x.shape))
    return shapes


def _build(task: Any, seed: int, count: int, k: int) -> nn.Module:
    if builds_stages_alone(task):
        return task.make_stage(seed, count, k)
    return task.make_stages(seed, count)[k]


def _vocab(task: Any, seed: int, count: int, x: torch.Tensor) -> int:
    """The token table's size: the embedding the first stage looks the ids up in."""
    with torch.device("meta"):
        first = _build(task, seed, count, 0)
    seen: list[int] = []

    def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
        if args and args[0] is x:
            seen.append(module.num_embeddings)

    handles = [
        m.register_forward_pre_hook(hook) for m in first.modules() if isinstance(m, nn.Embedding)
    ]
    try:
        with torch.no_grad():
            first(x)
    except (NotImplementedError, RuntimeError, TypeError, ValueError):
        pass  # (the fallback below)
    finally:
        for h in handles:
            h.remove()
    if seen:
        return seen[0]
    tables = [m.num_embeddings for m in first.modules() if isinstance(m, nn.Embedding)]
    if not tables:
        return 0
    return max(tables)


def _generator(seed: int, boundary: int) -> torch.Generator:
    digest = hashlib.sha256(f"shoal-boundary:{seed}:{boundary}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def adapters(
    seed: int, bounds: Boundaries, rank: int, boundary: int
) -> tuple[LowRankOut, LowRankIn]:
    """The two sides of boundary `boundary`, drawn from `seed` on the CPU (the same
    bytes on every peer, whatever its device or the global RNG)."""
    width = bounds.widths[boundary]
    if not 1 <= rank < width:
        raise ValueError(f"lowrank{rank}: the rank must be from 1 to {width - 1} (the width)")
    outlet, entry = LowRankOut(width, rank), LowRankIn(rank, width, bounds.vocab, bounds.positions)
    # Random signs over sqrt(width): columns of norm 1 exactly, nearly orthogonal, and no
    # linear algebra (a QR's last bits may differ between two machines' LAPACK builds).
    generator = _generator(seed, boundary)
    signs = torch.randint(0, 2, (width, rank), generator=generator)
    basis = (2.0 * signs.float() - 1.0) / math.sqrt(width)
    with torch.no_grad():
        outlet.down.weight.copy_(basis.T)
        entry.up.weight.copy_(basis)
        for table in (entry.token_embedding, entry.position_embedding):
            if table is not None:
                table.weight.normal_(0.0, EMBEDDING_STD, generator=generator)
    return outlet, entry


def wrap_stage(
    module: nn.Module, seed: int, bounds: Boundaries, rank: int, count: int, k: int
) -> CompressedStage:
    """Stage `k` of `count` between its boundaries' adapters (the module's device)."""
    entry = adapters(seed, bounds, rank, k - 1)[1] if k > 0 else None
    outlet = adapters(seed, bounds, rank, k)[0] if k < count - 1 else None
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    wrapped = CompressedStage(module, entry, outlet, ids=k == 0 and bounds.vocab > 0)
    for part in (entry, outlet):
        if part is not None:
            part.to(device)
    return wrapped


class BoundaryTask:
    """A pipelined task whose stages come wrapped in the codec's adapters; everything
    else is the task's own."""

    def __init__(self, task: Any, spec: CodecSpec) -> None:
        self.task = task
        self.spec = spec
        self._bounds: dict[tuple[int, int], Boundaries] = {}

    def boundaries(self, seed: int, count: int) -> Boundaries:
        key = (seed, count)
        if key not in self._bounds:
            self._bounds[key] = probe_boundaries(self.task, seed, count)
        return self._bounds[key]

    def make_stages(self, seed: int, count: int) -> list[nn.Module]:
        modules = self.task.make_stages(seed, count)
        bounds = self.boundaries(seed, count)
        return [
            wrap_stage(m, seed, bounds, self.spec.rank, count, k) for k, m in enumerate(modules)
        ]

    def _make_stage(self, seed: int, count: int, k: int) -> nn.Module:
        module = self.task.make_stage(seed, count, k)
        return wrap_stage(module, seed, self.boundaries(seed, count), self.spec.rank, count, k)

    def _stage_size(self, count: int, k: int) -> int:
        """The task's size of the stage plus its adapters' (probed with seed 0: the
        widths do not depend on it)."""
        bounds, r = self.boundaries(0, count), self.spec.rank
        extra = 0
        if k > 0:
            d = bounds.widths[k - 1]
            extra += r * d + (bounds.vocab + bounds.positions) * d
        if k < count - 1:
            extra += bounds.widths[k] * r
        return int(self.task.stage_size(count, k)) + extra

    def __getattr__(self, name: str) -> Any:
        if name in ("task", "spec", "_bounds"):  # (not set yet: no recursion)
            raise AttributeError(name)
        # (only what the task has: `stage_build` asks whether there is a make_stage)
        if name == "make_stage" and builds_stages_alone(self.task):
            return self._make_stage
        if name == "stage_size" and callable(getattr(self.task, "stage_size", None)):
            return self._stage_size
        if name in ("make_stage", "stage_size"):
            raise AttributeError(name)
        return getattr(self.task, name)


def boundary_task(task: Any, codec: str) -> Any:
    """`task` as the experiment's `codec` builds its stages: wrapped in adapters for
    ``WIRE+lowrankR``, the task itself otherwise (ValueError for an unknown codec)."""
    spec = parse_codec(codec)
    return BoundaryTask(task, spec) if spec.rank else task
