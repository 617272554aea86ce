"""Driving microbatches through the stages: route, retry on another peer, keep the inputs.

A trainer sends each microbatch forward through stage 0 .. n-1, computes the
loss of the last stage's outputs locally, and sends the output gradient back
through stage n-1 .. 0. Each request goes to a peer the stage's `StageBalancer`
picks and is retried on another when it fails (`stage_calls`). A microbatch
remembers how far it got (`Microbatch`): after a failure it resumes there, so a
backward already applied is never sent again to another peer.

Each backward carries an idempotency key (`<trainer>/<microbatch>/<stage>`); a
peer applies a key once. A backward attempt that fails without an answer is
fenced at its peer before it goes to another (`fencing`): when the peer had
applied it, its answer is taken from there and nobody else applies it. The
`MicrobatchLedger` keeps each applied backward's tensors until a stage peer's
step log says whether the step it was for included the peer that applied it;
when it did not, the backward is replayed on a peer of the stage: every
microbatch counts exactly once, whoever dies. A backward whose peer could not
be asked whether it applied it is in doubt there (`ledger.Doubt`): it went on
dry elsewhere, and the trainer asks that peer again every `DOUBT_RETRY_S` until
its answer, its step log or the stage's steps settle it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from shoal.dht.node import DHTNode, DHTValue
from shoal.dht.records import owner_of
from shoal.transport import rpc
from shoal.transport.errors import RemoteError, TransportError
from shoal.transport.identity import PeerID
from shoal.transport.tasks import TaskSet
from shoal.verification.stage_audit import StageAuditPolicy

from .auditor import TrainerAuditor
from .balancer import StageBalancer
from .ledger import Applied, Doubt, MicrobatchLedger
from .options import parse_codec
from .server import pipeline_protocol, stage_key
from .stage_calls import StageCalls, StageFailed, TrainerCounters
from .step_push import trainer_protocol
from .wire import codec_of

__all__ = ["Microbatch", "PipelineTrainer", "StageFailed", "TrainerCounters"]

log = logging.getLogger("shoal.pipeline")

DOUBT_RETRY_S = 2.0  # a peer a backward is in doubt at is asked again this often
STEP_KEYS = 512  # the most keys a logged step may list (as `server.LOGGED_KEYS`)
REPLAY_MARK = "~"  # a replay's key: the microbatch's, this and a count (`_replay`)


@dataclass
class Microbatch:
    """One microbatch on its way through the stages, resumable after a failure."""

    id: int
    inputs: torch.Tensor
    loss_of: Callable[[torch.Tensor], torch.Tensor]
    stage_inputs: list[torch.Tensor] = field(default_factory=list)  # as far as it got
    grad: torch.Tensor | None = None  # the gradient to send to the next stage back
    backward_from: int | None = None  # the stage whose backward is next
    forward_peers: dict[int, PeerID] = field(default_factory=dict)  # who served each forward
    loss: float | None = None
    batch: Any = None  # what the data gave (inputs and targets), for the caller

    @property
    def samples(self) -> int:
        return int(self.inputs.shape[0])


class PipelineTrainer:
    def __init__(
        self,
        dht: DHTNode,
        experiment: str,
        stages: int,
        *,
        deadline: float = 30.0,
        attempts: int = 5,
        codec: str = "int8",
        audit: StageAuditPolicy | None = None,
    ) -> None:
        """`codec`: how activations and gradients travel (`wire`; "none" for exact;
        an experiment's WIRE+lowrankR sends WIRE: its adapters are in the stages).
        `audit`: audit the stage peers' answers under this policy (None: no audits)."""
        self.dht = dht
        self.experiment = experiment
        self.protocol = pipeline_protocol(experiment)
        self.balancers = [StageBalancer() for _ in range(stages)]
        self.codec = codec_of(parse_codec(codec).wire)  # (the adapters are the stages')
        self.calls = StageCalls(
            dht, self.protocol, self.codec, self.balancers,
            deadline=deadline, attempts=attempts, refresh=self.refresh,
        )  # fmt: skip
        self.counters = self.calls.counters
        self.ledger = MicrobatchLedger(stages)
        self.versions = self.calls.versions  # the newest version seen per stage
        # Samples each stage's steps took (version stepped from -> samples), as step logs tell.
        self.step_sizes: list[dict[int, int]] = [{} for _ in range(stages)]
        self.stage_peers: list[list[PeerID]] = [[] for _ in range(stages)]
        # Stage checkpoints: the version every checkpointing peer of a stage saved
        # (None: its peers do not checkpoint) and the restores we replayed for.
        self.durable: list[int | None] = [None] * stages
        # Each stage's last restore the trainer learned of: (version, (peer, since)).
        self._last_restore: list[tuple[int, tuple[PeerID, float]] | None] = [None] * stages
        self._restores: set[tuple[PeerID, float]] = set()  # (peer, since)
        self._restarted: list[tuple[float, int] | None] = [None] * stages  # (since, version)
        self.served_by = self.calls.served_by  # requests answered, per peer
        # A nonce per trainer run: keys of a restarted trainer never meet old answers.
        self._name = f"{str(dht.peer_id)[-8:]}.{secrets.token_hex(4)}"
        self._announced: dict[PeerID, float] = {}
        self.local = self.calls.local  # stages this process serves: called directly
        self._replays = TaskSet(log, "replay")
        self._replay_seq = itertools.count(1)  # (replays' keys: `_replay`)
        self._doubts = TaskSet(log, "doubt")
        # Stage peers push their steps to us (`StageServer.push_step`); `changed` wakes
        # whoever waits for one.
        self._changed = asyncio.Event()
        self._service = rpc.RpcService(dht.host, trainer_protocol(experiment))
        self._service.unary("stepped")(self._stepped)
        self.auditor: TrainerAuditor | None = None
        if audit is not None:
            self.auditor = TrainerAuditor(dht, experiment, self.protocol, self.codec,
                                          policy=audit, candidates=self._candidates)  # fmt: skip
            self.auditor.bans.on_ban = self._exclude
            self.auditor.on_distrust = self._exclude
            self.calls.auditor = self.auditor

    @property
    def changed(self) -> asyncio.Event:
        """Set when a stage peer tells us of a step (a fresh event after each)."""
        return self._changed

    async def _stepped(self, ctx: rpc.CallContext, payload: Any) -> bool:
        """A stage peer stepped: its new version and step log, as in an answer's header.
        Only from peers the stage records list (a stranger could otherwise make us
        believe in versions that send every honest peer re-syncing)."""
        stage = payload.get("stage") if isinstance(payload, dict) else None
        version = payload.get("version") if isinstance(payload, dict) else None
        if not (
            isinstance(stage, int) and not isinstance(stage, bool) and 0 <= stage < self.stages
        ):
            return False
        if ctx.peer not in self.stage_peers[stage]:
            return False
        if isinstance(version, int) and not isinstance(version, bool) and version >= 0:
            self.versions[stage] = max(self.versions[stage], version)
            self.calls.told[ctx.peer] = max(self.calls.told.get(ctx.peer, version), version)
        self._settle(stage, payload, ctx.peer)
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()
        return True

    def close(self) -> None:
        """Stop hearing of steps (the trainer is done)."""
        self._service.close()
        self._doubts.cancel()

    @property
    def stages(self) -> int:
        return len(self.balancers)

    def _candidates(self, stage: int) -> list[PeerID]:
        # Not our own stage peer: a referee is asked over the wire, and we do not dial
        # ourselves (each try failed, and said so in the log, several times a second).
        return [p for p in self.stage_peers[stage] if p != self.dht.peer_id]

    def _exclude(self, peer: PeerID) -> None:
        """A convicted (or caught) stage peer: no request goes to it from now on."""
        for balancer in self.balancers:
            balancer.exclude(peer)
        for peers in self.stage_peers:
            if peer in peers:
                peers.remove(peer)

    def _tainted(self, mb: Microbatch) -> int | None:
        """The first stage whose forward of `mb` a peer since banned computed."""
        if self.auditor is None:
            return None
        bad = self.auditor.bans.bans.banned | self.auditor.distrusted
        stages = [s for s, p in mb.forward_peers.items() if p in bad]
        return min(stages) if stages else None

    async def refresh(self) -> list[int]:
        """Read every stage's records (and the convictions) from the DHT; the number of
        peers per stage."""
        if self.auditor is not None:
            await self.auditor.bans.refresh()
        found = await self.dht.get_many(
            [stage_key(self.experiment, s) for s in range(self.stages)], latest=True
        )
        bad: set[PeerID] = set()
        if self.auditor is not None:
            bad = self.auditor.bans.bans.banned | self.auditor.distrusted
        return [
            self._read_stage(s, found.get(stage_key(self.experiment, s)), bad)
            for s in range(self.stages)
        ]

    def _read_stage(self, s: int, value: DHTValue | None, bad: set[PeerID]) -> int:
        """Stage `s`'s callable peers and version from its records; how many peers.

        The stage's version is the newest among peers we may still call: a dead
        peer's record (until its TTL) must not keep the stage at a version only it
        reached, which its survivors could never serve (they would refuse as behind
        forever). Its microbatches of that step are replayed (the ledger). A peer
        whose last request failed stays out when its ban runs out: only an answer
        or a newer record of its own says that it is back. A peer that refused a
        request (behind, re-syncing) answered: it counts. A convicted peer counts
        for nothing: it is called no more, and a version of its own (say it stepped
        alone, cut off by the bans) must not send the stage's honest peers refusing
        every request as behind."""
        balancer = self.balancers[s]
        views = balancer.snapshot()
        peers = []
        live_versions: list[int] = []
        for subkey, (record, _) in ((value.subkeys or {}) if value else {}).items():
            peer = owner_of(subkey)
            if peer is None or not isinstance(record, dict) or peer in bad:
                continue  # (None: a peer that stopped serving)
            if record.get("ready", True) is False:
                continue  # arriving or re-syncing: it would refuse
            speed, version, since = record.get("fwd"), record.get("version"), record.get("since")
            peers.append((peer, speed if isinstance(speed, int | float) else None))
            if isinstance(since, int | float):
                if since > self._announced.get(peer, since):
                    balancer.reannounced(peer)  # it restarted or re-synced: back
                    self.calls.told.pop(peer, None)  # (what it told was another life's)
                self._announced[peer] = since
            # A peer banned for a refusal (behind, re-syncing) still counts: it is alive.
            # Left out, a live peer behind a version only a dead peer reached would be
            # sent that version, refuse, and be left out again, for ever. At the newest
            # version it told us of: its record lags its steps.
            view = views.get(peer)
            counts = _count(version) and not (view is not None and view.failing)
            if counts and not self._before_restart(s, version, since):
                live_versions.append(max(version, self.calls.told.get(peer, version)))
        if live_versions:  # (with every peer banned for now: the version we knew)
            self.versions[s] = max(live_versions)
        balancer.set_peers(peers)
        self.stage_peers[s] = [p for p, _ in peers]
        self._read_checkpoints(s, value)
        return len(peers)

    def _read_checkpoints(self, s: int, value: DHTValue | None) -> None:
        """What stage `s`'s records say of its checkpoints (`peer.pipelined.checkpoints`):
        the version all its checkpointing peers saved (microbatches of later steps
        are kept), and a peer that restarted the stage, finding no live peer to
        download it from: the stage's steps from there on are gone, their
        microbatches and the dead peers' held ones are replayed.

        A restart is a claim: believed once per start of a peer the records list,
        at most at its own version, and only while no peer we can still call that
        started before it holds a newer version (its download failed though the
        stage lived: it catches up, nothing was lost). One that started beside such a
        peer of its own version (a stage still at version 0, which nobody
        downloads) restarted nothing: its claim is set aside for good. A liar gets the kept
        microbatches replayed once more, far less than its gradients could do."""
        records = []
        for subkey, (record, _) in ((value.subkeys or {}) if value else {}).items():
            peer = owner_of(subkey)
            if peer is not None and isinstance(record, dict) and _count(record.get("version")):
                since = record.get("since")
                records.append((peer, record, float(since) if _is_time(since) else 0.0))
        saved = [min(r["ckpt"], r["version"]) for _, r, _ in records if _count(r.get("ckpt"))]
        if saved:
            self.durable[s] = max(self.durable[s] or 0, min(saved))
            self.ledger.release(s, self.durable[s] or 0, self.versions[s])
        views = self.balancers[s].snapshot()

        def callable_(peer: PeerID) -> bool:  # (alive: banned for a refusal is, `_read_stage`)
            view = views.get(peer)
            return view is None or not view.failing

        for peer, record, since in records:
            restored = record.get("restored")
            if not (_count(restored) and restored <= record["version"]) or (
                (peer, since) in self._restores or peer not in self.stage_peers[s]
            ):
                continue
            older = [  # (at the newest version each told us of: records lag steps)
                max(r["version"], self.calls.told.get(p, r["version"]))
                for p, r, at in records
                if p != peer and p in self.stage_peers[s] and at < since and callable_(p)
            ]
            if any(v > restored for v in older):
                continue  # (asked again at the next refresh)
            self._restores.add((peer, since))
            if restored in older:
                # It started beside a live peer of its version: a stage still at version
                # 0, which nobody downloads. Nothing was lost (replayed, what that peer
                # held for the step counted twice); should that peer die, the step's log
                # says what it held, as for any peer of a stage that lives on.
                continue
            self._restarted[s] = (since, restored)
            self.versions[s] = record["version"]  # (not the dead peers' newer one)
            self._restored(s, peer, restored, since)

    def _before_restart(self, s: int, version: int, since: Any) -> bool:
        """A record of a peer that started before stage `s` was restarted, at a version
        the restart went back from: a dead peer's (its record outlives it for a while),
        which must not hold the stage's version above what its live peers serve."""
        restart = self._restarted[s]
        if restart is None or not _is_time(since):
            return False
        return bool(since < restart[0] and version > restart[1])

    def _restored(self, s: int, peer: PeerID, version: int, since: float) -> None:
        replay = self.ledger.lost(s, version, survivor=(peer, since))
        self._last_restore[s] = (version, (peer, since))
        self.calls.restores[s] += 1
        # What the restore kept is in its peer's checkpoint, and in no other's that is
        # older: a dead peer's record may still say it holds one, and should it come
        # back after this lineage died too, the steps since its checkpoint are replayed
        # (kept, not raised to `version`: released, they would be lost).
        durable = self.durable[s]
        self.durable[s] = version if durable is None else min(durable, version)
        if replay or version > 0:
            log.warning("stage %d was restarted at version %d by %s (%s): replaying %d "
                        "microbatches of the steps it lost", s, version, str(peer)[-8:],
                        "from its checkpoint" if version else "from the initial weights",
                        len(replay))  # fmt: skip
        for entry in replay:
            self._replays.spawn(self._replay(entry))

    async def run(
        self,
        microbatch: int,
        inputs: torch.Tensor,
        loss_of: Callable[[torch.Tensor], torch.Tensor],
    ) -> float:
        """One microbatch through every stage and back; its loss."""
        return await self.resume(Microbatch(microbatch, inputs, loss_of))

    async def resume(self, mb: Microbatch) -> float:
        """Take `mb` on from where it stopped (StageFailed: it stops again there)."""
        if mb.backward_from is None:
            if not mb.stage_inputs:
                mb.stage_inputs.append(mb.inputs)
            x = None
            while x is None:
                s = len(mb.stage_inputs) - 1
                y, _, peer = await self._request_from(
                    s, "forward", f"{mb.id}", mb.samples, [mb.stage_inputs[s]]
                )
                mb.forward_peers[s] = peer
                if s == self.stages - 1:
                    x = y
                else:
                    mb.stage_inputs.append(y)
                if x is not None and (bad := self._tainted(mb)) is not None:
                    # A peer convicted meanwhile computed part of it: from there again.
                    log.info("microbatch %s: re-running its forward from stage %d", mb.id, bad)
                    del mb.stage_inputs[bad + 1 :]
                    mb.forward_peers = {k: v for k, v in mb.forward_peers.items() if k < bad}
                    x = None
            outputs = x.detach().requires_grad_(True)
            loss = mb.loss_of(outputs)
            loss.backward()
            mb.grad, mb.loss, mb.backward_from = outputs.grad, float(loss.detach()), self.stages - 1
        while mb.backward_from is not None and mb.backward_from >= 0:
            s = mb.backward_from
            key = f"{self._name}/{mb.id}/{s}"
            tensors = [mb.stage_inputs[s], mb.grad]
            grad, _, _ = await self._backward(s, key, mb.samples, tensors)
            mb.grad, mb.backward_from = grad, s - 1
        self.counters.microbatches += 1
        self.counters.samples += mb.samples
        assert mb.loss is not None
        return mb.loss

    async def _backward(
        self, stage: int, key: str, samples: int, tensors: list[torch.Tensor]
    ) -> tuple[Any, dict[str, Any], PeerID]:
        grad, meta, peer = await self._request_from(stage, "backward", key, samples, tensors)
        epoch = meta.get("epoch")
        doubted = self.calls.doubted.pop(key, None)
        if isinstance(epoch, int) and not isinstance(epoch, bool):
            since = meta.get("since")  # (its incarnation: see `MicrobatchLedger.lost`)
            incarnation = float(since) if _is_time(since) else None
            applied = Applied(stage, key, peer, epoch, tensors[0], tensors[1], samples, incarnation)
            self.ledger.applied(applied)
        elif doubted is not None:  # (a dry answer: its count is the other peer's to tell)
            at, attempt, since, restores = doubted
            doubt = Doubt(stage, key, at, since, attempt, tensors[0], tensors[1], samples)
            restore = self._last_restore[stage]
            if restores != self.calls.restores[stage] and restore is not None:
                # Its version was read before the stage was restored: it counts in the
                # numbering of steps the restore lost (a CI run: two such doubts waited
                # for the restored stage to reach their version, 8 samples unsettled).
                entry = self.ledger.doubted_before(doubt, *restore)
                if entry is not None:
                    self._replays.spawn(self._replay(entry))
            else:
                self.ledger.doubted(doubt)
            if self.ledger.in_doubt(doubt):
                self._doubts.spawn(self._resolve(doubt))
        self._settle(stage, meta, peer)
        return grad, meta, peer

    def _settle(self, stage: int, meta: dict[str, Any], source: PeerID | None = None) -> None:
        """What a stage peer's (`source`'s) step log settles; replay what a step went
        without."""
        steps = []
        for item in meta.get("steps", ()) if isinstance(meta.get("steps"), list) else ():
            try:
                version, members, size, *rest = item
                # Members as bytes only: bytes(n) of a peer's integer n would allocate n bytes.
                if isinstance(version, bool) or not isinstance(version, int):
                    continue
                if not all(isinstance(m, bytes) for m in members):
                    continue
                keys = _keys(rest[0]) if len(rest) == 1 else None
                steps.append((version, frozenset(PeerID(m) for m in members), keys))
            except (TypeError, ValueError):
                continue
            if isinstance(size, int) and not isinstance(size, bool) and size >= 0:
                self.step_sizes[stage][int(version)] = size
        resolved = self.ledger.resolve(
            stage, steps, self.versions[stage], self.durable[stage], source=source
        )
        for entry in resolved:
            log.info("stage %d step %d went without %s: replaying %s", stage, entry.epoch,
                     str(entry.peer)[-8:], entry.key)  # fmt: skip
            self._replays.spawn(self._replay(entry))

    async def _resolve(self, doubt: Doubt) -> None:
        """Ask the peer `doubt` is at until it tells, or the steps settle it."""
        while self.ledger.in_doubt(doubt):
            outcome = await self.calls.fence_outcome(
                doubt.peer, doubt.stage, doubt.key, doubt.attempt, doubt.samples
            )
            epoch = (outcome.meta or {}).get("epoch")
            if outcome.applied and isinstance(epoch, int) and not isinstance(epoch, bool):
                self.ledger.fenced(doubt, epoch)
                self._settle(doubt.stage, outcome.meta or {}, doubt.peer)
                return
            replay = [] if outcome.applied else self.ledger.settle_doubts(
                doubt.stage, self.versions[doubt.stage])  # fmt: skip
            if outcome.settled and not outcome.applied:  # never applied there, and never will
                entry = self.ledger.fenced(doubt, None)
                replay += [entry] if entry is not None else []
            for entry in replay:
                log.info("stage %d: %s did not count %s: replaying it", doubt.stage,
                         str(entry.peer)[-8:], entry.key)  # fmt: skip
                self._replays.spawn(self._replay(entry))
            if self.ledger.in_doubt(doubt):
                await asyncio.sleep(DOUBT_RETRY_S)

    async def _replay(self, entry: Applied) -> None:
        # A replay is a backward of its own, under a key of its own. Under the old key a
        # peer that applied it in a step the stage did not keep (its own lone step of a
        # fork it re-synced away from) answers its old answer, at that step's epoch: the
        # ledger replays it again at once, and again, each answer unsealed, until our
        # auditor distrusts an honest peer. (Its retries keep the key: fencing needs it.)
        key = f"{entry.key.split(REPLAY_MARK, 1)[0]}{REPLAY_MARK}{next(self._replay_seq)}"
        while True:
            try:
                await self._backward(
                    entry.stage, key, entry.samples, [entry.inputs, entry.grad_outputs]
                )
                return
            except StageFailed as e:
                log.info("replaying %s as %s: %s; trying again", entry.key, key, e)
                await asyncio.sleep(1.0)

    def doubts_settled(self) -> bool:
        """Whether no backward is in doubt at a peer any more."""
        return not any(self.ledger.doubts(s) for s in range(self.stages))

    def stepped(self, stage: int, since: int, typical: int) -> int:
        """Samples `stage` stepped from version `since` on, counting a step as at least
        `typical` (a step whose size no answer told us; a smaller one, taken when a
        trainer asked, must not hold trainers back further)."""
        sizes = self.step_sizes[stage]
        for v in [v for v in sizes if v < since - 64]:
            del sizes[v]  # (bounded memory)
        return sum(max(sizes.get(v, 0), typical) for v in range(since, self.versions[stage]))

    async def settled(self) -> None:
        """Wait for the replays under way."""
        await self._replays.wait()

    async def flush(self, stage: int) -> int:
        """Ask every peer of `stage` to step with what it holds (we wait for that step
        and have sent everything); how many agreed."""
        version = self.versions[stage]

        async def ask(peer: PeerID) -> bool:
            try:
                return bool(await rpc.call(self.dht.host, peer, self.protocol, "flush",
                                           {"version": version}, timeout=5.0))  # fmt: skip
            except RemoteError:  # it answered: alive
                return False
            except (TransportError, OSError, TimeoutError):
                # As a request would: its record no longer holds the stage's version up
                # (with nothing left to send, this call is how a dead peer is found).
                self.balancers[stage].failed(peer, time.monotonic())
                return False

        local = self.local.get(stage)
        if local is not None and local.on_flush is not None and local.version == version:
            local.on_flush(version)
        remote = [p for p in self.stage_peers[stage] if p != self.dht.peer_id]
        return sum(await asyncio.gather(*(ask(p) for p in remote)))

    async def _request(
        self, stage: int, method: str, key: str, samples: int, tensors: list[torch.Tensor]
    ) -> tuple[Any, dict[str, Any]]:
        result, meta, _ = await self._request_from(stage, method, key, samples, tensors)
        return result, meta

    async def _request_from(
        self, stage: int, method: str, key: str, samples: int, tensors: list[torch.Tensor]
    ) -> tuple[Any, dict[str, Any], PeerID]:
        return await self.calls.request(stage, method, key, samples, tensors)


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_time(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _keys(value: Any) -> frozenset[str] | None:
    """A logged step's keys of ours (None: not told, or not as keys are)."""
    if not isinstance(value, list) or len(value) > STEP_KEYS:
        return None
    if not all(isinstance(k, str) and len(k) <= 200 for k in value):
        return None
    return frozenset(value)
