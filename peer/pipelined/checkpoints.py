"""A stage peer's checkpoints: its stage saved in the data directory, restored when orphaned.

`<data-dir>/checkpoints/<experiment id>/latest.pt` (`CheckpointStore`: atomic
writes, the previous file kept) holds the stage this peer served last, as
`pipeline.stage_checkpoint` takes it: after a commit, at most every
`--checkpoint-interval` seconds, and once more when the peer leaves cleanly.
The tensors written are the copy the averager froze at the commit (off the
event loop); the write runs in a thread.

A peer that starts holding a checkpoint of a stage nobody serves restores the
stage from it (`PipelineRun.start`) rather than from the manifest's seed, and
says so in its stage record (`restored`), so trainers replay what the stage
lost with its peers (`pipeline.ledger`). Each record also carries the version
of its peer's newest checkpoint (`ckpt`): trainers keep the microbatches of
later steps until a checkpoint holds them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shoal.pipeline.stage_checkpoint import KIND, damaged, problem, restore, snapshot
from shoal.pipeline.stage_peer import StagePeer

from ..training.checkpoint import CheckpointError, CheckpointStore

__all__ = ["StageCheckpoints"]

log = logging.getLogger("shoal.pipeline")


class StageCheckpoints:
    """The checkpoints of the stage this peer serves in `experiment` (of `stages`)."""

    def __init__(self, directory: Path, experiment: str, stages: int, interval: float) -> None:
        self.store = CheckpointStore(directory)
        self.experiment = experiment
        self.stages = stages
        self.interval = interval
        self.saved: tuple[int, int] | None = None  # (stage, version) last written
        self.at: float | None = None  # UNIX time of the last write
        self.error: str | None = None  # why the last periodic write failed (None: it did not)

    async def load(self) -> dict[str, Any] | None:
        """The checkpoint held (None: none). CheckpointError, in one line, for a file
        that is not a stage checkpoint of this experiment and layout: it is not
        ours to overwrite."""
        await asyncio.to_thread(self.store.prepare)
        # (Written without torch's checksums: a damaged file is one whose fingerprint
        # does not match, and the previous one is read instead.)
        state = await asyncio.to_thread(self.store.load, damaged)
        if state is None:
            return None
        if state.get("kind") != KIND or state.get("experiment_id") != self.experiment:
            self._refuse(problem(state, experiment=self.experiment, stages=self.stages,
                                        like=[]))  # fmt: skip
        stage = state.get("stage")
        count = state.get("stages")
        if count != self.stages or not (isinstance(stage, int) and 0 <= stage < self.stages):
            self._refuse(f"of stage {stage} of {count}, not of this "
                         f"experiment's {self.stages} stages")  # fmt: skip
        return state

    def _refuse(self, why: str | None) -> None:
        raise CheckpointError(
            f"the checkpoint in {self.store.directory} is {why or 'not of this stage'}; "
            "move it away or use another --data-dir"
        )

    async def restore(self, peer: StagePeer, state: dict[str, Any]) -> None:
        """Load `state` into `peer` (not started yet); CheckpointError when it does not
        fit the stage (another layout: shapes, dtypes, a damaged file)."""
        like = list(peer.optimizer.averager.state)
        why = await asyncio.to_thread(
            problem, state, experiment=self.experiment, stages=self.stages, like=like
        )
        if why is not None:
            raise CheckpointError(
                f"the checkpoint in {self.store.directory} cannot be loaded into stage "
                f"{peer.stage}: {why}; move it away or use another --data-dir"
            )
        await restore(peer.optimizer, state)
        peer.server.restored = peer.server.checkpointed = peer.version
        self.saved = (peer.stage, peer.version)

    async def save(self, peer: StagePeer) -> bool:
        """Write the stage's last committed state when it is newer than the last
        written; whether one was written. Raises CheckpointError."""
        version = peer.optimizer.averager.last_fingerprint_commits
        if version is None or self.saved == (peer.stage, version) or peer.optimizer.stepping:
            return False  # (mid-step: the step's size is logged once the step returns)
        # Written from the committed state as it is served (the live tensors of a stage,
        # pinned meanwhile: the next commit waits for the write, never copies them).
        async with peer.optimizer.averager.pinned_state():
            state = snapshot(
                peer.optimizer, experiment=self.experiment, stage=peer.stage, stages=self.stages
            )
            if state is None:
                return False
            # (Its fingerprint is its checksum: torch's would read each moment whole.)
            path = await asyncio.to_thread(lambda: self.store.save(state, crc32=False))
        self.saved, self.at = (peer.stage, state["commits"]), time.time()
        peer.server.checkpointed = state["commits"]
        log.debug("stage %d checkpoint written: %s (version %d)", peer.stage, path,
                  state["commits"])  # fmt: skip
        return True

    async def run(
        self,
        stop: asyncio.Event,
        peer_of: Callable[[], StagePeer | None],
        after: Callable[[], None] = lambda: None,
    ) -> None:
        """Save `peer_of()`'s stage every `interval` seconds until `stop` (then `after`).
        A write that fails (a full disk) does not stop the stage: the last good file
        stays."""
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), self.interval)
            except TimeoutError:
                pass
            peer = peer_of()
            if peer is None or stop.is_set():
                continue
            try:
                await self.save(peer)
            except CheckpointError as e:
                if str(e) != self.error:
                    log.warning("stage checkpoint not written, the stage goes on: %s", e)
                self.error = str(e)
            else:
                self.error = None
            after()
