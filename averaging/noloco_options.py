"""The options of NoLoCo (`noloco.py`), torch-free."""

from __future__ import annotations

from dataclasses import dataclass

from .options import Opt, OuterOptions, number

__all__ = ["NoLoCoOptions"]


@dataclass(frozen=True, kw_only=True)
class NoLoCoOptions(OuterOptions):
    """NoLoCo: every H inner steps, an exchange with one partner, no group."""

    name = "noloco"
    description = (
        "every H inner steps an exchange with one partner: no group and no all-reduce "
        "over the swarm"
    )
    implementation = "shoal.averaging.noloco:NoLoCo"

    param_mixing: float = Opt(
        number(0, 1),
        "a number in [0, 1]",
        "how far the outer parameters move toward the pair's mean",
    )(1.0)
