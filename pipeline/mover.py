"""Moving a stage peer to the stage that limits the pipeline: the asyncio driver of
`rebalance.Rebalancer`.

Every wake-up (a jittered period, or the re-check of a candidate move) reads
every stage's records and asks the rebalancer. A move:

1. says where we go: a record in the target stage that is not `ready` (it
   counts toward that stage's capacity, so other peers do not follow us
   there; trainers do not route to it) and names the stage we leave (so its
   other peers stay put). It then reads the records again and gives way if
   another peer decided the same at the same moment (`move_contested`);
2. drains the stage we leave: no new request, its record withdrawn (so its
   other peers stay put), the requests taken finish, and we stay for the
   step that takes the gradients we hold (up to `drain_timeout`: after that
   they go, and their trainers replay them elsewhere);
3. closes it, downloads the target stage's state, verified against the
   fingerprint its holders announce (`StageOptimizer.sync`), and announces
   the new stage ready.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Awaitable, Callable, Collection

from shoal.dht.node import DHTNode
from shoal.dht.records import owner_marker

from .directory import StageRecord, read_stages
from .rebalance import RebalancePolicy, Rebalancer, move_contested
from .server import RECORD_TTL, stage_key
from .stage_peer import StagePeer

__all__ = ["StageMover"]

log = logging.getLogger("shoal.pipeline")


class StageMover:
    """Keeps `peer` on the stage where it helps most, by `policy`.

    `make_peer(stage)` builds (does not start) a `StagePeer` for another stage;
    `on_moved(old, new)` runs once the new one serves (or, after a move that failed
    once the old stage was left, once a new peer of that stage serves)."""

    def __init__(
        self,
        dht: DHTNode,
        experiment: str,
        stages: int,
        peer: StagePeer,
        make_peer: Callable[[int], Awaitable[StagePeer]],
        *,
        policy: RebalancePolicy | None = None,
        on_moved: Callable[[StagePeer, StagePeer], None] | None = None,
        sync_timeout: float = 120.0,
        drain_timeout: float | None = None,
        rng: random.Random | None = None,
        fits: Callable[[list[list[StageRecord]]], Collection[int]] | None = None,
    ) -> None:
        """`fits(records)`: the stages we may move into (those that fit our memory;
        None: any)."""
        self.dht = dht
        self.experiment = experiment
        self.stages = stages
        self.peer = peer
        self.make_peer = make_peer
        self.policy = policy or RebalancePolicy()
        self.on_moved = on_moved
        self.sync_timeout = sync_timeout
        # Staying for our gradients' step is worth a part of a period, not more.
        self.drain_timeout = self.policy.period_s / 3 if drain_timeout is None else drain_timeout
        self.rebalancer = Rebalancer(self.policy, time.monotonic(), rng)
        self.moves: list[tuple[int, int, float]] = []  # (from, to, UNIX time)
        self.failed_moves = 0  # moves that failed (we then served our stage again)
        self.moves_given_way = 0  # moves that met another's and did not go ahead
        self.moving = False
        self.fits = fits

    def _mine(self) -> StageRecord:
        server = self.peer.server
        return StageRecord(
            self.dht.peer_id,
            server.forward_speed.value,
            server.backward_speed.value,
            server.queued,
            self.peer.version,
            time.time(),
        )

    def _alive_here(self, records: list[list[StageRecord]]) -> list[list[StageRecord]]:
        """The records, with those of our stage's peers we do not hear from left out: a
        peer killed a moment ago still has its record, and counting it, we could
        leave a stage it no longer serves with no peer at all."""
        live = self.peer.live_partners()
        me, k = self.dht.peer_id, self.peer.stage
        here = [r for r in records[k] if r.peer == me or r.peer in live]
        return [here if s == k else rs for s, rs in enumerate(records)]

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            delay = max(0.0, self.rebalancer.wake_at - time.monotonic())
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await stop.wait()
            if stop.is_set():
                return
            try:
                records = await read_stages(self.dht, self.experiment, self.stages)
            except Exception as e:  # the next wake-up reads again
                log.debug("reading the stage records failed: %r", e)
                self.rebalancer.wake_at = time.monotonic() + self.policy.period_s
                continue
            allowed = None if self.fits is None else self.fits(records)
            records = self._alive_here(records)
            decision = self.rebalancer.wake(
                time.monotonic(), records, self._mine(), self.peer.stage, allowed
            )
            if decision.target is None:
                continue
            if await self.move(decision.target, records[decision.target]):
                self.rebalancer.moved(time.monotonic())
            else:
                self.rebalancer.gave_way(time.monotonic())

    async def move(self, target: int, target_records: list[StageRecord]) -> bool:
        """Move our peer to stage `target`; False if we gave way to another move, or
        the move failed (counted in `failed_moves`; we then serve our stage again)."""
        old = self.peer
        self.moving = True
        try:
            try:
                await self._say_arriving(target, target_records)
                if await self._contested(target):
                    self.moves_given_way += 1
                    log.info("not moving to stage %d: another peer moves at once", target)
                    await self._withdraw_arrival(target)
                    return False
                log.info("moving from stage %d to stage %d (it limits the pipeline)",
                         old.stage, target)  # fmt: skip
                await old.server.drain()
                await self._drain(old)
            except Exception as e:  # (our stage is still ours: take requests again)
                self.failed_moves += 1
                log.warning("moving to stage %d failed (%r): staying on stage %d",
                            target, e, old.stage)  # fmt: skip
                old.server.undrain()
                await old.server.announce()
                await self._withdraw_arrival(target)
                return False
            # Closed before the next stage's peer exists: the two would share the host's
            # all-reduce and pipeline protocols, which closing the old one unregisters.
            await old.aclose()
            new = await self._serve(target)
            if new is None:  # (the stage we left has its state on its other peers)
                self.failed_moves += 1
                await self._withdraw_arrival(target)
                new = await self._serve(old.stage)
                if new is None:
                    raise RuntimeError(f"serving stage {target} or {old.stage} again failed")
            self.peer = new
            if self.on_moved is not None:
                self.on_moved(old, new)
            if new.stage != target:
                return False
            self.moves.append((old.stage, target, time.time()))
            log.info("now serving stage %d (version %d)", target, new.version)
            return True
        finally:
            self.moving = False

    async def _serve(self, stage: int) -> StagePeer | None:
        """A started peer of `stage`, or None (logged) when making or starting it failed.

        The download is verified against the fingerprint the stage's holders
        announce; one that fails leaves us behind the stage, and the peer's own loop
        re-syncs before it serves (as for any peer that missed a step)."""
        peer = None
        try:
            peer = await self.make_peer(stage)
            await peer.start(sync=True)
            return peer
        except Exception as e:
            log.warning("serving stage %d failed: %r", stage, e)
            if peer is not None:
                with contextlib.suppress(Exception):
                    await peer.aclose()
            return None

    async def _contested(self, target: int) -> bool:
        """Whether, read after our announcement, another move meets ours (a read that
        fails counts as one: the next look decides on settled records)."""
        try:
            records = await read_stages(self.dht, self.experiment, self.stages)
        except Exception as e:
            log.debug("reading the stage records failed: %r", e)
            return True
        return move_contested(records, self.dht.peer_id, self.peer.stage, target)

    async def _drain(self, old: StagePeer) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.drain_timeout):
                await old.server.wait_drained()
                while old.held_samples > 0:
                    await old.server.wait_version_after(old.version)

    async def _say_arriving(self, target: int, records: list[StageRecord]) -> None:
        now = time.time()
        version = max((r.version for r in records), default=0)
        value = {"version": version, "since": now, "ready": False, "t": now,
                 "from": self.peer.stage}  # fmt: skip
        await self.dht.store(stage_key(self.experiment, target), value, now + RECORD_TTL,
                             subkey=owner_marker(self.dht.peer_id))  # fmt: skip

    async def _withdraw_arrival(self, target: int) -> None:
        with contextlib.suppress(Exception):  # else it expires (RECORD_TTL)
            await self.dht.store(stage_key(self.experiment, target), None,
                                 time.time() + RECORD_TTL,
                                 subkey=owner_marker(self.dht.peer_id))  # fmt: skip
