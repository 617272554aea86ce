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

    @property
    def round_with_a_loss_s(self) -> float:
        """About how long a round that loses a member takes before its data moves: the
        leader's wait, then `stall_timeout` of silence to drop the member and as long
        for the decision. A `grid_period` shorter than this plus the transfer lets such
        a round run into the next slot: its peers reach their next cells a slot late
        and meet there apart from the peers they should mix with."""
        return float(self.matchmaking_time) + 2 * float(self.stall_timeout)

    def short_period_warning(self) -> str | None:
        """What to tell the user when `grid_period` cannot hold a round that loses a
        member (`round_with_a_loss_s`); None when it can, or without a period.
        (Simulated 256 peers, 10-min sessions, a 5-s stall: a 20-s period left 43 to 99
        of about 200 steps a round a slot late and 7.8e-4 of spread after 6 rounds; a
        30-s period none late and 5.7e-7.)"""
        floor = self.round_with_a_loss_s
        if not 0 < self.grid_period < floor:
            return None
        return (
            f"grid_period {self.grid_period:g}s is shorter than a round that loses a member"
            f" (matchmaking_time + 2 x stall_timeout = {floor:g}s, plus the transfer): such a"
            " round runs into the next slot and its peers fall a slot behind"
        )

    def check_together(self) -> None:
        super().check_together()
        if self.grid_side == 1:
            raise ValueError("option 'grid_side' must be 0 or at least 2")
        if self.grid_period and self.grid_period < self.matchmaking_time:
            raise ValueError("option 'grid_period' must be 0 or at least 'matchmaking_time'")
