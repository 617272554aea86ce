"""The training loop: inner steps in a worker thread, outer rounds in the event loop.

Each inner step (next batch, forward, backward, AdamW) runs in one dedicated
worker thread, so RPCs, heartbeats and the status endpoint keep flowing while
torch computes. Between two inner steps, in the event loop, the outer strategy
(`shoal.averaging.outer`) gets control: the parameters change only there or in
the worker thread, never both at once.

Checkpoints are snapshotted in the event loop between steps (a copy of every
tensor, cheap next to a training step) and written by the worker thread, so a
strategy round running in the background cannot tear them.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from shoal.averaging.outer import OuterStrategy, RoundReport

from .config import PRECISIONS
from .training.checkpoint import CheckpointError, CheckpointStore
from .training.device import autocast
from .training.heap import TRIM_INTERVAL_S, release_free_memory
from .training.inner import LR_SCHEDULES, BatchPrefetcher, InnerOptimizer, to_device
from .training.optimizers import DEFAULT_INNER_OPTIMIZER, check_inner_optimizer
from .training.outer_loop import RATE_WINDOW_S, OuterLoop, TrainerStats
from .training.priority import lower_this_thread
from .training.task import Task
from .training.validation import Validation, changes_the_model
from .verify.segments import round_batch_seed
from .verify.work_log import VerifiedWork

__all__ = [
    "DEFAULT_HYPERPARAMETERS",
    "LEGACY_HYPERPARAMETERS",
    "RATE_WINDOW_S",
    "VERIFIED_INNER_STATE",
    "Trainer",
    "TrainerStats",
    "check_hyperparameters",
]

log = logging.getLogger("shoal.trainer")

INNER_STATES = ("carry", "reset", "quantize")

# What a new experiment's manifest gets (session.py writes them all out). Tuned for
# the default experiment (DiLoCo, H = 50, bytegpt at its default size) with
# bench/tune_defaults.py: see docs/guide/strategies.md, "Hyperparameters".
DEFAULT_HYPERPARAMETERS: dict[str, Any] = {
    "inner_lr": 1.6e-2,  # peak lr of the inner optimizer
    "weight_decay": 0.1,
    "warmup_steps": 400,
    # The lr after warmup (peer/training/inner.py, `learning_rate_scale`): "constant", "cosine",
    # "wsd" (warmup-stable-decay) or "inverse_sqrt"; the decaying ones reach
    # lr_floor x inner_lr at inner step `total_steps` (the experiment's planned inner
    # steps per peer) and stay there for as long as the swarm goes on.
    "lr_schedule": "cosine",
    "total_steps": 2000,
    "lr_floor": 0.1,
    "grad_clip": 1.0,
    "adam_beta2": 0.95,
    "num_shards": 64,  # data shards; each peer reads the one its peer ID picks
    # The arithmetic of the inner steps (autocast dtype): every peer of an experiment
    # uses the same, so that recomputed work (verification) matches.
    "precision": "fp32",
    # The inner optimizer, a `torch.optim` class of an allowlist with bounded arguments
    # (peer/training/optimizers.py); written to a manifest only when not plain AdamW.
    "inner_optimizer": DEFAULT_INNER_OPTIMIZER,
    # What the inner optimizer's state (Adam's moments) does at each new global state:
    # "carry" it on, "reset" it (each round's work then starts from a state every
    # peer can rebuild: an audit re-runs it instead of reading three model sizes;
    # docs/architecture/verification.md), or "quantize" it: carry it on rounded to
    # 8-bit codes (peer/training/state_codes.py), which a reveal carries in half a
    # model size. Written to a manifest only when not "carry".
    "inner_state": "carry",
}

# What a new verified experiment gets unless told otherwise: an audit's reveal carries
# quantized moments in half a model size where carried ones take two, and they cost no
# loss measured (docs/guide/strategies.md, "The inner optimizer's state across rounds").
VERIFIED_INNER_STATE = "quantize"

# What a manifest without a key means: the value it had when such manifests were
# written, so that an experiment created before a default changed trains on as it
# did (its peers must agree). The other keys' defaults never changed.
LEGACY_HYPERPARAMETERS: dict[str, Any] = {
    **DEFAULT_HYPERPARAMETERS,
    "inner_lr": 1e-3,
    "warmup_steps": 50,
    "lr_schedule": "constant",
}


# The hyperparameters that name one of a few choices.
_CHOICES: dict[str, tuple[str, ...]] = {
    "precision": PRECISIONS,
    "inner_state": INNER_STATES,
    "lr_schedule": LR_SCHEDULES,
}


def check_hyperparameters(hyper: dict[str, Any]) -> dict[str, Any]:
    """`hyper` with the missing keys filled in (`LEGACY_HYPERPARAMETERS`: what a manifest
    without them meant; a new experiment passes `DEFAULT_HYPERPARAMETERS` under its
    own); ValueError naming an unknown or bad value."""
    out = dict(LEGACY_HYPERPARAMETERS)
    out["inner_optimizer"] = dict(DEFAULT_INNER_OPTIMIZER)  # (a copy: callers may change it)
    for key, value in hyper.items():
        if key not in DEFAULT_HYPERPARAMETERS:
            raise ValueError(
                f"unknown hyperparameter {key!r}; known: {', '.join(DEFAULT_HYPERPARAMETERS)}"
            )
        default = DEFAULT_HYPERPARAMETERS[key]
        if key == "inner_optimizer":
            out[key] = check_inner_optimizer(value)
            continue
        choices = _CHOICES.get(key)
        if choices is not None:
            if value not in choices:
                raise ValueError(f"{key} must be one of {', '.join(choices)}, got {value!r}")
            out[key] = value
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
            raise ValueError(f"hyperparameter {key} must be a number, got {value!r}")
        if isinstance(default, int) and not isinstance(value, int):
            raise ValueError(f"hyperparameter {key} must be a whole number, got {value!r}")
        if value < 0 or (key in ("num_shards", "total_steps") and value < 1):
            raise ValueError(f"hyperparameter {key} must be positive, got {value!r}")
        if key == "lr_floor" and value > 1:
            raise ValueError(f"lr_floor is a fraction of inner_lr (0 to 1), got {value!r}")
        out[key] = value
    if out["lr_schedule"] in ("cosine", "wsd") and out["total_steps"] <= out["warmup_steps"]:
        raise ValueError(
            f"total_steps ({out['total_steps']}) must exceed warmup_steps "
            f"({out['warmup_steps']}) for the {out['lr_schedule']} schedule to decay"
        )
    return out


class Trainer:
    def __init__(
        self,
        task: Task,
        model: torch.nn.Module,
        strategy: OuterStrategy,
        hyperparameters: dict[str, Any],
        *,
        shard: int,
        seed: int,
        checkpoints: CheckpointStore | None = None,
        checkpoint_interval: float = 300.0,
        checkpoint_extra: Callable[[], dict[str, Any]] | None = None,
        on_round: Callable[[RoundReport], None] | None = None,
        device: torch.device | None = None,
        precision: str = "fp32",
        work: VerifiedWork | None = None,
        validation: Validation | None = None,
    ) -> None:
        """`work`: train verifiably (verified experiments): each round's batches are
        drawn from (experiment, peer, round) and the run is logged for audits.
        `validation`: how the model is scored after rounds (default: the task's
        8 held-out batches, bounded in time; `Validation(task, batches=0)`: never)."""
        self.task = task
        self.model = model
        self.strategy = strategy
        self.hyper = check_hyperparameters(hyperparameters)
        self.shard = shard
        self.seed = seed
        self.checkpoints = checkpoints
        self.checkpoint_interval = checkpoint_interval
        self._checkpoint_extra = checkpoint_extra or dict
        self.stats = TrainerStats()
        # The outer part (accounting, the strategy's turn): the library's too.
        self.outer = OuterLoop(strategy, self.stats, on_round)
        self.validation = validation or Validation(task)
        # The model is already on `device` (the session put it there before the
        # strategy took its parameters).
        self.device = device or torch.device("cpu")
        self.precision = precision
        self.inner = InnerOptimizer(model, self.hyper, device=self.device, precision=precision)
        self.optimizer = self.inner.optimizer
        # One thread for every touch of the model outside the event loop: inner
        # steps and checkpoint writes never overlap. It runs below the loop's
        # priority (priority.py): rounds and heartbeats first.
        self._worker = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="shoal-train", initializer=lower_this_thread
        )
        self._batches: BatchPrefetcher | None = None
        self._begun = False  # (`begin` ran: the batches and the chores' clocks are set)
        self._next_checkpoint = self._next_trim = 0.0
        self.work = work

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """A snapshot (tensors copied), safe to write while training goes on."""
        return self._snapshot(self._loop_state())

    def _loop_state(self) -> dict[str, Any]:
        """What the event loop changes (the strategy's rounds, the counters, the
        history): read there."""
        return {
            "strategy": self.strategy.state_dict(),
            "step": self.stats.step,
            "tokens": self.stats.tokens,
            "loss": self.stats.loss,
            "val_loss": self.stats.val_loss,
            # The page's loss curve goes on after a restart instead of starting over.
            "history": list(self.stats.history),
            **self._checkpoint_extra(),
        }

    def _snapshot(self, loop_state: dict[str, Any]) -> dict[str, Any]:
        """The model's and the inner optimizer's state beside `loop_state`, all copied:
        most of a checkpoint's bytes (three times the parameters' with Adam), so the
        trainer copies them in its worker thread, between two inner steps."""
        return _clone(
            {
                "model": self.model.state_dict(),
                "inner_optimizer": self.optimizer.state_dict(),
                "grad_scaler": self.inner.scaler.state_dict(),
                **loop_state,
            }
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        # Tensors are loaded onto this peer's device, whichever device wrote them.
        self.inner.load_state_dict(
            {"optimizer": state["inner_optimizer"], "grad_scaler": state.get("grad_scaler")}
        )
        self.strategy.load_state_dict(state["strategy"])
        self.stats.step = int(state["step"])
        self.stats.tokens = int(state["tokens"])
        loss = state.get("loss")
        self.stats.loss = float(loss) if isinstance(loss, int | float) else None
        val_loss = state.get("val_loss")
        self.stats.val_loss = float(val_loss) if isinstance(val_loss, int | float) else None
        history = state.get("history")
        if isinstance(history, list):
            self.stats.history.clear()
            self.stats.history.extend(h for h in history if isinstance(h, dict))

    async def save_checkpoint(self) -> None:
        if self.checkpoints is None:
            return
        loop = asyncio.get_running_loop()
        # (A copy of a 50M-parameter model and its optimizer takes a second: on the
        # event loop it would hold every heartbeat and /status that long.)
        snapshot = await loop.run_in_executor(self._worker, self._snapshot, self._loop_state())
        path = await loop.run_in_executor(self._worker, self.checkpoints.save, snapshot)
        self.stats.checkpoint_at = time.time()
        log.info("checkpoint written: %s (step %d)", path, self.stats.step)

    async def _periodic_checkpoint(self) -> None:
        """A checkpoint during training. One that cannot be written (a full disk, a
        directory gone read-only) does not stop training: the last good checkpoint
        stays (saves are atomic), one WARNING says why, and the next interval tries
        again; the error is in /status until a save succeeds."""
        try:
            await self.save_checkpoint()
        except CheckpointError as e:
            if str(e) != self.stats.checkpoint_error:  # one line per new problem, not per try
                log.warning("checkpoint not written, training goes on: %s", e)
            self.stats.checkpoint_error = str(e)
            return
        if self.stats.checkpoint_error is not None:
            log.info("checkpoints are written again")
            self.stats.checkpoint_error = None

    # ------------------------------------------------------------------ loop

    async def run(self, stop: asyncio.Event) -> None:
        """Train until `stop` is set; then end the strategy's round, write a checkpoint."""
        await self.begin()
        try:
            while not stop.is_set():
                await self.step(stop)
        finally:
            await self.end(checkpoint=stop.is_set())

    async def begin(self) -> None:
        """Ready the batches (a verified round's own stream) and the chores' clocks."""
        loop = asyncio.get_running_loop()
        if self.work is not None:
            await loop.run_in_executor(self._worker, self._begin_work)
        elif self._batches is None:
            num_shards = self.hyper["num_shards"]
            self._batches = BatchPrefetcher(
                self.task.batches(self.shard, num_shards, self.seed), self.device
            )
        self._next_checkpoint = time.monotonic() + self.checkpoint_interval
        self._next_trim = time.monotonic() + TRIM_INTERVAL_S
        self._begun = True

    async def step(self, stop: asyncio.Event | None = None) -> list[RoundReport]:
        """One inner step (in the worker thread), then the outer part: the strategy's turn
        (`stop`, set, ends a round in flight), the validation after a change of the model,
        a verified round's next batch stream, a checkpoint or a memory trim when due. The
        reports of the rounds that ended."""
        if not self._begun:
            await self.begin()
        loop = asyncio.get_running_loop()
        loss, tokens = await loop.run_in_executor(self._worker, self._inner_step)
        reports = await self.outer.after_step(loss, tokens, stop)
        if changes_the_model(reports):
            if self.work is None and self.hyper["inner_state"] != "carry":
                await loop.run_in_executor(self._worker, self._new_inner_state)
            await self.validate()
        if self._new_work_round():
            await loop.run_in_executor(self._worker, self._begin_work)
        if time.monotonic() >= self._next_checkpoint:
            await self._periodic_checkpoint()
            self._next_checkpoint = time.monotonic() + self.checkpoint_interval
        if time.monotonic() >= self._next_trim:  # (after a checkpoint's snapshot is freed)
            await loop.run_in_executor(self._worker, release_free_memory)
            self._next_trim = time.monotonic() + TRIM_INTERVAL_S
        return reports

    async def end(self, *, checkpoint: bool = True) -> None:
        """Graceful: the round in flight ends (commit or abort), then, with `checkpoint`,
        the state is saved (a failure to end the round is said; the checkpoint is still
        written)."""
        await self.outer.finish()
        if checkpoint:
            await self.save_checkpoint()

    @property
    def on_round(self) -> Callable[[RoundReport], None] | None:
        """Told of every round that ended (the node's ledger and metrics)."""
        return self.outer.on_round

    @on_round.setter
    def on_round(self, callback: Callable[[RoundReport], None] | None) -> None:
        self.outer.on_round = callback

    def close(self) -> None:
        self.outer.close()
        self._worker.shutdown(wait=True, cancel_futures=True)
        if self._batches is not None:
            self._batches.close()

    def _inner_step(self) -> tuple[float, int]:
        assert self._batches is not None
        batch = next(self._batches)
        loss = self.inner.step(lambda: self.task.loss(self.model, batch), self.stats.step)
        tokens = int(self.task.batch_tokens(batch))
        if self.work is not None:
            self.work.log.after_step(self.model, self.inner, tokens)
        return loss, tokens

    def _new_work_round(self) -> bool:
        """Whether the strategy moved to another state version (a commit or re-sync),
        or set the parameters back to the global state they started from (a re-sync
        that loaded a state of the same version: the work so far is gone, the round's
        work is run again from its start)."""
        return self.work is not None and self.work.current() is None

    def _begin_work(self) -> None:
        """A verified round's work starts: its own batch stream, a log from here."""
        assert self.work is not None
        round_index = self.work.round_of()
        if self._batches is not None:
            self._batches.close(wait=False)
        seed = round_batch_seed(self.work.experiment, self.work.peer, round_index)
        batches = self.task.batches(self.shard, self.hyper["num_shards"], seed)
        self._batches = BatchPrefetcher(batches, self.device)
        resets = self.work.resets_of()
        self._new_inner_state()
        self.work.log.begin(round_index, self.stats.step, self.model, self.inner, resets=resets)

    def _new_inner_state(self) -> None:
        """What `inner_state` does to the inner optimizer at a new global state."""
        if self.hyper["inner_state"] == "reset":
            self.inner.reset()
        elif self.hyper["inner_state"] == "quantize":
            self.inner.quantize_state()

    async def validate(self, *, force: bool = False) -> float | None:
        """Score the model on the held-out batches in the worker thread (between two inner
        steps: the parameters stay as the round left them) when the schedule allows it, or
        always with `force`; sets `stats.val_loss`. The loss, None when skipped or failed."""
        schedule = self.validation.schedule
        assert schedule is not None
        started = time.monotonic()
        if not self.validation.enabled or not (force or schedule.due(started)):
            return None
        loop = asyncio.get_running_loop()
        try:
            loss = await loop.run_in_executor(
                self._worker, lambda: self.evaluate(self.validation.held_out())
            )
        except Exception as e:  # a task's bug must not stop training; said, retried later
            log.warning("validation loss failed: %r", e)
            return None
        finally:
            schedule.ran(started, time.monotonic())
        self.stats.val_loss, self.stats.val_loss_at = loss, time.time()
        log.info("validation loss %.4f (%d held-out batches)", loss, self.validation.batches)
        return loss

    def evaluate(self, batches: list[Any]) -> float:
        """Mean loss over `batches` (blocking: run it in the worker thread)."""
        training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad(), autocast(self.device, self.precision):
                losses = [
                    float(self.task.loss(self.model, to_device(b, self.device))) for b in batches
                ]
        finally:
            self.model.train(training)
        return sum(losses) / max(1, len(losses))


def _clone(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        # Checkpoints hold host tensors: written on any device, loadable on any other.
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clone(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_clone(v) for v in obj)
    return obj
