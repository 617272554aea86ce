"""A stage's state as a checkpoint: what a peer saves of its stage, and the checks to load it.

Sans-I/O (the caller writes and reads the file: `peer.pipelined.checkpoints`). A
checkpoint is the stage's state as of its last commit, the copy the averager
froze off the event loop to serve joiners (`Averager._freeze`): parameters,
AdamW moments and step count, bit for bit, with the commit count (the stage's
version), the state version and its certificate chain, the fingerprint, and
the stage's accounting (the samples of each step taken, the last steps'
members, which trainers settle their microbatches with). Taking it costs no
copy: a commit replaces the frozen state rather than writing into it.

A checkpoint is local, but it may be from another experiment, another stage,
another stage layout or a damaged file: `problem` says in one line why it
cannot be loaded into a given stage, before anything is written.
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable
from typing import Any

import torch

from shoal.averaging.fingerprint import state_fingerprint
from shoal.averaging.lineage import declared_work
from shoal.averaging.state_loading import restored_version, write_state
from shoal.transport.identity import PeerID

from .stage_optimizer import STEP_LOG, StageOptimizer, StepRecord

__all__ = ["KIND", "damaged", "problem", "restore", "snapshot", "step_log", "step_sizes"]

KIND = "pipeline-stage"
MAX_STEP_SIZES = 4096  # the newest steps whose sizes a checkpoint keeps (accounting)
MAX_MEMBERS = 1024  # members of one logged step, read back
MAX_KEYS = 16384  # backwards (trainer, key) our part of one logged step held, read back


def snapshot(
    optimizer: StageOptimizer, *, experiment: str, stage: int, stages: int
) -> dict[str, Any] | None:
    """The stage's last committed state as a checkpoint (None: nothing committed or
    restored yet, e.g. a peer that started the stage from the seed and never stepped).
    Its tensors are the served ones: keep the state pinned until they are written
    (`Averager.pinned_state`)."""
    averager = optimizer.averager
    frozen = averager._current_state()
    if frozen is None:
        return None
    commits = int(frozen.metadata.get("commits", frozen.step))
    # The chain of the frozen version: not the one of a commit that came after it.
    certificates = averager.saved_certificates() if averager.commits == commits else None
    sizes = {v: n for v, n in optimizer.step_samples.items() if v < commits}
    return {
        "kind": KIND,
        "experiment_id": experiment,
        "stage": stage,
        "stages": stages,
        "commits": commits,
        "version": frozen.metadata.get("version"),
        "work": frozen.work,
        "certificates": certificates,
        "fingerprint": frozen.fingerprint,
        "metadata": dict(frozen.metadata),  # (what the fingerprint hashes besides tensors)
        "tensors": [t.detach().cpu() for t in frozen.tensors],  # (a device's: copied)
        "step_samples": dict(sorted(sizes.items())[-MAX_STEP_SIZES:]),
        "steps": [
            [r.version, [m.to_bytes().hex() for m in r.members], r.samples, _saved_keys(r)]
            for r in optimizer.steps
            if r.version < commits
        ],
    }


def problem(
    state: dict[str, Any], *, experiment: str, stages: int, like: list[torch.Tensor]
) -> str | None:
    """Why `state` cannot be a checkpoint of a stage of `experiment` laid out like
    `like` (None: it can); the stage it is of is `state["stage"]`."""
    if state.get("kind") != KIND:
        return "not a pipeline stage checkpoint"
    if state.get("experiment_id") != experiment:
        return f"of another experiment ({str(state.get('experiment_id'))[:40]})"
    stage, count = state.get("stage"), state.get("stages")
    if count != stages or not _count(stage) or stage >= stages:
        return f"of stage {stage} of {count}, not of this experiment's {stages} stages"
    if not _count(state.get("commits")):
        return "its version is not a count"
    tensors = state.get("tensors")
    if not isinstance(tensors, list) or len(tensors) != len(like):
        return f"holds {_len(tensors)} tensors, stage {stage} has {len(like)}"
    for i, (t, ours) in enumerate(zip(tensors, like, strict=True)):
        if not isinstance(t, torch.Tensor) or t.shape != ours.shape or t.dtype != ours.dtype:
            got = (tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else type(t).__name__
            return f"tensor {i} is {got}, stage {stage} has {(tuple(ours.shape), ours.dtype)}"
    try:
        restored_version(state["commits"], state.get("version"))
    except ValueError as e:
        return f"its version does not check ({e})"
    work = state.get("work")
    if work is not None and declared_work(work) is None:
        return "its lineage's work is not a count"
    meta = state.get("metadata")
    if (
        not isinstance(meta, dict)
        or meta.get("commits") != state["commits"]
        or meta.get("version") != state.get("version")
    ):
        return "its metadata do not match its version"
    return damaged(state)


def damaged(state: dict[str, Any]) -> str | None:
    """Why a stage checkpoint's tensors and metadata are not what it was written with
    (None: they are): their hash against the fingerprint it holds. A checkpoint's own
    checksum (written without torch's: `CheckpointStore.save(crc32=False)`)."""
    tensors, meta = state.get("tensors"), state.get("metadata")
    if not isinstance(tensors, list) or not all(isinstance(t, torch.Tensor) for t in tensors):
        return "its tensors are not a list of tensors"
    try:
        fingerprint = state_fingerprint(tensors, meta if isinstance(meta, dict) else None)
    except (TypeError, ValueError, OverflowError):
        return "its metadata cannot be hashed"
    if fingerprint != state.get("fingerprint"):
        return "its tensors do not match its fingerprint (a damaged or edited file)"
    return None


async def restore(optimizer: StageOptimizer, state: dict[str, Any]) -> None:
    """Load a checkpoint `problem` passed into the stage (its parameters, moments,
    version and accounting); then serve it as the stage's state."""
    averager = optimizer.averager
    await averager.before_state_change(keep_reads=False)
    await write_state(averager.state, state["tensors"], averager.state_lock)
    averager.restore(state["commits"], state.get("version"), state.get("work"),
                     state.get("certificates"))  # fmt: skip
    version = optimizer.version
    optimizer.step_samples.update(step_sizes(state, version))
    optimizer.steps.extend(step_log(state, version))
    await asyncio.to_thread(optimizer.worker.drop_before, version)
    await optimizer.state_loaded()  # (a stage on a GPU: into its module)
    await averager.publish_state()


def step_sizes(state: dict[str, Any], version: int) -> dict[int, int]:
    """The checkpoint's step sizes (version stepped from -> samples) before `version`."""
    sizes = state.get("step_samples")
    if not isinstance(sizes, dict):
        return {}
    valid = {v: n for v, n in sizes.items() if _count(v) and _count(n) and v < version}
    return dict(sorted(valid.items())[-MAX_STEP_SIZES:])


def step_log(state: dict[str, Any], version: int) -> list[StepRecord]:
    """The checkpoint's last committed steps with their members (malformed ones left out)."""
    items = state.get("steps")
    if not isinstance(items, list):
        return []
    records = [_step_record(item, version) for item in items[-STEP_LOG:]]
    return [r for r in records if r is not None]


def _saved_keys(record: StepRecord) -> list[list[str]] | None:
    """The backwards our part of a step held, as (trainer hex, key) pairs (None: not
    known, or keys that are not a trainer's string ones)."""
    if record.keys is None:
        return None
    pairs = [[k[0].hex(), k[1]] for k in record.keys if _trainer_key(k)]
    return pairs if len(pairs) == len(record.keys) else None


def _trainer_key(key: Hashable) -> bool:
    """A backward's key as a stage keeps it: (the trainer's peer ID bytes, its key)."""
    return (
        isinstance(key, tuple)
        and len(key) == 2
        and isinstance(key[0], bytes)
        and isinstance(key[1], str)
    )


def _step_record(item: Any, version: int) -> StepRecord | None:
    """One logged step read back. Its keys tell trainers what our previous incarnation
    counted: a step saved without them (an older checkpoint) says nothing of keys
    (None), never that it held none."""
    try:
        v, members, samples, *rest = item
        if not isinstance(members, list) or len(members) > MAX_MEMBERS or len(rest) > 1:
            return None
        peers = tuple(PeerID(bytes.fromhex(m)) for m in members)
        keys = _read_keys(rest[0]) if rest else None
    except (TypeError, ValueError):
        return None
    if not _count(v) or v >= version or not (samples is None or _count(samples)):
        return None
    return StepRecord(v, peers, samples, keys)


def _read_keys(pairs: Any) -> frozenset[Hashable] | None:
    if not isinstance(pairs, list) or len(pairs) > MAX_KEYS:
        return None
    keys: set[Hashable] = set()
    for pair in pairs:
        if not (
            isinstance(pair, list) and len(pair) == 2 and all(isinstance(x, str) for x in pair)
        ):
            return None
        if len(pair[1]) > 200:  # (as a request's key)
            return None
        keys.add((bytes.fromhex(pair[0]), pair[1]))
    return frozenset(keys)


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _len(value: Any) -> str:
    return str(len(value)) if isinstance(value, list) else "no list of"
