"""One peer's service of one stage: serve requests, step with the stage's peers, re-sync.

`StagePeer` is the thin asyncio driver over the stage's parts: the worker
(`stage`), the RPC server and its DHT record (`server`), the stage's optimizer
step over the fault-tolerant all-reduce (`stage_optimizer`) and the progress
reports (`progress`). Its loop, every `POLL_S` (`NEAR_POLL_S` when the stage's peers together hold
half the global batch) or as soon as a backward landed here:

- reports how many samples this peer holds gradients for, at which version:
  in the DHT (for peers that join the stage) and pushed straight to the
  stage's other peers (so they know at once when the batch is complete);
- when another peer of the stage reports a newer version, this peer missed a
  step: it stops serving, downloads the stage's state, and serves again;
- when the fresh reports at our version add up to the global batch, it takes
  the step together with the stage's other peers; also with less, when a trainer
  that waits for this step asks (`flush`: what is missing died with a peer).

It declares itself to the stage's matchmaking between steps, so that the
leader of a step waits for it (a peer a moment late joins the step rather than
being left out of it and re-syncing). A step's group must hold a majority of
the peers at its version (those that reported it lately, and those that took
the step to it with us, whose new report is still on its way), so the stage
never splits into two groups that each step alone; for the same reason a peer
steps by itself only when no other peer is at its version, not when its
matchmaking merely finds nobody else (after a failed try that left the others
out, each of two peers would step alone: two states at one version, until one
re-synced). A peer pushes its new version to the stage's peers as soon as it
stepped: through the DHT alone they would see it behind for a second or more.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from shoal.averaging.averager import StepResult
from shoal.averaging.matchmaking import MatchmakingConfig
from shoal.dht.node import DHTNode
from shoal.transport import rpc
from shoal.transport.errors import ConnectionLost, DialError, ProtocolNotSupported
from shoal.transport.identity import PeerID
from shoal.transport.tasks import TaskSet

from .bounds import StageBounds
from .memory import DEFAULT_LIMITS, StageLimits
from .progress import STALE_S, Report, StageProgress, peers_at, samples_at
from .server import StageServer
from .stage import StageWorker
from .stage_optimizer import StageOptimizer

__all__ = ["StagePeer"]

log = logging.getLogger("shoal.pipeline")

POLL_S = 1.0  # the stage's reports are read this often...
NEAR_POLL_S = 0.1  # ...and this often once its peers hold most of the global batch
NEAR = 0.5
DHT_READ_S = 1.0  # the stage's reports in the DHT are read this often (peers also push)
REPORT_EVERY_S = 3.0  # an unchanged report is renewed this often (STALE_S is 10 s)
UNREAD_PUSHERS = 64  # pushes kept from peers whose DHT report we have not read (yet)
PUSH_TRIES = 4  # a progress push that timed out is sent again, this many times in all
PUSH_RETRY_S = 0.25


class StagePeer:
    """Serves stage `stage` of `experiment` with `module` (the stage's layers)."""

    def __init__(
        self,
        dht: DHTNode,
        experiment: str,
        stage: int,
        module: torch.nn.Module,
        *,
        hyper: Mapping[str, Any],
        global_batch: int,
        device: torch.device | None = None,
        matchmaking_time: float = 3.0,
        step_timeout: float = 30.0,
        sync_timeout: float = 120.0,
        bounds: StageBounds | None = None,
        copies_dir: Path | None = None,
        limits: StageLimits = DEFAULT_LIMITS,
    ) -> None:
        """`bounds`: what a request of the stage may hold (`bounds.probe_bounds`);
        `copies_dir`: where the stage's state is copied for a download that a step
        overlaps (None: in memory; `state_sync.StateServer`); `limits`: the samples
        a pass takes, the answers kept, whether backwards wait while a step
        averages and whether AdamW's moments live in a file of `copies_dir`, within a
        memory budget (`memory.fit_stage`)."""
        self.stage = stage
        self.limits = limits
        self.worker = StageWorker(module, device=device, pass_samples=limits.pass_samples,
                                  answer_bytes=limits.answer_bytes)  # fmt: skip
        self.server = StageServer(dht, experiment, stage, self.worker, bounds)
        matchmaking = MatchmakingConfig(
            min_group_size=1,
            target_group_size=64,
            matchmaking_time=matchmaking_time,
            # The stage's peers are all declared (they refresh their presence): a
            # leader closes the group as soon as they have joined.
            min_matchmaking_time=0.05,
            give_up_alone_after=1.0,
        )
        self.optimizer = StageOptimizer(
            dht, experiment, stage, self.worker, hyper=hyper, matchmaking=matchmaking,
            copies_dir=copies_dir,
            # (AdamW's moments in a file where the budget asks it: the copies' folder.)
            moments_dir=copies_dir if limits.moments_on_disk else None,
        )  # fmt: skip
        self.progress = StageProgress(dht, experiment, stage, global_batch)
        self.server.steps = self.optimizer.steps
        self.step_timeout = step_timeout
        self.sync_timeout = sync_timeout
        self.steps_failed = 0
        self.syncs = 0
        self._changed = asyncio.Event()
        self.server.on_backward = self._changed.set
        self.server.on_behind = self._changed.set  # look at the reports now: catch up
        self.server.on_flush = self._flush_asked
        self._flush: int | None = None  # the version a trainer asked us to step from
        self._task: asyncio.Task[None] | None = None
        self.on_step: Callable[[StepResult], None] | None = None  # after each committed step
        self._reported: tuple[int, int, float] = (-1, -1, 0.0)  # samples, version, when
        self._near = False  # the stage is close to its next step: poll faster
        self._stored: list[Report] = []  # the stage's reports in the DHT, as last read
        self._read_at = -float("inf")
        self._heard: dict[PeerID, Report] = {}  # reports stage peers pushed to us
        self._pushing: set[PeerID] = set()  # one push at a time to each peer
        self._pushes = TaskSet(log, "progress push")
        self._progress = (0, 0)  # samples, version: what pushes carry
        # Stage peers our push found gone (-> when): their reports until then do not
        # count, so a peer that died does not hold the stage's quorum for STALE_S.
        self._gone: dict[PeerID, float] = {}
        self.server.on_progress = self._heard_from

    @property
    def version(self) -> int:
        return self.optimizer.version

    @property
    def ready(self) -> bool:
        """Started and serving (not re-syncing)."""
        return self._task is not None and self.server.serving

    async def start(self, *, sync: bool = True) -> None:
        """Download the stage's state from its peers (`sync`; none when it is the
        first), then announce and serve."""
        if sync:
            await self.optimizer.sync(self.sync_timeout)
        self.server.set_version(self.version)
        await self.optimizer.averager.announce_presence()
        await self.server.start()
        self._task = asyncio.get_running_loop().create_task(self._run())

    @property
    def held_samples(self) -> int:
        """Samples we hold gradients for that no step took yet (this version's and,
        arrived during a step, the next one's)."""
        return self.worker.samples_for(self.version) + self.worker.samples_for(self.version + 1)

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._pushes.aclose()
        await self.server.aclose()
        await self.optimizer.aclose()

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(NEAR_POLL_S if self._near else POLL_S):
                    await self._changed.wait()
            self._changed.clear()
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the DHT or a round failed: the next tick retries
                log.info("stage %d: %r", self.stage, e)
                await asyncio.sleep(NEAR_POLL_S)

    async def tick(self) -> None:
        """One pass of the loop: report, catch up, or step."""
        version = self.version
        samples = self.worker.samples_for(version)
        now = time.time()
        changed = (samples, version) != self._reported[:2]
        renewed = False
        if changed and version == self._reported[1] and now - self._reported[2] < REPORT_EVERY_S:
            self._reported = (samples, version, self._reported[2])  # the partners hear it
        elif changed or now - self._reported[2] > REPORT_EVERY_S:
            await self.progress.report(samples, version)
            self._reported = (samples, version, now)
            renewed = True
        if changed or renewed:  # (renewed straight to them too: the DHT can lag that much)
            self._push(samples, version)
        if changed or now - self._read_at >= DHT_READ_S:
            self._stored = await self.progress.reports()
            self._read_at = now
        fresh = [
            r
            for r in self._merged()
            if now - r.at <= STALE_S and r.at > self._gone.get(r.peer, -float("inf"))
        ]
        # (Not our own report: one published before the stage went back, by a restore,
        # would have us re-sync onto the version we hold, again and again.)
        me = self.server.dht.peer_id
        ahead = [r for r in fresh if r.version > version and r.peer != me]
        if ahead:
            await self.catch_up(ahead)
            return
        await self.optimizer.averager.refresh_presence()
        others = [r for r in fresh if r.peer != self.server.dht.peer_id]
        held = samples_at(others, version, now) + samples
        self._near = held >= NEAR * self.progress.global_batch
        # (Only for the version it was asked for: a flush that came during a slow step
        # would otherwise make the next version step on its first microbatch.)
        flush, self._flush = self._flush == version, None
        if held >= self.progress.global_batch or (flush and held > 0):
            # A step needs a majority of the stage's peers at our version: two groups
            # can then never both commit the same version apart (a split the swarm
            # would have to undo, and the microbatches of the losing side with it).
            # Those who took our last step with us count, even while their report
            # still names the version before. Nor alone while another peer is at our
            # version: matchmaking finds nobody else when it left them out (their try
            # failed) or lost their declaration, and each of two would step alone.
            last = self.optimizer.steps[-1] if self.optimizer.steps else None
            stepped_with = last.members if last is not None and last.version + 1 == version else ()
            await self.step(peers_at(others, version, now, stepped_with=stepped_with))

    def live_partners(self) -> set[PeerID]:
        """The stage's other peers heard from lately: a report within STALE_S, and not
        found gone since (a push to it failed). A dead peer's stage record outlives
        it (RECORD_TTL): this is what tells them apart."""
        now, me = time.time(), self.server.dht.peer_id
        return {
            r.peer
            for r in self._merged()
            if r.peer != me
            and now - r.at <= STALE_S
            and r.at > self._gone.get(r.peer, -float("inf"))
        }

    def _merged(self) -> list[Report]:
        """Each stage peer's newest report: from the DHT, or pushed to us directly (by
        a peer whose DHT report we read: strangers are not stage peers)."""
        newest: dict[PeerID, Report] = {}
        blocked = self.server.dht.host.blocked()  # (convicted: its reports are no one's)
        stored = {r.peer for r in self._stored}
        heard = [r for r in self._heard.values() if r.peer in stored]
        for r in [*self._stored, *heard]:
            if r.peer in blocked:
                continue
            if r.peer not in newest or r.at > newest[r.peer].at:
                newest[r.peer] = r
        return list(newest.values())

    def _heard_from(self, peer: PeerID, samples: int, version: int) -> None:
        """A stage peer pushed its progress (the server's `progress` call). Kept also
        from a peer whose DHT report we have not read yet (it counts once we have):
        dropped, a push of the batch's last samples was lost for good when its peer
        went into the step on it, and the step waited for us until it timed out."""
        stored = {r.peer for r in self._stored}
        strangers = sum(1 for p in self._heard if p not in stored)
        if peer in stored or peer in self._heard or strangers < UNREAD_PUSHERS:
            self._heard[peer] = Report(peer, samples, version, time.time())
            self._changed.set()

    def _push(self, samples: int, version: int) -> None:
        """Tell the stage's other peers our progress at once (the DHT carries it to
        them only when they next read it): they learn without delay that the stage
        holds its global batch, or that we took a step. One push at a time to each
        peer; one in flight sends our latest progress after it."""
        self._progress = (samples, version)
        me = self.server.dht.peer_id
        for r in self._merged():
            # To every peer of the stage not found gone since its last report, however
            # old that report (the DHT keeps it PROGRESS_TTL): a live peer's can be
            # stale in the DHT, and our pushes are what then keeps it counting us.
            gone = r.at <= self._gone.get(r.peer, -float("inf"))
            if r.peer != me and not gone and r.peer not in self._pushing:
                self._pushing.add(r.peer)
                self._pushes.spawn(self._send(r.peer))

    async def _send(self, peer: PeerID) -> None:
        try:
            await self._send_latest(peer)
        finally:  # (here, not in a done callback: a push meanwhile must spawn a send)
            self._pushing.discard(peer)

    async def _send_latest(self, peer: PeerID) -> None:
        sent, failures = None, 0
        while sent != self._progress:
            sent = samples, version = self._progress
            try:
                await rpc.call(self.server.dht.host, peer, self.server.protocol, "progress",
                               {"samples": samples, "version": version}, timeout=2.0)  # fmt: skip
            except (DialError, ConnectionLost, ProtocolNotSupported):
                # Not a slow peer (a timeout says nothing): one that cannot be reached or
                # no longer serves the pipeline. A report of its own brings it back.
                self._gone[peer] = time.time()
                self._changed.set()
                return
            except Exception:
                # Sent again (a loaded peer's answer came late): the DHT report is no
                # fallback for a peer that went into its step on it, since it renews
                # its report only after the step, which waits for the partner that
                # never heard that the batch was complete.
                failures += 1
                if failures >= PUSH_TRIES:
                    return
                sent = None
                await asyncio.sleep(PUSH_RETRY_S * failures)

    def _flush_asked(self, version: int) -> bool:
        if self.optimizer.stepping:
            return False  # (the step it waits for is under way: a slow round)
        self._flush = version
        self._changed.set()
        return True

    async def step(self, partners: Collection[PeerID] = ()) -> None:
        """The step from our version with `partners` (the stage's other peers at it):
        a majority of us and them must be in its group (`tick` says why); alone
        only when there are none."""
        began = time.time()

        def quorum() -> int:
            # Asked again while matchmaking runs: a partner banned or found gone since
            # the step began stops counting at once. A group of 3 out of 4 (a cheater
            # among them) could never form once the cheater was banned, and the step
            # waited out its timeout. Never more: a report going stale during a long
            # step is no news of its peer.
            blocked = self.server.dht.host.blocked()
            live = 1 + sum(
                1 for p in partners if p not in blocked and self._gone.get(p, -float("inf")) < began
            )
            return live // 2 + 1

        # Within a memory budget, backwards wait while the step averages (`memory.
        # StageLimits`): their gradients would need a bucket beside the step's.
        hold = not self.limits.backwards_while_averaging
        if hold:
            self.server.compute.hold_backwards(True)
        try:
            if hold:
                # A backward the compute thread runs now finishes first, into this step's
                # bucket: done after the take, it would start the next step's beside it
                # (B more: the swarm test's stage peers peaked up to 1.1 B over the
                # estimate).
                await self.server.compute.in_thread(lambda: None)
            result = await self.optimizer.step(self.step_timeout, alone=not partners, quorum=quorum)
        finally:
            if hold:
                self.server.compute.hold_backwards(False)
        if result.resynced:
            # The round found the stage ahead and downloaded its state (as `catch_up`
            # does): a fresh peer for the trainers, whose bans of us lift.
            self.syncs += 1
            self.server.since = time.time()
            self.server.restored = None  # (its restart is over: it holds the stage's state)
        if result.committed and self.on_step is not None:
            self.on_step(result)
        if result.committed:
            log.debug(
                "stage %d: step %d with %d peers", self.stage, self.version, result.group_size
            )
        else:
            self.steps_failed += 1
            log.info(
                "stage %d: step from %d did not commit (%s)",
                self.stage,
                self.version - 0,
                result.reason,
            )
        await self._publish()

    async def catch_up(self, ahead: Sequence[Report] = ()) -> None:
        """We missed a step (`ahead`: the reports that say so): stop serving until we
        hold the stage's current state."""
        self.server.serving = False
        try:
            log.info(
                "stage %d: behind the stage's peers at version %d; re-syncing",
                self.stage,
                self.version,
            )
            loaded = await self.optimizer.sync(self.sync_timeout)
        finally:
            self.server.serving = True
        if loaded:
            self.syncs += 1
            self.server.since = time.time()
            self.server.restored = None  # (as in `step`)
        else:
            # No peer gave us the state: those reports were dead peers' (their DHT
            # reports outlive them), or their peers are out of reach for now. We serve
            # on what we hold and believe those reports no more (a peer's next report
            # counts again). A restart we made stays claimed once, under the same
            # `since` (a new one would read as a second restart: replayed twice).
            for r in ahead:
                self._gone[r.peer] = max(self._gone.get(r.peer, -float("inf")), r.at)
        await self._publish()

    async def _publish(self) -> None:
        """Our new version in the stage record and in a fresh progress report, pushed
        to the stage's peers at once (through the DHT it reaches them a second or
        more later, when it is loaded: they would see us behind meanwhile)."""
        self.server.set_version(self.version)
        self.server.push_step()
        samples = self.worker.samples_for(self.version)
        self._push(samples, self.version)
        await self.server.announce()
        await self.progress.report(samples, self.version)
        self._reported = (samples, self.version, time.time())
