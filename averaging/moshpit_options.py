"""The options of the Moshpit strategy (`moshpit_strategy.py`), torch-free."""

from __future__ import annotations

from dataclasses import dataclass

from .options import GroupOptions, Opt, integer, number

__all__ = ["MoshpitOptions"]


@dataclass(frozen=True, kw_only=True)
class MoshpitOptions(GroupOptions):
    """NoLoCo's outer step, averaged in groups on a virtual grid instead of in pairs."""

    name = "moshpit"
    description = (
        "every H inner steps each peer's own outer step, then an average with the peers "
        "of its cell of a virtual grid (Moshpit): a swarm larger than a group mixes "
        "into one state"
    )
    implementation = "shoal.averaging.moshpit_strategy:Moshpit"

    param_mixing: float = Opt(
        number(0, 1),
        "a number in [0, 1]",
        "how far the outer parameters move toward the group's mean",
    )(1.0)
    grid_dims: int = Opt(
        integer(2, 8),
        "an int in 2..8",
        "dimensions of the grid: on a full grid, rounds until every peer holds the mean",
    )(2)
    grid_side: int = Opt(
        integer(0, 1024),
        "0 or an int in 2..1024",
        "cells per dimension (0: an eighth of target_group_size)",
    )(0)
    # Rounds that start together form one group per cell (`MatchmakingConfig.
    # grid_period`); 0 keeps a round's start at its peer's outer step, where the
    # leaders wait `matchmaking_time` for the peers of their cell declared taking part.
    grid_period: float = Opt(
        number(0, hi_open=True),
        "0 or a number of seconds >= matchmaking_time",
        "rounds start together at the multiples of this on the peers' clocks (0: as reached)",
        added=True,
    )(0.0)

    def check_together(self) -> None:
        super().check_together()
        if self.grid_side == 1:
            raise ValueError("option 'grid_side' must be 0 or at least 2")
        if self.grid_period and self.grid_period < self.matchmaking_time:
            raise ValueError("option 'grid_period' must be 0 or at least 'matchmaking_time'")
