"""One stage's optimizer step, taken together by every peer that serves the stage.

The peers of a stage accumulate parameter gradients from whichever microbatches
reached them (`StageWorker`, weighted by samples). A step averages them with the
fault-tolerant all-reduce (`averaging.Averager`, one group per stage): each peer
contributes its mean gradient weighted by its samples, so every member gets the
gradient of the mean loss over all the stage's microbatches, bit-identical; then
each applies the same AdamW step to the same parameters and moments, so the
stage's parameters stay bit-identical on every peer (equal fingerprints).

The stage's state (parameters, AdamW moments and step count) is the averager's
shared state: versioned by commits, served to a peer that joins the stage or
missed a step (it downloads it before it takes traffic again), fingerprinted.
A round that aborts gives the gradients back to the worker: nothing is lost,
the next step carries them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from shoal.averaging.averager import Averager, AveragerConfig, StepResult
from shoal.averaging.host_state import host_flat_zeros, numel, off_loop
from shoal.averaging.matchmaking import MatchmakingConfig
from shoal.averaging.outer import state_protocol
from shoal.dht.node import DHTNode

from .stage import StageWorker

__all__ = ["StageOptimizer", "stage_averaging_key"]


def stage_averaging_key(experiment: str, stage: int) -> str:
    return f"shoal/x/{experiment}/stage/{stage}/grads"


class StageOptimizer:
    """AdamW over one stage's parameters, stepped together by the stage's peers."""

    def __init__(
        self,
        dht: DHTNode,
        experiment: str,
        stage: int,
        worker: StageWorker,
        *,
        hyper: Mapping[str, Any],
        matchmaking: MatchmakingConfig | None = None,
        codec: str = "none",
    ) -> None:
        self.worker = worker
        self.params = worker.params
        self.optimizer = torch.optim.AdamW(
            self.params,
            lr=hyper["lr"],
            weight_decay=hyper.get("weight_decay", 0.0),
            betas=(0.9, hyper.get("adam_beta2", 0.999)),
        )
        # The moments exist from the start (AdamW makes them at its first step): they
        # are part of the state a joiner downloads and the fingerprint.
        moments: list[torch.Tensor] = []
        for p in self.params:
            state = self.optimizer.state[p]
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)
            moments += [state["step"].view(1), state["exp_avg"], state["exp_avg_sq"]]
        self._buffer, self.gradients = host_flat_zeros(self.params)
        key = stage_averaging_key(experiment, stage)
        config = AveragerConfig(
            matchmaking=matchmaking or MatchmakingConfig(),
            codec=codec,
            state_protocol=state_protocol(key),
            shared_state=True,
        )
        self.averager = Averager(
            dht,
            key,
            [self._buffer],
            config=config,
            state=[*self.params, *moments],
            on_commit=self._apply,
        )

    @property
    def version(self) -> int:
        """Optimizer steps the stage's state holds."""
        return self.averager.commits

    async def step(self, timeout: float) -> StepResult:
        """Average the gradients accumulated here with the stage's other peers and
        take the optimizer step (on commit); on abort they go back to the worker."""
        taken = self.worker.take_gradients()
        scale = 1.0 / max(1, taken.samples)

        def load() -> None:
            for view, total in zip(self.gradients, taken.sums, strict=True):
                view.copy_(total).mul_(scale)

        await off_loop(load, numel(self.params))
        result = await self.averager.step(weight=float(taken.samples), timeout=timeout)
        if not result.committed and taken.samples:
            self.worker.give_back(taken)
        return result

    async def sync(self, timeout: float) -> bool:
        """Download the stage's current state (parameters, moments, step) from its peers:
        before serving, for a peer that joins the stage or missed a step."""
        return await self.averager.load_state_from_peers(timeout)

    def _apply(self) -> None:
        """The commit hook (in a thread): `gradients` hold the stage's mean gradient.
        Under the worker's lock: no request computes with half-stepped parameters."""
        with self.worker.lock:
            with torch.no_grad():
                for p, g in zip(self.params, self.gradients, strict=True):
                    p.grad = g.to(p.device, copy=True)
            self.optimizer.step()
            for p in self.params:
                p.grad = None

    def fingerprint(self) -> str:
        return self.averager.fingerprint()

    async def aclose(self) -> None:
        await self.averager.aclose()
