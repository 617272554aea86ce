"""NoLoCo: DiLoCo without an all-reduce; every outer round averages with one partner.

NoLoCo (Kolehmainen et al. 2025, "No-all-reduce Low Communication training")
drops DiLoCo's global synchronization: every peer keeps its *own* outer
parameters and momentum, and in each outer round it averages with one other
peer picked at random; the replicas stay close because each round pulls a
peer's outer parameters toward its partner's. Its outer step (as we recall it) is
``d = a*d - b*mean_pair(pseudo-gradient) - g*(phi - mean_pair(phi)); phi += d``.

What we do, every H inner steps:

1. the peer applies the outer Nesterov step of DiLoCo to its own outer
   parameters with its own pseudo-gradient (``m = mu*m + g; phi -= lr*(g +
   mu*m)``, g = phi - local);
2. it averages the resulting outer parameters, weighted by the samples behind
   them, with the partner `gossip.pairing` gives it for this outer round
   (commit-or-abort per pair: both take the weighted mean or both keep their
   own), and moves toward that mean by `param_mixing` (1: takes it);
3. the local parameters restart from the outer parameters.

Why the post-step parameters rather than the pair's pseudo-gradients and
parameters separately, as the paper's formula reads: the outer step is
linear, so the mean of two post-step parameters is the pair's mean parameters
moved by the step of the pair's mean pseudo-gradient and mean momentum. Pairwise
means keep the swarm's sum (with equal weights), so the swarm's mean parameters
follow DiLoCo's outer Nesterov step on the swarm's mean pseudo-gradient, as
with the paper's update they follow its momentum step; and one model's worth of
bytes goes each way per round instead of two. What differs: a peer's momentum
accumulates its own pseudo-gradients rather than its pairs' means (a noisier
momentum per replica, which the exchanges average away), and the pull toward
the partner is not itself carried by the momentum.

No matchmaking, no group: a pair is derived from the participants announced
in the DHT and the round number alone (`gossip.pairing`), so a slow or gone
partner costs at most the all-reduce's start timeout and the peer keeps its
own values for that round. A joiner downloads the outer parameters, momentum
and round number from any peer (state sync); the replicas differ a little,
any one is a fine start.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from shoal.dht.node import DHTNode
from shoal.transport.identity import PeerID

from .fingerprint import state_fingerprint
from .gossip import GossipAverager, GossipConfig, GossipResult
from .host_state import (
    copy_into,
    delta_into,
    host_clone,
    host_flat_zeros,
    host_zeros,
    numel,
    off_loop,
)
from .noloco_options import NoLoCoOptions
from .outer import (
    RoundOutcome,
    RoundReport,
    allreduce_config,
    check_like,
    nesterov_outer_step,
    state_protocol,
)
from .state_sync import State, StateServer, StateSyncError, load_state_from_peers, make_state
from .strategy_base import OuterStrategyBase, RoundClock, checked_counters

log = logging.getLogger("shoal.averaging.noloco")

__all__ = ["NoLoCo"]

ANNOUNCE_TIMEOUT = 5.0


@dataclass(frozen=True)
class Exchange:
    """How one round's exchange ended: its outcome, why, and the group's size."""

    outcome: RoundOutcome
    detail: str
    group_size: int


class NoLoCo(OuterStrategyBase):
    """NoLoCo over `params` (the model's parameters, changed in place)."""

    name = "noloco"
    options: NoLoCoOptions

    def __init__(
        self, dht: DHTNode, key: str, params: Sequence[torch.Tensor], options: NoLoCoOptions
    ) -> None:
        super().__init__(dht, key, params, options)
        with torch.no_grad():
            self.outer = [host_clone(p) for p in self.params]
        self.momentum = [host_zeros(p) for p in self.params]
        self._deltas = [host_zeros(p) for p in self.params]
        # What is exchanged: a copy of the post-step outer parameters (float32, the
        # all-reduce's dtype), sent from its own storage while nothing else writes it.
        mixed_buffer, self._mixed = host_flat_zeros(self.params)
        self._make_exchange(mixed_buffer)
        self.outer_steps = 0  # also the round number that picks partners
        self.last_exchange: GossipResult | None = None
        self._protocol = state_protocol(key)
        self._frozen: State | None = None
        self._state_server = StateServer(
            dht, key, lambda: self._frozen, protocol=self._protocol, copy=False
        )
        self._oversized_refused = 0

    def _make_exchange(self, mixed_buffer: torch.Tensor) -> None:
        """What averages `mixed_buffer` with others each round: a partner's gossip."""
        self.gossip = GossipAverager(
            self.dht,
            self.key,
            [mixed_buffer],
            config=GossipConfig(
                allreduce=allreduce_config(self.options),
                codec=self.options.codec,
                adaptive=self.options.deadlines == "adaptive",
            ),
        )

    async def _exchange(self, round_number: int, weight: float) -> Exchange:
        """Average the post-step outer parameters (`_mixed`, in place) with a partner."""
        result = await self.gossip.step(round_number, weight=weight)
        self.last_exchange = result
        if result.committed:
            return Exchange(RoundOutcome.COMMITTED, "", 2)
        if result.partner is None:
            return Exchange(RoundOutcome.NO_GROUP, result.reason, 1)
        return Exchange(RoundOutcome.ABORTED, result.reason, 1)

    @property
    def oversized_refused(self) -> int:
        return self._oversized_refused

    def _refused(self, holder: PeerID) -> None:
        self._oversized_refused += 1
        log.info("%s offered a state of %s laid out unlike ours: refused", holder.short(), self.key)

    # ------------------------------------------------------------------ lifecycle

    async def start(self, *, join: bool) -> bool:
        loaded = False
        if join:
            loaded = await self._load_from_peers()
            if loaded:
                self._synced_now()
        if not loaded and not self._restored:
            copy_into(self.outer, self.params)
        await self._publish()
        await self._announce()
        return loaded

    async def _between_rounds(self) -> None:
        # Partners are drawn from the announced participants: stay announced (a store
        # once per half TTL) however long the time between rounds.
        await self._announce()

    async def _close_parts(self) -> None:
        await self.gossip.aclose()
        self._state_server.close()

    # ------------------------------------------------------------------ the round

    async def _round(self) -> RoundReport:
        clock = RoundClock(self.dht)
        size = numel(self.params)

        def outer_step() -> None:
            delta_into(self._deltas, self.outer, self.params)
            nesterov_outer_step(
                self.outer,
                self._deltas,
                self.momentum,
                lr=self.options.outer_lr,
                mu=self.options.outer_momentum,
            )
            copy_into(self._mixed, self.outer)

        await off_loop(outer_step, size)
        round_number = self.outer_steps
        exchange = await self._exchange(round_number, float(self.samples_since_sync))
        committed = exchange.outcome is RoundOutcome.COMMITTED
        fingerprint = None
        if committed:
            fingerprint = await asyncio.to_thread(
                state_fingerprint, self._mixed, {"round": round_number}
            )
        gamma = self.options.param_mixing

        def merge() -> None:
            if committed:
                for o, m in zip(self.outer, self._mixed, strict=True):
                    o.lerp_(m.to(o.dtype), gamma)  # (exactly the mean at 1)
            copy_into(self.params, self.outer)

        await off_loop(merge, size)
        self.samples_since_sync = 0
        self.outer_steps += 1
        await self._publish()
        return self._report(
            exchange.outcome,
            exchange.detail,
            group_size=exchange.group_size,
            fingerprint=fingerprint,
            duration_s=clock.seconds,
            bytes_sent=clock.bytes_sent,
        )

    async def _announce(self) -> None:
        try:
            async with asyncio.timeout(ANNOUNCE_TIMEOUT):
                await self.gossip.announce()
        except Exception as e:  # best effort: retried at the next inner step
            log.debug("%s: announcing that we take part failed: %r", self.key, e)

    # ------------------------------------------------------------------ state

    def _metadata(self) -> dict[str, Any]:
        return {"strategy": self.name, "step": self.outer_steps}

    @property
    def committed_fingerprint(self) -> str | None:
        """The fingerprint of the state last published (hashed off the event loop)."""
        return None if self._frozen is None else self._frozen.fingerprint

    def fingerprint(self) -> str:
        """This peer's own outer state (NoLoCo replicas differ by design)."""
        return state_fingerprint([*self.outer, *self.momentum], self._metadata())

    async def _publish(self) -> None:
        tensors, metadata = (*self.outer, *self.momentum), self._metadata()

        def freeze() -> State:
            # Copy and hash in a thread (a whole model's worth of both would stall the
            # event loop); nothing writes the state meanwhile: this round awaits it.
            return make_state([t.detach().clone() for t in tensors], metadata)

        self._frozen = await asyncio.to_thread(freeze)
        try:
            await self._state_server.announce()
        except Exception as e:  # best effort: the next outer step announces again
            log.debug("%s: announcing our state failed: %r", self.key, e)

    async def _load_from_peers(self) -> bool:
        try:
            state = await load_state_from_peers(
                self.dht, self.key, protocol=self._protocol, timeout=self.options.state_timeout,
                like=[*self.outer, *self.momentum], on_refused=self._refused,
            )  # fmt: skip
        except (StateSyncError, TimeoutError) as e:
            log.info("%s: no state loaded from peers: %s", self.key, e)
            return False
        n = len(self.outer)
        mine = [*self.outer, *self.momentum]
        if len(state.tensors) != 2 * n or any(
            a.shape != b.shape or a.dtype != b.dtype
            for a, b in zip(state.tensors, mine, strict=True)
        ):
            log.warning("%s: the swarm's state does not fit our parameters", self.key)
            return False
        step = state.metadata.get("step", 0)
        copy_into(mine, state.tensors)
        copy_into(self.params, self.outer)
        self.outer_steps = step if isinstance(step, int) and step >= 0 else 0
        return True

    def state_dict(self) -> dict[str, Any]:
        return {
            "strategy": self.name,
            "outer": [t.detach().clone() for t in self.outer],
            "momentum": [t.detach().clone() for t in self.momentum],
            "outer_steps": self.outer_steps,
            "inner_steps": self.inner_steps,
            "samples_since_sync": self.samples_since_sync,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._check_checkpoint(state)
        outer = check_like("outer", state.get("outer"), self.outer)
        momentum = check_like("momentum", state.get("momentum"), self.momentum)
        counters = checked_counters(state, ("outer_steps", "inner_steps", "samples_since_sync"))
        copy_into(self.outer, outer)
        copy_into(self.momentum, momentum)
        self.outer_steps, self.inner_steps, self.samples_since_sync = counters
        self._restored = True
