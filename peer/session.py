"""One peer's part in one experiment: manifest, task, model, strategy, trainer.

`open_session` turns the configuration into a running setup:

- hosting (``--host-experiment NAME``, or the default run): the manifest is
  created once and kept in the data directory, so that a restart hosts the
  *same* experiment (same ID, same checkpoints) rather than a new one;
- joining (``--join NAME[@PEERID]``): the manifest comes from the DHT,
  verified; the current state comes from the peers that hold it.

Either way a checkpoint of this experiment in the data directory is resumed,
and then the swarm's newer state, if there is one, replaces it.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shoal.averaging.fingerprint import state_fingerprint
from shoal.averaging.options import SPARSE_CODEC_NAMES, OuterOptions, VerifyingOptions
from shoal.averaging.outer import OuterStrategy, VerifyingStrategy
from shoal.averaging.registry import can_verify, is_pipeline, schema_of
from shoal.averaging.strategies import make_strategy
from shoal.dht.node import DHTNode
from shoal.dht.records import owner_marker
from shoal.pipeline.boundary import boundary_task
from shoal.pipeline.options import PipelineOptions
from shoal.pipeline.stage_build import builds_stages_alone, stage_fingerprints
from shoal.transport.identity import Identity
from shoal.verification.audit import AuditPolicy

from .codec_default import with_default_codec
from .config import Config
from .experiment import (
    Manifest,
    ManifestError,
    ManifestNotFound,
    find_manifest,
    parse_experiment_ref,
    publish_manifest,
    stages_fingerprint,
)
from .export import ExportError, load_initial_weights
from .joined import joined_path, load_joined, save_joined
from .pipelined.budget import NoStageFits
from .pipelined.checkpoints import StageCheckpoints
from .pipelined.run import PipelineRun, StageMismatch
from .trainer import (
    DEFAULT_HYPERPARAMETERS,
    VERIFIED_INNER_STATE,
    Trainer,
    check_hyperparameters,
)
from .training.checkpoint import CheckpointError, CheckpointStore
from .training.device import DeviceInventory, check_precision, describe, mfu, peak_flops
from .training.optimizers import describe_inner_optimizer, is_default_inner_optimizer
from .training.task import Task, TaskError, load_task, shard_of, trains_on_private_data
from .training.task_code import check_consent, check_digest, is_builtin_spec, task_digest
from .verify.ban_watch import BanWatcher
from .verify.segments import SegmentRunner
from .verify.verifier import Verifier
from .verify.work_log import VerifiedWork, WorkLog

__all__ = [
    "Session",
    "SessionError",
    "find_experiment",
    "make_outer_strategy",
    "open_session",
    "start_strategy",
    "work_log_for",
]

log = logging.getLogger("shoal.session")

MANIFESTS_DIR = "experiments"
JOINED_DIR = "joined"  # (under MANIFESTS_DIR) the manifests of experiments joined
# How long a joiner looks for the manifest in the DHT (it may have been published a
# moment ago; one already there is found at the first lookup).
FIND_MANIFEST_TIMEOUT = 15.0
# The audit threshold of experiments in bf16 or fp16 (fp32's is the option's default).
REDUCED_PRECISION_THRESHOLD = 2e-2
_PIN_HINT = (
    ", or pin one dataset that every peer must hold to verify it "
    "(bytegpt: --task-option data_digest=HEX, the digest of your text, logged above)"
)


class SessionError(Exception):
    """The experiment cannot be set up as configured; the message is one line for the user."""


@dataclass
class Session:
    manifest: Manifest
    task: Task
    trainer: Trainer
    strategy: OuterStrategy
    hosting: bool
    resumed: bool
    loaded_from_swarm: bool
    device: torch.device
    inventory: DeviceInventory
    precision: str
    bans: BanWatcher
    verifier: Verifier | None = None  # a verified experiment's audits
    # A pipelined experiment's run; it then also stands as `trainer` and `strategy`.
    pipeline: PipelineRun | None = None

    def device_status(self, tokens_per_s: float | None) -> tuple[dict[str, Any], float | None]:
        """/status's `device` object and `mfu` (None when the device's peak is unknown)."""
        info = describe(self.device, self.inventory)
        flops_of = getattr(self.task, "flops_per_token", None)
        flops = flops_of() if callable(flops_of) else None
        return info.as_json(), mfu(flops, tokens_per_s, peak_flops(info, self.precision))

    @property
    def averaging_key(self) -> str:
        return averaging_key(self.manifest)

    @property
    def peers_key(self) -> str:
        return peers_key(self.manifest)


def averaging_key(manifest: Manifest) -> str:
    return f"{manifest.namespace}/params"


def peers_key(manifest: Manifest) -> str:
    return f"{manifest.namespace}/peers"


def report_subkey(identity_peer: Any) -> str:
    return owner_marker(identity_peer)


async def open_session(
    config: Config,
    identity: Identity,
    dht: DHTNode,
    *,
    device: torch.device | None = None,
    inventory: DeviceInventory | None = None,
    experiment: tuple[Manifest, Task, torch.nn.Module | None, bool] | None = None,
) -> Session:
    """Set up this peer's experiment, training on `device` (the CPU by default).
    `experiment`: what `find_experiment` returned already (a library peer's)."""
    device = device or torch.device("cpu")
    inventory = inventory or DeviceInventory()
    if experiment is None:
        experiment = await find_experiment(config, identity, dht)
    manifest, task, model, hosting = experiment
    if is_pipeline(manifest.strategy):
        return await _pipeline_session(config, identity, dht, manifest, task, device, inventory)
    assert model is not None

    initial = state_fingerprint([p.detach() for p in model.parameters()], {})
    try:
        hyper = check_hyperparameters(manifest.hyperparameters)
        check_precision(hyper["precision"], device, inventory)
    except ValueError as e:  # DeviceError included
        raise SessionError(f"{manifest.describe()} cannot run here: {e}") from None
    log.info("inner optimizer %s", describe_inner_optimizer(hyper["inner_optimizer"]))
    # On the device before the strategy takes the parameters (it keeps its global
    # copy on the host, where the wire and the fingerprints are).
    model = await asyncio.to_thread(model.to, device)
    strategy = make_outer_strategy(manifest, dht, list(model.parameters()))
    store = CheckpointStore(config.checkpoints_dir / manifest.experiment_id)
    # (In a thread: the first optimizer imports torch's compiler stack, seconds that
    # would hold the status endpoint, which already answers.)
    trainer = await asyncio.to_thread(
        _trainer, config, identity, manifest, task, model, strategy, hyper, store, device
    )
    bans = BanWatcher(dht, manifest.namespace)
    verifier = None
    if trainer.work is not None:
        verifier = await _verifier(
            dht, identity, task, hyper, strategy, trainer.work, trainer, bans
        )
    resumed = await _resume(store, trainer, manifest)
    # A joiner (or a restarted host) takes the swarm's state when the swarm has one;
    # a host starting its experiment starts from its own initial parameters.
    join = not (hosting and not resumed)
    loaded = await start_strategy(
        strategy, model, manifest, join=join, initial=None if resumed else initial
    )
    return Session(
        manifest,
        task,
        trainer,
        strategy,
        hosting,
        resumed,
        loaded,
        device,
        inventory,
        hyper["precision"],
        bans,
        verifier,
    )


async def find_experiment(
    config: Config, identity: Identity, dht: DHTNode
) -> tuple[Manifest, Task, torch.nn.Module | None, bool]:
    """The experiment `config` hosts or joins, announced: its manifest, its task, its
    model at the initial weights (None for a pipelined one: stages are built apart),
    and whether this peer hosts it. The daemon's and the library's one way in."""
    role = config.experiment_role()
    assert role is not None
    kind, name = role
    if kind == "host":
        manifest, task, model = await _host_manifest(config, identity, name)
    else:
        manifest = await _find(config, dht, name)
        task = await _joined_task(config, manifest)
        model = None
        if is_pipeline(manifest.strategy) and config.init_from is not None:
            # (Said, not ignored: the user would believe the stages start from them.)
            raise SessionError(
                f"--init-from: {manifest.describe()} is pipelined: its stages start from "
                "the host's seed or the swarm's state, never from weights given to a joiner"
            )
        if not is_pipeline(manifest.strategy):  # (a pipeline never builds the whole model)
            model = await asyncio.to_thread(task.make_model, manifest.seed)
            await _init_from(config, model)
    hosting = await _announce(dht, identity, manifest)
    return manifest, task, model, hosting


async def start_strategy(
    strategy: OuterStrategy,
    model: torch.nn.Module,
    manifest: Manifest,
    *,
    join: bool,
    initial: str | None,
) -> bool:
    """Start `strategy` over `model`'s parameters; whether it loaded the swarm's state.
    `join`: take the swarm's state when a peer serves it. `initial`: the fingerprint the
    parameters had when built (None: they were resumed from a checkpoint); unlike the
    manifest's, only the swarm's state may replace them, else SessionError."""
    differs = initial is not None and initial != manifest.initial_fingerprint
    if differs:
        assert initial is not None
        log.warning(
            "this machine builds a different initial model than the host (fingerprint %s, "
            "manifest %s: another torch version?); waiting for the swarm's state",
            initial[:12],
            manifest.initial_fingerprint[:12],
        )
    loaded = await strategy.start(join=join)
    if loaded and strategy.outer_steps == 0:
        await _check_round_zero(strategy, model, manifest)
    if loaded:
        log.info(
            "loaded the swarm's current state (%s)", (strategy.committed_fingerprint or "")[:12]
        )
    elif differs:
        await strategy.aclose()
        raise SessionError(
            f"cannot start {manifest.describe()}: this peer builds a different initial model "
            "than the host and no peer serves the current state yet; use the same shoal and "
            "torch versions as the host, or retry once the swarm has averaged a round"
        )
    return loaded


async def _check_round_zero(
    strategy: OuterStrategy, model: torch.nn.Module, manifest: Manifest
) -> None:
    """A state served before the swarm's first commit claims to be the experiment's
    initial model (no certificate covers it): it must hash to the initial fingerprint
    the host signed in the manifest, else a peer could hand joiners any weights (with
    --init-from, the host's loaded ones are what joiners download here)."""
    served = await asyncio.to_thread(
        state_fingerprint, [p.detach() for p in model.parameters()], {}
    )
    if served != manifest.initial_fingerprint:
        await strategy.aclose()
        raise SessionError(
            f"cannot start {manifest.describe()}: the state a peer served before the first "
            f"round is not the experiment's initial model (fingerprint {served[:12]}, the "
            f"manifest's {manifest.initial_fingerprint[:12]}); retry later"
        )


async def _resume(store: CheckpointStore, trainer: Trainer, manifest: Manifest) -> bool:
    """Load the experiment's latest checkpoint into `trainer`; whether there was one."""
    try:
        await asyncio.to_thread(store.prepare)
        state = await asyncio.to_thread(store.load)
    except CheckpointError as e:
        raise SessionError(str(e)) from None
    if state is None:
        return False
    if state.get("experiment_id") != manifest.experiment_id:
        raise SessionError(
            f"the checkpoint in {store.directory} belongs to another experiment; "
            "move it away or use another --data-dir"
        )
    try:
        trainer.load_state_dict(state)
    except Exception as e:
        raise SessionError(
            f"corrupt checkpoint in {store.directory} ({type(e).__name__}: {e}); move it "
            "away to start this experiment afresh (or use another --data-dir)"
        ) from None
    log.info("resumed from checkpoint %s at step %d", store.latest, trainer.stats.step)
    return True


def make_outer_strategy(
    manifest: Manifest, dht: DHTNode, params: list[torch.Tensor]
) -> OuterStrategy:
    """The manifest's outer strategy over `params`; SessionError when its options do not fit."""
    try:
        return make_strategy(
            manifest.strategy, dht, averaging_key(manifest), params, manifest.strategy_options
        )
    except ValueError as e:
        raise SessionError(f"{manifest.describe()} cannot run here: {e}") from None


async def _announce(dht: DHTNode, identity: Identity, manifest: Manifest) -> bool:
    """Log what we take part in and publish its manifest; whether we host it."""
    hosting = manifest.host == identity.peer_id
    log.info("%s %s", "hosting" if hosting else "joined", manifest.describe())
    try:
        await publish_manifest(dht, manifest)
    except Exception as e:  # the DHT may be just us for now; the refresh task retries
        log.warning("publishing the manifest failed (will retry): %r", e)
    return hosting


async def _pipeline_session(
    config: Config,
    identity: Identity,
    dht: DHTNode,
    manifest: Manifest,
    task: Task,
    device: torch.device,
    inventory: DeviceInventory,
) -> Session:
    """A pipelined experiment: this peer serves a stage and/or drives microbatches."""
    hosting = manifest.host == identity.peer_id
    if not _splits_into_stages(task):
        raise SessionError(f"task {manifest.task} cannot be split into pipeline stages")
    stages = manifest.strategy_options.get("stages")
    if not manifest.stage_fingerprints:
        raise SessionError(
            f"{manifest.describe()} was created by an older shoal (manifest format "
            f"{manifest.format}): its stages were initialized as one model, which this shoal "
            "never builds (a peer builds only its own stage); host a new experiment name"
        )
    if len(manifest.stage_fingerprints) != stages:
        raise SessionError(
            f"{manifest.describe()} has {len(manifest.stage_fingerprints)} stage "
            f"fingerprints for {stages!r} stages: a malformed manifest"
        )
    try:
        hyper = check_hyperparameters(manifest.hyperparameters)
        check_precision(hyper["precision"], device, inventory)
        if not is_default_inner_optimizer(hyper["inner_optimizer"]):
            raise ValueError("a pipeline's stage optimizer is AdamW; the manifest names another")
        run = PipelineRun(
            dht,
            identity,
            manifest,
            task,
            hyper,
            role=config.role,
            stage=config.stage,
            device=device,
            checkpoints=StageCheckpoints(
                config.checkpoints_dir / manifest.experiment_id,
                manifest.experiment_id,
                int(manifest.strategy_options["stages"]),
                config.checkpoint_interval,
            ),
            max_memory=config.max_memory,
            copies_dir=config.data_dir / "state-copies" / manifest.experiment_id,
        )
    except ValueError as e:
        raise SessionError(f"{manifest.describe()} cannot run here: {e}") from None
    try:
        await run.start()
    except NoStageFits as e:  # (one line: what does not fit, and what it needs)
        await run.aclose()
        raise SessionError(f"{manifest.describe()} cannot run here: {e}") from None
    except StageMismatch as e:
        raise SessionError(f"cannot start {manifest.describe()}: {e}") from None
    except CheckpointError as e:
        raise SessionError(str(e)) from None
    return Session(
        manifest,
        task,
        run,  # type: ignore[arg-type]
        run,  # type: ignore[arg-type]
        hosting,
        False,
        run.stage_peer is not None and run.stage_peer.syncs > 0,
        device,
        inventory,
        hyper["precision"],
        BanWatcher(dht, manifest.namespace),
        None,
        run,
    )


def work_log_for(config: Config, experiment_id: str, policy: AuditPolicy) -> WorkLog:
    """A verifying trainer's work log: its states past the RAM budget go to disk (a 50M
    model's state is 600 MB), at most `--work-log-max` of them in all."""
    return WorkLog(
        policy.segment_steps,
        spill_dir=config.data_dir / "work-log" / experiment_id,
        retain_bytes=config.work_log_max,
    )


def _trainer(
    config: Config,
    identity: Identity,
    manifest: Manifest,
    task: Task,
    model: torch.nn.Module,
    strategy: OuterStrategy,
    hyper: dict[str, Any],
    store: CheckpointStore,
    device: torch.device,
) -> Trainer:
    """The trainer (logging its work for audits when the experiment verifies)."""
    shard = shard_of(identity.peer_id.to_bytes(), hyper["num_shards"])
    work = None
    if strategy.options.verify:
        work = VerifiedWork(
            work_log_for(config, manifest.experiment_id, audit_policy(strategy.options)),
            manifest.namespace,
            identity.peer_id,
            shard,
            lambda: strategy.outer_steps,
            lambda: strategy.resets,
        )
    return Trainer(
        task,
        model,
        strategy,
        hyper,
        shard=shard,
        seed=int.from_bytes(identity.peer_id.to_bytes()[-8:], "big") ^ manifest.seed,
        checkpoints=store,
        checkpoint_interval=config.checkpoint_interval,
        checkpoint_extra=lambda: {"experiment_id": manifest.experiment_id},
        device=device,
        precision=hyper["precision"],
        work=work,
    )


def audit_policy(options: OuterOptions) -> AuditPolicy:
    """The manifest's audit settings (a verifying strategy's options) as a policy."""
    if not isinstance(options, VerifyingOptions):
        raise SessionError(f"strategy {options.name} has no audit settings")
    return AuditPolicy(
        rate=options.audit_rate,
        probation_rate=options.audit_probation_rate,
        segment_steps=options.audit_segment_steps,
        threshold_angle=options.audit_threshold_angle,
    )


async def _verifier(
    dht: DHTNode,
    identity: Identity,
    task: Task,
    hyper: dict[str, Any],
    strategy: OuterStrategy,
    work: VerifiedWork,
    trainer: Trainer,
    bans: BanWatcher,
) -> Verifier:
    """The verifier of a verified experiment, attached to the strategy's rounds."""
    if not isinstance(strategy, VerifyingStrategy):
        raise SessionError(f"strategy {strategy.name} verifies but offers no rounds to audit")
    # (Audits re-run steps on a model of their own: built in a thread, as it takes
    # seconds at real sizes, while the status endpoint already answers.)
    runner = await asyncio.to_thread(SegmentRunner, task, hyper, precision=hyper["precision"])
    verifier = Verifier(
        dht,
        identity,
        task=task,
        hyper=hyper,
        policy=audit_policy(strategy.options),
        work=work,
        model=trainer.model,
        inner=trainer.inner,
        bans=bans,
        shape=strategy.audit_shape(),
        precision=hyper["precision"],
        shun=strategy.shun,
        runner=runner,
    )
    strategy.attach_attestor(verifier)
    return verifier


async def _find(config: Config, dht: DHTNode, text: str) -> Manifest:
    """The manifest `--join <text>` names: from the network, else the one kept when this
    peer joined it before (`joined`)."""
    try:
        ref = parse_experiment_ref(text)
        kept = joined_path(config.data_dir / MANIFESTS_DIR / JOINED_DIR, ref)
        try:
            manifest = await find_manifest(dht, ref, timeout=FIND_MANIFEST_TIMEOUT)
        except ManifestNotFound as e:
            manifest = load_joined(kept, ref)
            if manifest is None:
                raise
            log.warning("%s; going on with the manifest kept when this peer joined it "
                        "(%s)", e, manifest.describe())  # fmt: skip
            return manifest
    except ManifestError as e:
        raise SessionError(str(e)) from None
    save_joined(kept, manifest)
    return manifest


async def _joined_task(config: Config, manifest: Manifest) -> Task:
    """The task of an experiment joined: custom task code only when this peer named it
    and its copy has the pinned digest (both checked before anything is imported)."""
    try:
        check_consent(manifest.task, config.named_tasks)
        await asyncio.to_thread(check_digest, manifest.task, manifest.task_digest)
    except TaskError as e:
        raise SessionError(str(e)) from None
    task = await _load_task(manifest.task, manifest.task_config, config.data)
    _check_verifiable(manifest, task, config.data)
    return task


def _check_verifiable(manifest: Manifest, task: Task, data: Path | None) -> None:
    """Refuse a verified experiment on data only each peer has (hosted by an older shoal,
    or by a host that lies): its referees would convict this peer's honest work."""
    verified = manifest.strategy_options.get("verify") and not is_pipeline(manifest.strategy)
    if verified and trains_on_private_data(task, data):
        raise SessionError(
            f"{manifest.describe()} verifies work on each peer's own --data, which its "
            "referees cannot re-execute: honest peers would be accused; ask its host to "
            "host it unverified (a current shoal does) or with data pinned by digest"
        )


async def _load_task(spec: str, task_config: dict[str, Any], data: Path | None) -> Task:
    try:
        return await asyncio.to_thread(load_task, spec, task_config, data=data)
    except TaskError as e:
        raise SessionError(str(e)) from None


async def _host_manifest(
    config: Config, identity: Identity, name: str
) -> tuple[Manifest, Task, Any]:
    """This peer's manifest of experiment `name`: the saved one, or a new one."""
    path = config.data_dir / MANIFESTS_DIR / f"{name}.manifest"
    if path.exists():
        try:
            manifest = Manifest.from_bytes(path.read_bytes())
        except (OSError, ManifestError) as e:
            raise SessionError(
                f"cannot read the saved manifest {path} ({e}); move it away to create "
                f"experiment {name!r} afresh"
            ) from None
        if manifest.host != identity.peer_id:
            raise SessionError(f"{path} was created by another identity; move it away")
        _warn_ignored(config, manifest)
        task = await _hosted_task(config, manifest)
        if is_pipeline(manifest.strategy):
            return manifest, task, None
        model = await asyncio.to_thread(task.make_model, manifest.seed)
        loaded = await _init_from(config, model)
        if loaded is not None and loaded != manifest.initial_fingerprint:
            raise SessionError(
                f"--init-from: experiment {name!r} in {config.data_dir} started from other "
                "weights; host a new experiment name to start from these"
            )
        return manifest, task, model
    try:  # hashed before it is imported: the digest is of the code that runs
        digest = "" if is_builtin_spec(config.task) else task_digest(config.task)
    except TaskError as e:
        raise SessionError(str(e)) from None
    task = await _load_task(config.task, _task_options(config), config.data)
    strategy, options, hyperparameters = _new_settings(config, task, name)
    seed = secrets.randbits(31)
    model = None
    stages: list[str] = []
    if config.pipeline_stages and config.init_from is not None:
        raise SessionError("--init-from: a pipelined experiment starts from its seed's stages")
    if config.pipeline_stages:
        try:
            # One stage at a time (built, hashed, freed): a host holds the whole model
            # no more than any other peer does. (With the adapters the codec inserts.)
            built, count = boundary_task(task, options["codec"]), config.pipeline_stages
            stages = await asyncio.to_thread(stage_fingerprints, built, seed, count)
            fingerprint = stages_fingerprint(stages)
        except ValueError as e:  # e.g. more stages than the model has layers
            raise SessionError(
                f"--pipeline-stages {config.pipeline_stages}: {e} (a larger model: "
                "--task-option n_layers=N)"
            ) from None
    else:
        model = await asyncio.to_thread(task.make_model, seed)
        # The initial fingerprint is then of the loaded weights: joiners start from them
        # (the same --init-from) or from the swarm's state, as after any round.
        await _init_from(config, model)
        fingerprint = state_fingerprint([p.detach() for p in model.parameters()], {})
    try:
        manifest = Manifest.create(
            identity,
            name=name,
            task=config.task,
            task_config=task.config(),
            strategy=strategy,
            strategy_options=options,
            hyperparameters=hyperparameters,
            seed=seed,
            initial_fingerprint=fingerprint,
            created=time.time(),
            task_digest=digest,
            stage_fingerprints=stages,
        )
    except ManifestError as e:
        raise SessionError(str(e)) from None
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(manifest.to_bytes())
        tmp.replace(path)
    except OSError as e:
        raise SessionError(
            f"cannot save the manifest in {path.parent}: {e.strerror or e}"
        ) from None
    log.info("created %s", manifest.describe())
    return manifest, task, model


def _task_options(config: Config) -> dict[str, Any]:
    """A new experiment's task options; an `hf` experiment --init-from an `hf` export
    takes the export's model config and tokenizer unless the options name their own
    (the weights mean nothing with another tokenizer's ids)."""
    options = dict(config.task_option)
    folder = config.init_from
    if config.task != "hf" or folder is None:
        return options
    if (
        not {"family", "config", "config_file"} & set(options)
        and (folder / "config.json").is_file()
    ):
        options["config_file"] = str(folder / "config.json")
    if "tokenizer" not in options and (folder / "tokenizer.json").is_file():
        options["tokenizer"] = str(folder / "tokenizer.json")
    return options


async def _init_from(config: Config, model: torch.nn.Module) -> str | None:
    """Replace `model`'s fresh weights by those of --init-from, if given; their
    fingerprint (None without --init-from)."""
    if config.init_from is None:
        return None
    try:
        await asyncio.to_thread(load_initial_weights, model, config.init_from)
    except ExportError as e:
        raise SessionError(f"--init-from: {e}") from None
    fingerprint = await asyncio.to_thread(
        state_fingerprint, [p.detach() for p in model.parameters()], {}
    )
    log.info("initial weights loaded from %s (fingerprint %s)", config.init_from, fingerprint[:12])
    return fingerprint


async def _hosted_task(config: Config, manifest: Manifest) -> Task:
    """The task of this peer's saved experiment: its code must still be what it pinned."""
    try:
        if manifest.task_digest or is_builtin_spec(manifest.task):
            await asyncio.to_thread(check_digest, manifest.task, manifest.task_digest)
        else:
            log.warning(
                "experiment %r pins no digest of its task's code (created by an older shoal): "
                "joiners of a current shoal refuse it; host a new name to pin it",
                manifest.name,
            )
    except TaskError as e:
        raise SessionError(f"{e} (or host a new experiment name)") from None
    task = await _load_task(manifest.task, manifest.task_config, config.data)
    _check_verifiable(manifest, task, config.data)
    return task


def _new_settings(
    config: Config, task: Task, name: str = ""
) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """A new experiment's strategy, its options and the hyperparameters, from the flags."""
    # --strategy-option carries the inner optimizer's hyperparameters too (inner_lr=...).
    given = dict(config.strategy_option)
    hyper_given = {k: given.pop(k) for k in list(given) if k in DEFAULT_HYPERPARAMETERS}
    if config.precision != "fp32":
        # Only a non-default precision is written: a manifest without one reads as fp32.
        hyper_given["precision"] = config.precision
    if config.inner_optimizer is not None:
        hyper_given["inner_optimizer"] = config.inner_optimizer
    strategy = PipelineOptions.name if config.pipeline_stages else config.strategy
    try:
        if config.pipeline_stages:
            if not _splits_into_stages(task):
                raise SessionError(f"task {config.task} cannot be split into pipeline stages")
            batch_size = int(task.config().get("batch_size", 1))
            # Stage audits are calibrated for float32 (--verify on insists).
            given.setdefault("verify", config.verify == "on" or (
                config.verify == "auto" and config.precision == "fp32"))  # fmt: skip
            parsed = PipelineOptions.parse({"stages": config.pipeline_stages, **given})
            options = parsed.for_batch_size(batch_size).to_dict()
        else:
            private = trains_on_private_data(task, config.data)
            # H only when given: each strategy has its default for a new experiment
            # (50, DEFAULT_INNER_STEPS; a sparse codec's, SPARSE_INNER_STEPS).
            given_h = "inner_steps" in config.sources
            options = {**({"inner_steps": config.inner_steps} if given_h else {}), **given}
            options = verification_options(config, options, private_data=private, name=name)
            options = with_default_codec(config.strategy, options, task, name)
            schema = schema_of(config.strategy, outer=True)
            options = schema.parse(schema.for_new_experiment(options)).to_dict()
        # A new experiment writes every hyperparameter out, at today's defaults (a
        # manifest without a key means that key's legacy value). The defaults were
        # tuned for the inner optimizer of the outer strategies; the pipeline's stage
        # optimizer keeps the legacy lr and warmup, untuned (it has no lr schedule).
        base = {} if config.pipeline_stages else DEFAULT_HYPERPARAMETERS
        if not config.pipeline_stages and options.get("verify"):
            base = {**base, "inner_state": VERIFIED_INNER_STATE}
        hyperparameters = check_hyperparameters({**base, **hyper_given})
        if config.pipeline_stages and hyperparameters["lr_schedule"] != "constant":
            raise ValueError(
                "a pipeline's stage optimizer has no lr_schedule (warmup, then constant)"
            )
        if hyperparameters["precision"] == "fp32":
            del hyperparameters["precision"]
        # Nor is a carried inner state: peers of a shoal before the choice join it.
        if hyperparameters["inner_state"] == "carry":
            del hyperparameters["inner_state"]
        # Plain AdamW is not written either: peers of a shoal before the choice join it.
        if is_default_inner_optimizer(hyperparameters["inner_optimizer"]):
            del hyperparameters["inner_optimizer"]
        elif config.pipeline_stages:
            raise SessionError(
                "--inner-optimizer: a pipeline's stage optimizer is AdamW (the choice is for "
                "the outer strategies)"
            )
    except ValueError as e:
        raise SessionError(f"--strategy-option: {e}") from None
    return strategy, options, hyperparameters


def _splits_into_stages(task: Task) -> bool:
    return builds_stages_alone(task) or callable(getattr(task, "make_stages", None))


def verification_options(
    config: Config, options: dict[str, Any], *, private_data: bool = False, name: str = ""
) -> dict[str, Any]:
    """A new experiment's strategy options with its verification policy: `--verify`
    (auto: on for the strategies that can verify), and in bf16 or fp16 the wider
    audit threshold that precision needs, unless the options set them.

    `private_data`: the peers train on data of their own (`trains_on_private_data`),
    which a referee cannot regenerate to re-execute a prover's segment: such an
    experiment is unverified, said in one line, and asking for verification is refused.
    """
    out = dict(options)
    if private_data:
        if config.verify == "on" or out.get("verify"):
            flag = "--verify on" if config.verify == "on" else "--strategy-option verify"
            raise SessionError(
                f"{flag}: experiment {name!r} trains on each peer's own --data, which a "
                "referee cannot re-execute (it lacks the prover's data): honest peers would "
                f"be accused; host it with --verify auto (unverified){_PIN_HINT}"
            )
        if config.verify == "auto" and can_verify(config.strategy):
            log.warning(
                "experiment %r trains on each peer's own --data: hosted UNVERIFIED (a referee "
                "cannot re-execute work on data only its prover has; peers trust each other's "
                "updates)%s",
                name,
                _PIN_HINT,
            )
        out["verify"] = False
    sparse = out.get("codec") in SPARSE_CODEC_NAMES
    if "verify" not in out and config.verify == "auto" and sparse:
        # An audit reveals three model sizes, against a hundredth of one in a sparse round:
        # at the default audit rate, many times the rounds' own traffic. Auto is off for
        # them; --verify on audits them anyway.
        log.warning("experiment %r uses codec %s: hosted UNVERIFIED (an audit reveals three "
                    "model sizes, many times a sparse round's bytes; --verify on audits "
                    "anyway)", name, out["codec"])  # fmt: skip
        out["verify"] = False
    if "verify" not in out:
        out["verify"] = config.verify == "on" or (
            config.verify == "auto" and can_verify(config.strategy)
        )
    if out["verify"] and config.precision != "fp32":
        out.setdefault("audit_threshold_angle", REDUCED_PRECISION_THRESHOLD)
    return out


def _warn_ignored(config: Config, manifest: Manifest) -> None:
    given = [
        o
        for o in (
            "task",
            "task_option",
            "strategy",
            "inner_steps",
            "strategy_option",
            "precision",
            "verify",
            "pipeline_stages",
        )
        if o in config.sources and not _as_saved(config, manifest, o)
    ]
    if given:
        log.warning(
            "experiment %r already exists in %s (created %s): it keeps its own settings; "
            "ignoring %s (host a new name to change them)",
            manifest.name,
            config.data_dir,
            time.strftime("%Y-%m-%d %H:%M", time.localtime(manifest.created)),
            ", ".join("--" + o.replace("_", "-") for o in given),
        )


def _as_saved(config: Config, manifest: Manifest, option: str) -> bool:
    """Whether `option`'s value is what the saved manifest has already (nothing is
    ignored: a script that hosts with the same arguments at every start is not warned)."""
    if option == "task":
        return config.task == manifest.task
    if option == "strategy":
        return config.strategy == manifest.strategy
    if option == "inner_steps":
        return bool(manifest.strategy_options.get("inner_steps") == config.inner_steps)
    if option == "task_option":
        return all(manifest.task_config.get(k) == v for k, v in config.task_option)
    if option == "strategy_option":
        saved = {**manifest.hyperparameters, **manifest.strategy_options}
        return all(saved.get(k) == v for k, v in config.strategy_option)
    if option == "verify":
        verified = bool(manifest.strategy_options.get("verify"))
        return config.verify != "auto" and verified == (config.verify == "on")
    return False
