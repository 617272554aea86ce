"""Moshpit: NoLoCo's outer step, averaged in groups on a virtual grid (`moshpit.Grid`).

DiLoCo keeps one global state bit for bit: a swarm larger than one group splits
into groups that each commit their own round, and all but one lineage are thrown
away by re-syncs. NoLoCo keeps a replica per peer and pulls pairs together: the
replicas stay close, but a pair halves a difference at best, so a thousand
peers are many rounds from one state. Moshpit keeps NoLoCo's replicas and its
outer step (`noloco.NoLoCo`: each peer's own Nesterov step, then the average of
the post-step outer parameters, weighted by samples, moved toward by
`param_mixing`) and averages them in groups of up to `target_group_size`, formed
cell by cell on a grid of `grid_dims` dimensions (`MatchmakingConfig.grid_dims`):
each round groups the peers that share all coordinates but one, so on a full
grid every replica holds the swarm's mean after `grid_dims` rounds, and a swarm
of thousands mixes in a few. On the grid a replica weighs its mass, not its
samples (`moshpit.Grid`: push-sum, so that cells filled unevenly still give the
exact mean). Inside a group the commit is exact (every member
the same bits, or nobody changes), as in DiLoCo; nobody re-syncs to another
group's state, so no peer's work is thrown away.

What travels per round is one model's worth of outer parameters per member, as
in NoLoCo and DiLoCo. A joiner downloads one replica (outer parameters, momentum,
round number) from any peer, as in NoLoCo.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Sequence

import torch

from shoal.dht.node import DHTNode

from .averager import Averager, AveragerConfig, StepResult
from .moshpit_options import MoshpitOptions
from .noloco import Exchange, NoLoCo
from .outer import RoundOutcome, allreduce_config, matchmaking_config, state_protocol

log = logging.getLogger("shoal.averaging.moshpit")

__all__ = ["Moshpit"]

# A round's group is kept apart from the replica the strategy serves: its own key.
GRID_SUFFIX = "/grid"


class Moshpit(NoLoCo):
    """Moshpit over `params` (the model's parameters, changed in place)."""

    name = "moshpit"
    options: MoshpitOptions  # type: ignore[assignment]

    def __init__(
        self, dht: DHTNode, key: str, params: Sequence[torch.Tensor], options: MoshpitOptions
    ) -> None:
        super().__init__(dht, key, params, options)  # type: ignore[arg-type]
        self.last_step: StepResult | None = None
        warning = options.short_period_warning()
        if warning is not None:
            log.warning("%s: %s", key, warning)

    def _make_exchange(self, mixed_buffer: torch.Tensor) -> None:
        opts = self.options
        grid_key = self.key + GRID_SUFFIX
        matchmaking = dataclasses.replace(
            matchmaking_config(opts),
            grid_dims=opts.grid_dims,
            grid_side=opts.grid_side,
            grid_period=opts.grid_period,
        )
        config = AveragerConfig(
            matchmaking=matchmaking,
            allreduce=allreduce_config(opts),
            codec=opts.codec,
            state_protocol=state_protocol(grid_key),
            state_timeout=opts.state_timeout,
            adaptive_deadlines=opts.deadlines == "adaptive",
        )
        # Nothing to serve: a joiner loads the replica the strategy serves, so the
        # averager's state is empty (no copy and no hash of the model per round).
        self.averager = Averager(self.dht, grid_key, [mixed_buffer], config=config, state=[])

    async def _exchange(self, round_number: int, weight: float) -> Exchange:
        result = await self.averager.step(weight=weight, timeout=self.options.round_timeout)
        self.last_step = result
        if result.committed:
            return Exchange(RoundOutcome.COMMITTED, "", result.group_size)
        if result.reason.startswith("no group"):
            return Exchange(RoundOutcome.NO_GROUP, result.reason, 1)
        return Exchange(RoundOutcome.ABORTED, result.reason, 1)

    async def _announce(self) -> None:
        """Stay declared in our cell between rounds, so that its leaders wait for us."""
        try:
            async with asyncio.timeout(5.0):
                await self.averager.refresh_presence()
        except Exception as e:  # best effort: retried at the next inner step
            log.debug("%s: declaring that we take part failed: %r", self.key, e)

    async def _close_parts(self) -> None:
        await self.averager.aclose()
        self._state_server.close()

    @property
    def cell(self) -> str | None:
        """Our cell of the grid (the next round's), for the status surfaces."""
        grid = self.averager.grid
        return None if grid is None else grid.cell()
