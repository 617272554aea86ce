"""One stage's optimizer step, taken together by every peer that serves the stage.

The peers of a stage accumulate parameter gradients from whichever microbatches
reached them (`StageWorker`, weighted by samples). A step averages them with the
fault-tolerant all-reduce (`averaging.Averager`, one group per stage): each peer
contributes its mean gradient weighted by its samples, so every member gets the
gradient of the mean loss over all the stage's microbatches, bit-identical; then
each applies the same AdamW step to the same parameters and moments, so the
stage's parameters stay bit-identical on every peer (equal fingerprints). A
stage on a GPU takes that step on a float32 host copy of its parameters, with
the moments on the host too, by the CPU's code, and copies the result into its
module: the same bits as its CPU peers'.

The stage's state (parameters, AdamW moments and step count) is the averager's
shared state: versioned by commits, served to a peer that joins the stage or
missed a step (it downloads it before it takes traffic again), fingerprinted.
A round that aborts gives the gradients back to the worker: nothing is lost,
the next step carries them. Each committed step is logged with its members, so
the trainers learn which of their microbatches it included (`StepRecord`).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Coroutine, Hashable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shoal.averaging.averager import Averager, AveragerConfig, StepResult
from shoal.averaging.host_state import copy_into, host_clone, host_flat_zeros, numel, off_loop
from shoal.averaging.matchmaking import MatchmakingConfig
from shoal.averaging.outer import state_protocol
from shoal.averaging.paged import file_tensors
from shoal.averaging.paged_adamw import step_in_slices
from shoal.dht.node import DHTNode
from shoal.transport.identity import PeerID

from .clipping import stage_squared_norm
from .stage import StageWorker

__all__ = ["STEP_LOG", "StageOptimizer", "StepRecord", "stage_averaging_key"]

STEP_LOG = 8  # the last steps whose members a peer tells trainers about


@dataclass(frozen=True)
class StepRecord:
    """Which peers' gradients the stage's step from `version` averaged, and which
    backwards (their keys) our own gradients in it held."""

    version: int
    members: tuple[PeerID, ...]
    samples: int | None  # the step's global batch, all members' samples (None: unknown)
    # (None: not known, a step read back from a checkpoint that did not keep them)
    keys: frozenset[Hashable] | None = frozenset()


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
        adaptive_deadlines: bool = True,
        copies_dir: Path | None = None,
        moments_dir: Path | None = None,
    ) -> None:
        """`adaptive_deadlines`: the round's timeouts are floors, raised by what the
        stage's links measured (`averaging.deadlines`), as DiLoCo's are. `moments_dir`:
        AdamW's moments live in a file there, their pages given back after each use
        (`averaging.paged`: a peer within a memory budget, `memory.StageLimits.
        moments_on_disk`; parameters on the CPU only); None: in memory."""
        self.worker = worker
        self.hyper = dict(hyper)
        # What the step steps, serves and fingerprints: the module's parameters where
        # they are float32 on the CPU; else (a stage on a GPU) a float32 host copy,
        # stepped by the same CPU code and copied into the module after every step and
        # load. The stage's peers then hold the same bits whatever device serves it: a
        # GPU's AdamW rounds otherwise (a CUDA and a CPU peer of one stage parted after
        # their first step, tests/test_pipeline_network.py on an H200).
        self._in_place = all(
            p.device.type == "cpu" and p.dtype == torch.float32 for p in worker.params
        )
        self.params = worker.params if self._in_place else [host_clone(p) for p in worker.params]
        self.moments_paged = moments_dir is not None and self._in_place
        self.optimizer = torch.optim.AdamW(
            self.params,
            lr=hyper["lr"],
            weight_decay=hyper.get("weight_decay", 0.0),
            betas=(0.9, hyper.get("adam_beta2", 0.999)),
            # (One tensor at a time, as on the CPU by default: stepped a parameter at a
            # time, file-mapped moments give the same bits as moments in memory.)
            foreach=False,
        )
        # The moments exist from the start (AdamW makes them at its first step): they
        # are part of the state a joiner downloads and the fingerprint.
        shapes = [(p.shape, p.dtype) for p in self.params]
        paged = file_tensors(moments_dir, shapes * 2, suffix=".moments") if (
            moments_dir is not None and self.moments_paged) else None  # fmt: skip
        moments: list[torch.Tensor] = []
        for i, p in enumerate(self.params):
            state = self.optimizer.state[p]
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p) if paged is None else paged[i]
            state["exp_avg_sq"] = torch.zeros_like(p) if paged is None else paged[len(shapes) + i]
            moments += [state["step"].view(1), state["exp_avg"], state["exp_avg_sq"]]
        # What a step averages: on the CPU, the taken bucket itself (`Gradients.flat`,
        # scaled in place: no copy of it); else its copy in one host float32 buffer
        # (pinned for a GPU's copies), which the host step then reads as it is.
        if self._in_place:
            self._buffer = torch.empty(numel(self.params), device="meta")  # (its size only)
            self.gradients: list[torch.Tensor] = []  # (the step's bucket, while it runs)
        else:
            self._buffer, self.gradients = host_flat_zeros(worker.params)
        self._round_input = self._buffer
        key = stage_averaging_key(experiment, stage)
        config = AveragerConfig(
            matchmaking=matchmaking or MatchmakingConfig(),
            codec=codec,
            state_protocol=state_protocol(key),
            shared_state=True,
            alone_supersedes=True,  # (a lone step is the stage's: see `stage_peer`)
            adaptive_deadlines=adaptive_deadlines,
        )
        self.averager = Averager(
            dht,
            key,
            [self._buffer],
            config=config,
            state=[*self.params, *moments],
            on_commit=self._apply,
            round_tensors=lambda group, weight: [self._round_input],
            live_state=True,  # (they change only in `_apply` and loads: served in place)
            copies_dir=copies_dir,  # (a download a step overlaps reads its copy there)
        )
        self.averager.state_lock = worker.lock  # a download never meets a request half-way
        self.steps: deque[StepRecord] = deque(maxlen=STEP_LOG)
        self.committed_samples = 0  # samples of ours that went into committed steps
        self.step_samples: dict[int, int] = {}  # version stepped from -> the step's samples
        self.dropped_samples = 0  # samples of ours whose step went on without us
        # Global clipping (`clip_exchange.ClipExchange.factor`): given the step's version,
        # our stage's squared gradient norm and the step's group size, the factor
        # every stage scales its gradient by. None: no clipping.
        self.clip: Callable[[int, float, int], Coroutine[Any, Any, float]] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._work_before = 0
        self.stepping = False  # in the averager's step (it commits before the log is written)

    @property
    def version(self) -> int:
        """Optimizer steps the stage's state holds."""
        return self.averager.commits

    async def step(
        self, timeout: float, *, alone: bool = True, quorum: Callable[[], int] | None = None
    ) -> StepResult:
        """Average the gradients accumulated here for the current version with the
        stage's other peers and take the optimizer step (on commit); `alone`: step
        by ourselves when no other peer of the stage is declared; `quorum`: the
        smallest group to accept, asked again while matchmaking runs (see
        `Averager.step`).

        When nobody committed, the gradients go back to the worker for the next
        try (after a round we were in doubt about, without what arrives meanwhile).
        When the stage stepped without us (we were behind and re-synced instead),
        they are dropped: they were computed for a step that is gone, and the
        trainers replay those microbatches on peers that took part.
        """
        version = self.version
        # (In threads: they wait for the worker's lock, which a computation may hold.)
        taken = await asyncio.to_thread(self.worker.take_gradients, version)
        scale = 1.0 / max(1, taken.samples)
        in_place = self._in_place and taken.flat is not None
        if in_place:
            assert taken.flat is not None
            self._round_input, self.gradients = taken.flat, list(taken.sums)

        def load() -> None:
            if in_place:
                self._round_input.mul_(scale)
                return
            for view, total in zip(self.gradients, taken.sums, strict=True):
                view.copy_(total).mul_(scale)

        await off_loop(load, numel(self.params))
        self._loop, self._work_before = asyncio.get_running_loop(), self.averager.work
        self.stepping = True  # (a checkpoint waits: the step's log is not written yet)
        try:
            result = await self.averager.step(
                weight=float(taken.samples), timeout=timeout, alone=alone, quorum=quorum
            )
        finally:
            self.stepping = False
            if in_place:  # (the bucket is the worker's again, or freed)
                self._round_input, self.gradients = self._buffer, []
        if in_place and not result.committed and not result.resynced and self.version == version:
            # Given back below: the sums again, as far as float32 undoes the scaling
            # (a round that did not commit left the input untouched).
            flat, samples = taken.flat, max(1, taken.samples)
            assert flat is not None
            await off_loop(lambda: flat.mul_(samples), numel(self.params))
        if result.resynced:
            await self.state_loaded()  # (the averager downloaded the state)
        if result.committed:
            self.committed_samples += taken.samples
            total = round(sum(result.weights.values())) if result.weights else None
            self.steps.append(StepRecord(version, tuple(result.members), total, taken.keys))
            if total is not None:
                self.step_samples[version] = total
        elif result.resynced or self.version != version:
            dropped = await asyncio.to_thread(self.worker.drop_before, self.version, taken.keys)
            self.dropped_samples += taken.samples + dropped
        else:  # (in doubt: the round may have committed them, see `give_back`)
            reopen = not result.discarded
            await asyncio.to_thread(lambda: self.worker.give_back(taken, reopen=reopen))
        return result

    async def sync(self, timeout: float) -> bool:
        """Download the stage's current state (parameters, moments, step) from its peers:
        before serving, for a peer that joins the stage or missed a step. Gradients
        for steps taken without us are dropped (their trainers replay them)."""
        self.worker.version = None  # (answers computed meanwhile are not auditable)
        try:
            loaded = await self.averager.load_state_from_peers(timeout)
        finally:
            await self.state_loaded()
        dropped = await asyncio.to_thread(self.worker.drop_before, self.version)
        self.dropped_samples += dropped
        return loaded

    async def state_loaded(self) -> None:
        """The averager's state was replaced (a download, a checkpoint): the module
        computes with it from now on, at its version."""
        if self._in_place:  # (it computes with the state's own tensors)
            self.worker.version = self.version
        else:
            await asyncio.to_thread(self._loaded)

    def _loaded(self) -> None:
        with self.worker.lock:
            self._into_module()
            self.worker.version = self.version

    def _into_module(self) -> None:
        """(Under the worker's lock.) The module's parameters = the stepped state's,
        where the step runs on a host copy."""
        if not self._in_place:
            with torch.no_grad():
                copy_into(self.worker.params, self.params)

    def _apply(self) -> None:
        """The commit hook (in a thread): `gradients` hold the stage's mean gradient.
        Under the worker's lock: no request computes with half-stepped parameters (but
        not while it waits for the other stages' gradient norms: requests go on)."""
        factor = self._clip_factor()
        with self.worker.lock:
            # Linear warmup by the step's number: the same on every peer of the stage.
            warmup = int(self.hyper.get("warmup_steps", 0))
            scale = min(1.0, self.version / warmup) if warmup > 0 else 1.0  # (counts this step)
            for group in self.optimizer.param_groups:
                group["lr"] = self.hyper["lr"] * scale
            with torch.no_grad():
                for p, g in zip(self.params, self.gradients, strict=True):
                    # (The averaged gradients are this step's own, on the host in
                    # float32 as the parameters stepped: used as they are, not copied.)
                    p.grad = g
                    if factor != 1.0:
                        p.grad.mul_(factor)
            if self.moments_paged:  # (the same bits, a slice's moments held at a time)
                step_in_slices(self.optimizer)
            else:
                self.optimizer.step()
            for p in self.params:
                p.grad = None
            self._into_module()
            self.worker.version = self.version  # (the commit counted this step already)

    def _clip_factor(self) -> float:
        """(In the commit hook's thread.) The global clipping factor of this step: our
        stage's norm is the same on every peer of the stage (the all-reduce's result);
        the other stages' come through `clip`, run on the loop while we wait here."""
        if self.clip is None:
            return 1.0
        loop = self._loop
        assert loop is not None
        squared = stage_squared_norm(self.gradients)
        group = max(1, self.averager.work - self._work_before)  # (the commit added its members)
        step = self.clip(self.version - 1, squared, group)  # (the commit counted this step)
        return asyncio.run_coroutine_threadsafe(step, loop).result()

    def fingerprint(self) -> str:
        return self.averager.fingerprint()

    async def aclose(self) -> None:
        await self.averager.aclose()
