"""A pipelined experiment's settings, as its manifest records them (strategy "pipeline").

Torch-free: the CLI reads them. Importing this module registers the pipeline in
`shoal.averaging.registry` (the layer below cannot name it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from shoal.averaging.options import (
    CODEC_NAMES,
    Opt,
    StrategyOptions,
    boolean,
    integer,
    number,
)
from shoal.averaging.registry import register

__all__ = [
    "PIPELINE_STRATEGY",
    "ROLES",
    "CodecSpec",
    "PipelineOptions",
    "parse_codec",
    "resolve_pipeline_options",
]

ROLES = ("auto", "trainer", "stage", "monitor")
MAX_STAGES = 64
MAX_GRAD_NORM = 1e6
MAX_RANK = 1 << 16
CODEC_FORMS = f"one of {', '.join(CODEC_NAMES)}, optionally +lowrankR (e.g. int8+lowrank16)"


@dataclass(frozen=True)
class CodecSpec:
    """An experiment's `codec`: the wire codec of what crosses stage boundaries and the
    rank of the adapters shoal inserts at them (0: none; `boundary`)."""

    wire: str
    rank: int = 0


def parse_codec(value: Any) -> CodecSpec:
    """``WIRE`` or ``WIRE+lowrankR`` (ValueError in one line for anything else)."""
    if isinstance(value, str):
        wire, plus, rest = value.partition("+")
        digits = rest.removeprefix("lowrank")
        if wire in CODEC_NAMES and not plus:
            return CodecSpec(wire)
        if wire in CODEC_NAMES and rest.startswith("lowrank") and digits.isdecimal():
            rank = int(digits)
            if 1 <= rank <= MAX_RANK and digits == str(rank):
                return CodecSpec(wire, rank)
    raise ValueError(f"unknown codec {value!r}: {CODEC_FORMS}")


def _codec(v: Any) -> bool:
    try:
        parse_codec(v)
    except ValueError:
        return False
    return True


def _global_batch(v: Any) -> bool:
    return v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 1)


def _max_grad_norm(v: Any) -> bool:
    return v is None or number(0.0, MAX_GRAD_NORM, lo_open=True)(v)


def _rebalance(v: Any) -> bool:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return False
    return v == 0 or 1 <= v <= 86400


@register
@dataclass(frozen=True, kw_only=True)
class PipelineOptions(StrategyOptions):
    """A SWARM pipeline: the model in stages served by different peers."""

    name = "pipeline"
    description = (
        "the model split into stages served by different peers (SWARM), for models "
        "too large for one peer; trainers audit the stages"
    )
    can_verify = True
    is_pipeline = True

    stages: int = Opt(
        integer(2, MAX_STAGES),
        f"a whole number from 2 to {MAX_STAGES}",
        "stages the model is split into (--pipeline-stages)",
    )(3)
    # Samples per optimizer step, over all trainers (None: 8 of the task's batches).
    global_batch: int | None = Opt(
        _global_batch,
        "a whole number >= the batch size",
        "samples per optimizer step over all trainers (default: 8 of the task's batches)",
    )(None)
    # Global batches a trainer may start ahead of the slowest stage's steps (0: every
    # step takes exactly the next global batch, as in one process).
    lag: int = Opt(
        integer(0, 4), "a whole number from 0 to 4", "global batches a trainer may run ahead"
    )(1)
    # Activations and gradients between stages (`wire`). +lowrankR: shoal's learned
    # adapters narrow them to R coordinates and the token ids at every boundary, for
    # any model (`boundary`); with a task's own bottleneck between stages (bytegpt:
    # config "bottleneck"), bf16 on its few coordinates is ~20x fewer bytes than
    # float32 (bench/pipeline.py's codec comparison).
    codec: str = Opt(
        _codec,
        CODEC_FORMS,
        "how activations and gradients travel between stages (WIRE or WIRE+lowrankR)",
    )("int8")
    # Stage peers look this often for a stage that limits the pipeline more than
    # theirs, and move there (`rebalance`); 0: never (a peer stays where it joined).
    rebalance_s: float = Opt(
        _rebalance,
        "0 (never) or from 1 to 86400 seconds",
        "how often stage peers look for a stage that needs them more (0: never)",
    )(30.0)
    min_stage_peers: int = Opt(
        integer(1), "a whole number >= 1", "a move never leaves a stage with fewer peers"
    )(1)
    # Trainers audit stage peers' answers (`pipeline/auditor.py`): a cheater is
    # convicted, banned and its work re-run. Calibrated for float32.
    verify: bool = Opt(boolean, "true or false", "trainers audit the stage peers' answers")(True)

    # Global gradient clipping: every stage scales its step's gradient by
    # min(1, max_grad_norm / |g|), g the whole model's gradient, from the squared norms
    # the stages share for each step (`clip_exchange`). None: no clipping.
    max_grad_norm: float | None = Opt(
        _max_grad_norm,
        f"null (off) or a number > 0 and <= {MAX_GRAD_NORM:g}",
        "clip the whole model's gradient to this L2 norm across the stages (null: off)",
    )(None)

    def for_batch_size(self, batch_size: int) -> PipelineOptions:
        """With the task's batch size: `global_batch` filled in and checked against it."""
        out = self if self.global_batch is not None else replace(self, global_batch=8 * batch_size)
        assert out.global_batch is not None
        if out.global_batch < batch_size:
            raise ValueError(
                f"option 'global_batch' of pipeline must be a whole number >= the batch size "
                f"({batch_size}), got {out.global_batch!r}"
            )
        return out


PIPELINE_STRATEGY = PipelineOptions.name
DEFAULTS: dict[str, Any] = PipelineOptions.defaults()


def resolve_pipeline_options(options: Mapping[str, Any], batch_size: int) -> dict[str, Any]:
    """The manifest's map of `options`, checked; ValueError names the bad one."""
    return PipelineOptions.parse(options).for_batch_size(batch_size).to_dict()
