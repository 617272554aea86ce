"""A peer's part in a pipelined experiment: the stage it serves, the microbatches it drives.

`PipelineRun` stands where a data-parallel peer has its `Trainer` and outer
strategy, so the daemon, the status endpoint and the peer reports treat both
kinds of experiment alike (`step`, `loss`, `outer_step`, `fingerprint`,
`run`, `aclose`).

Roles (``--role``): ``stage`` serves one stage of the model; ``trainer`` drives
microbatches of its own data shard through every stage without serving one;
``auto`` (the default) does both; ``monitor`` does neither (it keeps the
experiment and shows its pipeline: a bootstrap peer). The stage is ``--stage
K`` or, by default, the one with the least capacity in the stage records when
the peer starts. A
peer downloads its stage's state from the stage's peers before it announces
itself (the first peer of a stage starts from the manifest's seed).

A peer builds only the stage it serves (`stage_build.build_stage`), and checks it
against the manifest's fingerprint of that stage: a peer that builds it otherwise
(another torch that initializes differently) refuses to start it from its own
build, and takes the stage's state from its peers if it has any.

Each stage peer checkpoints its stage in its data directory
(`checkpoints`). A peer that holds the checkpoint of a stage no live peer
serves restores it from there (and, with no pinned stage, chooses that
stage); with no copy left a stage starts again from the seed, and /status says
it was lost (`pipeline.stages[k].lost`, `restored`: `pipeline.stage_losses`).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from shoal.dht.node import DHTNode
from shoal.pipeline.boundary import boundary_task
from shoal.pipeline.bounds import StageBounds, probe_bounds
from shoal.pipeline.clip_exchange import ClipExchange
from shoal.pipeline.directory import StageRecord, read_stages
from shoal.pipeline.memory import DEFAULT_LIMITS
from shoal.pipeline.mover import StageMover
from shoal.pipeline.options import DEFAULTS
from shoal.pipeline.rebalance import RebalancePolicy
from shoal.pipeline.sizes import format_size
from shoal.pipeline.stage_build import build_stage, stage_fingerprint, stage_fingerprints
from shoal.pipeline.stage_losses import StageLosses
from shoal.pipeline.stage_peer import StagePeer
from shoal.pipeline.trainer import Microbatch, PipelineTrainer
from shoal.pipeline.trainer_loop import TrainerLoop
from shoal.transport.identity import Identity
from shoal.verification.stage_audit import StageAuditPolicy

from ..experiment import Manifest, stages_fingerprint
from ..status.pipeline_status import PipelineStatus
from ..trainer import RATE_WINDOW_S, TrainerStats
from ..training.checkpoint import CheckpointError
from ..training.heap import (
    TRIM_INTERVAL_S,
    release_free_memory_every,
    return_large_blocks_at_once,
)
from ..training.task import Task, shard_of
from .budget import StageBudget, available_memory
from .checkpoints import StageCheckpoints
from .status import oversized_refused, run_status
from .validation import PipelineValidation

__all__ = ["PipelineRun", "StageMismatch", "pipeline_fingerprint"]

log = logging.getLogger("shoal.pipeline")

DIRECTORY_REFRESH_S = 5.0


def pipeline_fingerprint(task: Task, seed: int, stages: int, codec: str = "none") -> str:
    """The initial model's fingerprint (a manifest's `initial_fingerprint`), of each
    stage's (with the adapters the experiment's `codec` inserts), the stages built
    one at a time."""
    return stages_fingerprint(stage_fingerprints(boundary_task(task, codec), seed, stages))


class StageMismatch(ValueError):
    """This peer builds its stage unlike the manifest's host; the message is one line."""


async def check_built(
    manifest: Manifest, records: list[StageRecord], k: int, module: torch.nn.Module
) -> None:
    """Refuse stage `k` built unlike the host's when it would start from that build
    (no peer serves it yet); with peers to download its state from, say so only."""
    expected = manifest.stage_fingerprints
    if not expected:  # (the session refuses a pipeline's manifest without them)
        return
    built = await asyncio.to_thread(stage_fingerprint, module)
    if built == expected[k]:
        return
    if not records:
        raise StageMismatch(
            f"this peer builds stage {k} unlike the experiment's host (fingerprint "
            f"{built[:12]}, manifest {expected[k][:12]}: another torch version?) and no "
            "peer serves the stage's state yet; use the host's shoal and torch versions"
        )
    log.warning(
        "this peer builds stage %d unlike the host (fingerprint %s, manifest %s: another "
        "torch version?); downloading the stage's state from its peers",
        k, built[:12], expected[k][:12],
    )  # fmt: skip


class PipelineRun:
    def __init__(
        self,
        dht: DHTNode,
        identity: Identity,
        manifest: Manifest,
        task: Task,
        hyper: dict[str, Any],
        *,
        role: str,
        stage: int | None,
        device: torch.device,
        checkpoints: StageCheckpoints | None = None,
        max_memory: int | None = None,
        copies_dir: Path | None = None,
    ) -> None:
        """`checkpoints`: where our stage is saved and restored from (None: nowhere).
        `max_memory`: this peer's memory budget in bytes (None: what the machine and
        the device have free when it starts). `copies_dir`: a folder for the stage
        state's transient copies (one a download of ours or of a peer's holds across
        a step), which otherwise take 3 parameter sizes of memory (emptied here: what
        is in it is a dead run's)."""
        self.dht = dht
        self.manifest = manifest
        self.options = manifest.strategy_options
        # Its stages as the experiment's codec builds them (WIRE+lowrankR: in adapters).
        self.task = boundary_task(task, str(self.options.get("codec", "none")))
        self.stages = int(self.options["stages"])
        self.hyper = hyper
        self.role = role
        self.wanted_stage = stage
        self.device = device
        self.stats = TrainerStats()
        self.on_round: Callable[[Any], None] | None = None  # (no averaging rounds of its own)
        self.stage_peer: StagePeer | None = None
        self.loop: TrainerLoop | None = None
        self.validation: PipelineValidation | None = None  # (a trainer's held-out loss)
        self.mover: StageMover | None = None  # (a stage peer whose stage is not pinned)
        self.directory: list[list[StageRecord]] = [[] for _ in range(self.stages)]
        self._shard = shard_of(identity.peer_id.to_bytes(), hyper["num_shards"])
        self._seed = int.from_bytes(identity.peer_id.to_bytes()[-8:], "big") ^ manifest.seed
        self._done: collections.deque[tuple[float, int]] = collections.deque()
        self._tokens_per_sample = 1
        self._view = PipelineStatus()  # the richer keys of status(): servers, flow, bans
        self.bounds: list[StageBounds] | None = None  # (`start` probes them)
        self.checkpoints = checkpoints
        self.losses = StageLosses(self.stages)
        self.max_memory = max_memory
        self.copies_dir = copies_dir
        if copies_dir is not None:
            shutil.rmtree(copies_dir, ignore_errors=True)
        self.budget: StageBudget | None = None  # what each stage costs us (`start`)
        if stage is not None and not 0 <= stage < self.stages:
            raise ValueError(f"--stage {stage}: this experiment has stages 0 to {self.stages - 1}")

    # ------------------------------------------------------------------ start

    async def start(self) -> None:
        """Serve a stage (roles auto and stage) and set up the trainer (auto, trainer)."""
        if self.role != "monitor":
            # What each stage's requests and answers may hold: more is refused unread.
            self.bounds = await asyncio.to_thread(
                probe_bounds, self.task, self.manifest.seed, self.stages,
                int(self.options["global_batch"]),
            )  # fmt: skip
            self.budget = self._stage_budget(self.bounds)
        await self.refresh_directory()
        if self.role in ("auto", "stage"):
            held = None if self.checkpoints is None else await self.checkpoints.load()
            # An orphaned stage we hold a checkpoint of: restore it (if it fits).
            orphan = None
            if held is not None and not self.directory[held["stage"]]:
                orphan = held["stage"]
            assert self.budget is not None
            k = self.budget.choose(self.directory, self.dht.peer_id, self.wanted_stage, orphan)
            peer = await self._make_stage_peer(k)
            await self._start_stage(peer, held if held is not None and held["stage"] == k else None)
            self.stage_peer = peer
            log.info("serving stage %d of %d (version %d)", k, self.stages, peer.version)
            period = float(self.options.get("rebalance_s", DEFAULTS["rebalance_s"]))
            if period > 0 and self.wanted_stage is None:  # (a pinned stage stays)
                policy = RebalancePolicy(
                    period_s=period,
                    min_peers=int(self.options.get("min_stage_peers", 1)),
                )
                self.mover = StageMover(
                    self.dht, self.manifest.experiment_id, self.stages, peer,
                    self._make_stage_peer, policy=policy, on_moved=self._moved,
                    fits=self._fitting,
                )  # fmt: skip
        if self.role in ("auto", "trainer"):
            # (A manifest from before stage audits has no `verify`: none.)
            audit = StageAuditPolicy() if self.options.get("verify", False) else None
            trainer = PipelineTrainer(self.dht, self.manifest.experiment_id, self.stages,
                                      codec=str(self.options["codec"]), audit=audit)  # fmt: skip
            trainer.calls.bounds = self.bounds
            if self.stage_peer is not None:
                trainer.local[self.stage_peer.stage] = self.stage_peer.server
            self.loop = TrainerLoop(
                trainer,
                self.task.batches(self._shard, self.hyper["num_shards"], self._seed),
                inputs_of=self.task.stage_inputs,  # type: ignore[attr-defined]
                loss_of=self.task.stage_loss,  # type: ignore[attr-defined]
                global_batch=int(self.options["global_batch"]),
                lag=int(self.options["lag"]),
            )
            self.loop.on_microbatch = self._microbatch_done
            self.validation = PipelineValidation(self.task, self.loop, self.stats)

    async def _start_stage(self, peer: StagePeer, held: dict[str, Any] | None) -> None:
        """Start `peer` with its stage's state: downloaded from the stage's peers; else
        (none, or none could give it: all dead, their records not expired) restored
        from our checkpoint `held`, else the manifest's seed. The first peers of a
        stage (all at version 0) start from the seed without waiting for holders
        that cannot exist.
        Should the records have been missed, the peer's loop sees the stage's newer
        version and re-syncs."""
        k = peer.stage
        # (Peers at version 0 serve no state: they committed nothing yet.)
        trained = any(r.version > 0 for r in self.directory[k])
        loaded = trained and await peer.optimizer.sync(peer.sync_timeout)
        if not loaded and self.checkpoints is not None:
            if held is not None:
                await self.checkpoints.restore(peer, held)
                log.warning("stage %d: no live peer held its state; restored it from our "
                            "checkpoint at version %d", k, peer.version)  # fmt: skip
            else:
                peer.server.checkpointed = 0  # (the seed's state: nothing to lose yet)
        if not loaded and peer.server.restored is None:
            peer.server.restored = 0  # (from the seed: observers know if that lost steps)
            if trained:
                log.warning("stage %d: no live peer could give its state and we hold no "
                            "checkpoint of it: starting it from the initial weights (its "
                            "trained state is lost)", k)  # fmt: skip
        elif loaded and self.checkpoints is not None:
            peer.server.checkpointed = 0  # (until our first checkpoint of the stage)
        await peer.start(sync=False)

    def _stage_budget(self, bounds: list[StageBounds]) -> StageBudget:
        """Our budget and what each stage costs us; a trainer whose own microbatches
        do not fit refuses (NoStageFits)."""
        budget = self.max_memory or available_memory(self.device)
        # Samples a trainer keeps in flight: what may wait in a stage's queue at once.
        in_flight = (1 + int(self.options["lag"])) * int(self.options["global_batch"])
        out = StageBudget(self.task, self.manifest.seed, bounds, budget=budget,
                          in_flight=in_flight, trainer=self.role == "auto",
                          audits=bool(self.options.get("verify", False)),
                          on_device=self.device.type != "cpu",
                          copies_on_disk=self.copies_dir is not None,
                          window=self.dht.host.config.connection.mux.max_window)  # fmt: skip
        # What we free goes back at once: the peak is then what we hold (the estimate).
        return_large_blocks_at_once()
        if self.role in ("auto", "trainer"):
            out.check_trainer()
        return out

    def _fitting(self, records: list[list[StageRecord]]) -> list[int]:
        """(The mover's `fits`:) the stages that fit our memory."""
        assert self.budget is not None
        return self.budget.fitting_for(records, self.dht.peer_id)

    async def _make_stage_peer(self, k: int) -> StagePeer:
        """A peer for stage `k`, built from the manifest's seed (not started)."""
        limits = DEFAULT_LIMITS if self.budget is None else self.budget.limits(k)
        if self.budget is not None and limits != DEFAULT_LIMITS:
            log.info("stage %d within --max-memory %s: passes of at most %s samples, %s of "
                     "answers kept for retries, backwards %s while a step averages, "
                     "AdamW's moments %s", k,
                     format_size(self.budget.budget or 0), limits.pass_samples or "all",
                     format_size(limits.answer_bytes),
                     "computed" if limits.backwards_while_averaging else "waiting",
                     "in a file" if limits.moments_on_disk else "in memory")  # fmt: skip
        module = await asyncio.to_thread(build_stage, self.task, self.manifest.seed, self.stages, k)
        await check_built(self.manifest, self.directory[k], k, module)
        module = await asyncio.to_thread(module.to, self.device)
        peer = StagePeer(
            self.dht,
            self.manifest.experiment_id,
            k,
            module,
            hyper={
                "lr": self.hyper["inner_lr"],
                "weight_decay": self.hyper["weight_decay"],
                "adam_beta2": self.hyper["adam_beta2"],
                "warmup_steps": self.hyper["warmup_steps"],
            },
            global_batch=int(self.options["global_batch"]),
            device=self.device,
            bounds=None if self.bounds is None else self.bounds[k],
            copies_dir=self.copies_dir,
            limits=limits,
        )
        max_norm = self.options.get("max_grad_norm")
        if max_norm is not None:  # every stage scales by the whole model's norm
            clip = ClipExchange(self.dht, self.manifest.experiment_id, k, self.stages,
                                float(max_norm))  # fmt: skip
            peer.optimizer.clip = clip.factor
        return peer

    def _moved(self, old: StagePeer, new: StagePeer) -> None:
        """The mover moved us from `old`'s stage to `new`'s: our own trainer calls
        the new stage directly, and the old one over the wire like anyone."""
        self.stage_peer = new
        if self.loop is not None:
            self.loop.trainer.local.pop(old.stage, None)
            self.loop.trainer.local[new.stage] = new.server

    async def refresh_directory(self) -> None:
        try:
            self.directory = await read_stages(self.dht, self.manifest.experiment_id, self.stages)
        except Exception as e:  # the next refresh tries again
            log.debug("reading the stage records failed: %r", e)
            return
        self.losses.observe(self.directory, time.time())

    # ------------------------------------------------------------------ running

    async def run(self, stop: asyncio.Event) -> None:
        """Drive microbatches (a trainer) and keep the directory fresh, until `stop`."""
        background = [
            asyncio.ensure_future(self._refresh_loop(stop)),
            # Each commit freezes a copy of the stage's state, audits recompute, a
            # re-sync downloads: glibc keeps the freed blocks unless told otherwise.
            asyncio.ensure_future(release_free_memory_every(TRIM_INTERVAL_S, stop)),
        ]
        if self.mover is not None:
            background.append(asyncio.ensure_future(self.mover.run(stop)))
        if self.validation is not None:
            background.append(asyncio.ensure_future(self.validation.run(stop)))
        if self.checkpoints is not None and self.stage_peer is not None:
            saving = self.checkpoints.run(stop, lambda: self.stage_peer, self._checkpointed)
            background.append(asyncio.ensure_future(saving))
        try:
            if self.loop is not None:
                await self.loop.run(stop)
            else:
                await stop.wait()
        finally:
            for task in background:
                task.cancel()

    async def _refresh_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.refresh_directory()
            self._update_step()
            await asyncio.sleep(DIRECTORY_REFRESH_S)

    def _microbatch_done(self, mb: Microbatch) -> None:
        now = time.monotonic()
        tokens = int(self.task.batch_tokens(mb.batch)) if mb.batch is not None else mb.samples
        self.stats.tokens += tokens
        self._done.append((now, tokens))
        while self._done and now - self._done[0][0] > RATE_WINDOW_S:
            self._done.popleft()
        span = now - self._done[0][0] if len(self._done) > 1 else 0.0
        if span > 0:
            self.stats.tokens_per_s = sum(t for _, t in list(self._done)[1:]) / span
        assert self.loop is not None
        self.stats.loss, self.stats.last_loss = self.loop.loss, self.loop.last_loss
        self._update_step()

    def _update_step(self) -> None:
        self.stats.step = self.outer_steps

    # ------------------------------------------------------------------ what the node shows

    @property
    def outer_steps(self) -> int:
        """Optimizer steps: the slowest stage's for a trainer, else our stage's."""
        if self.loop is not None:
            return self.loop.version
        return self.stage_peer.version if self.stage_peer is not None else 0

    @property
    def committed_fingerprint(self) -> str | None:
        return (
            None if self.stage_peer is None else self.stage_peer.optimizer.averager.last_fingerprint
        )

    def status(self) -> dict[str, Any]:
        """/status's `pipeline` object (`status.run_status`)."""
        return run_status(self)

    @property
    def oversized_refused(self) -> int:
        """(As a strategy:) our stage's state downloads refused for a layout unlike ours."""
        peer = self.stage_peer
        return 0 if peer is None else peer.optimizer.averager.oversized_refused

    def close(self) -> None:
        """(The trainer's synchronous close: nothing to do here.)"""

    def status_oversized_refused(self) -> int:
        """Requests our stage refused, and answers our trainer refused, unread for
        holding more than the stage's bounds."""
        return oversized_refused(self)

    async def aclose(self) -> None:
        if self.loop is not None:
            try:  # replays under way, if the stages still answer
                async with asyncio.timeout(10.0):
                    await self.loop.trainer.settled()
            except TimeoutError:
                log.info("leaving with microbatch replays unfinished")
        if self.stage_peer is not None:
            await self.stage_peer.aclose()
            if self.checkpoints is not None:  # (its last commit, frozen, outlives it)
                try:
                    await self.checkpoints.save(self.stage_peer)
                    self._checkpointed()
                except CheckpointError as e:
                    log.warning("the last stage checkpoint was not written: %s", e)

    def _checkpointed(self) -> None:
        assert self.checkpoints is not None
        self.stats.checkpoint_at = self.checkpoints.at
        self.stats.checkpoint_error = self.checkpoints.error
