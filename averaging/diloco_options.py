"""The options of DiLoCo and Streaming DiLoCo (`diloco.py`), torch-free."""

from __future__ import annotations

from dataclasses import dataclass

from .options import (
    CODEC,
    PROBABILITY,
    REDUCTION_NAMES,
    GroupOptions,
    Opt,
    VerifyingOptions,
    integer,
    number,
)

__all__ = ["DiLoCoOptions", "StreamingOptions"]


def _reduction(v: object) -> bool:
    return v == "auto" or v in REDUCTION_NAMES


@dataclass(frozen=True, kw_only=True)
class DiLoCoOptions(GroupOptions, VerifyingOptions):
    """DiLoCo: every H inner steps, the group averages its pseudo-gradients."""

    name = "diloco"
    description = (
        "every H inner steps the swarm averages its pseudo-gradients in one group "
        "(fault-tolerant all-reduce) and takes an outer Nesterov step; can verify"
    )
    implementation = "shoal.averaging.diloco:DiLoCo"
    # How owners reduce their part: auto is CenteredClip when verifying, else the mean.
    reduction: str = Opt(
        _reduction,
        f"auto or one of {sorted(REDUCTION_NAMES)}",
        "how part owners reduce: auto (centered_clip when verifying, else mean), "
        + ", ".join(REDUCTION_NAMES),
    )("auto")


@dataclass(frozen=True, kw_only=True)
class StreamingOptions(GroupOptions):
    """Streaming DiLoCo: DiLoCo per fragment of the parameters, overlapped with training."""

    name = "streaming"
    description = (
        "DiLoCo per fragment of the parameters, fragments in turn, each round overlapped "
        "with the next inner steps"
    )
    implementation = "shoal.averaging.diloco:StreamingDiLoCo"

    codec: str = CODEC("int8")  # the paper quantized outer gradients to 4 bits
    fragments: int = Opt(
        integer(1, 1024), "an int in 1..1024", "fragments the parameters are split into"
    )(4)
    overlap_steps: int = Opt(
        integer(0), "an int >= 0", "inner steps a fragment's round overlaps (below inner_steps)"
    )(5)
    # local = mixing*local + (1-mixing)*global at the merge (paper: 0.5)
    mixing: float = Opt(
        number(0, 1), PROBABILITY, "the local share kept when a fragment's result is merged"
    )(0.5)

    def check_together(self) -> None:
        super().check_together()
        if self.overlap_steps >= self.inner_steps:
            raise ValueError("option 'overlap_steps' must be below 'inner_steps'")
