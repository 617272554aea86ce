"""A stage server: forward and backward requests over RPC, and the stage's record in the DHT.

One RPC protocol per experiment (`/shoal/pipeline/<experiment>/1.0.0`); a
request names its stage, so one peer could serve several. Each request is a
bidirectional call: a header (stage, idempotency key, samples), the input
tensor (and for a backward the output gradient), then the answer: a header
with what the peer measured (compute seconds, requests queued behind it) and
the result tensor. Activations and gradients travel under the codec the request
names (`wire`: int8 by default, or none). A request of more samples, or tensors of
more elements, than the stage's `bounds` allow is refused before anything of it
is read or allocated (`RpcService.oversized_refused` counts them). Every answer
also carries the stage version, for a backward the epoch its gradients went into,
and the peer's last committed steps with their members and, of the asking
trainer's backwards, the keys our gradients in each step held, from which
trainers learn which of their microbatches a step included. A backward's key is
the trainer's within its own name space (the peer ID it calls from): a trainer
that claims another's key touches nothing of the other's. A *dry* backward
(`dry` in the request) computes the input gradient and counts nothing.

Requests are computed in a worker thread, in arrival order; requests of one
kind that wait together (several trainers, or one trainer's concurrent
microbatches) are computed as one batch (`compute_queue`). The event
loop only moves bytes. While the peer re-syncs its state (it missed a step) it
refuses requests, so trainers go to its stage's other peers at once.

The stage record (`shoal/x/<experiment>/stage/<s>`, subkey: this peer's owner
marker) carries the peer's addresses, throughput for forward and backward
(samples/s measured on its own work), queue length and the stage's state
version; it lives `RECORD_TTL` seconds and is refreshed every
`RECORD_REFRESH`, and at once when the peer starts or stops serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from shoal.averaging.compression import Codec
from shoal.dht.node import DHTNode
from shoal.dht.records import owner_marker
from shoal.transport import rpc
from shoal.transport.identity import PeerID

from .audit import AuditRequest, seal
from .audit_service import AuditService
from .bounds import StageBounds
from .compute_queue import ComputeQueue, Job
from .fencing import fence_answer, fence_header, parse_attempt, parse_fence
from .stage import BackwardRequest, StageWorker
from .stage_optimizer import StepRecord
from .step_push import StepPush
from .wire import MAX_ELEMENTS, codec_of, encodes, recv_tensor, send_tensor

__all__ = ["RECORD_REFRESH", "RECORD_TTL", "StageServer", "pipeline_protocol", "stage_key"]

log = logging.getLogger("shoal.pipeline")

RECORD_TTL = 60.0
BEHIND_WAIT_S = 3.0
RECORD_REFRESH = 15.0
_EMA = 0.1
# The most keys of one trainer a step's log lists (more: none, and the trainer goes by
# the step's members): an answer's header stays small whatever a trainer sent.
LOGGED_KEYS = 512


def pipeline_protocol(experiment: str) -> str:
    return f"/shoal/pipeline/{experiment}/1.0.0"


def stage_key(experiment: str, stage: int) -> str:
    return f"shoal/x/{experiment}/stage/{stage}"


class _Speed:
    """Samples per second, an exponential moving average (bias-corrected)."""

    def __init__(self) -> None:
        self._ema = 0.0
        self._weight = 0.0

    def add(self, samples: int, seconds: float) -> None:
        self._ema = (1 - _EMA) * self._ema + _EMA * samples / max(seconds, 1e-6)
        self._weight = (1 - _EMA) * self._weight + _EMA

    @property
    def value(self) -> float | None:
        return self._ema / self._weight if self._weight else None


class StageServer:
    """Serves `worker`'s stage of `experiment` on `dht.host`."""

    def __init__(
        self,
        dht: DHTNode,
        experiment: str,
        stage: int,
        worker: StageWorker,
        bounds: StageBounds | None = None,
    ) -> None:
        """`bounds`: what a request may hold (`probe_bounds`); None: only the wire's
        MAX_ELEMENTS a tensor (a server built by hand, in tests)."""
        self.dht = dht
        self.bounds = bounds
        self.experiment = experiment
        self.stage = stage
        self.worker = worker
        self.version = 0  # optimizer steps applied to the stage's parameters
        self.steps: Sequence[StepRecord] = ()  # the last committed steps (StageOptimizer.steps)
        self.serving = True  # False while the state is re-synced: requests are refused
        # Leaving the stage (a move to another): new requests are refused, the record
        # withdrawn; the requests taken finish (`drained`).
        self.draining = False
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        # When it (re)started serving: a trainer that banned this peer lifts the ban
        # when this changes (a restart, a re-sync done), not at every refresh.
        self.since = time.time()
        self.forward_speed = _Speed()
        self.backward_speed = _Speed()
        self.served = {"forward": 0, "backward": 0}
        # Stage checkpoints (`peer.pipelined.checkpoints`), in the record: the version of
        # our newest one (`ckpt`) and the version we restored the orphaned stage at.
        self.checkpointed: int | None = None
        self.restored: int | None = None
        self.bytes_sent = 0  # activation and gradient payloads, as sent
        self.on_backward: Callable[[], None] | None = None  # after each applied backward
        self.on_behind: Callable[[], None] | None = None  # a request knew a newer version
        # A trainer waits on this version's step: whether we will step (not when already stepping).
        self.on_flush: Callable[[int], bool] | None = None
        self.on_progress: Callable[[PeerID, int, int], None] | None = None  # a peer's push
        # Trainers that sent us requests lately (-> when): told of each step at once.
        self.step_push = StepPush(dht.host, experiment)
        self.protocol = pipeline_protocol(experiment)
        self._version_changed = asyncio.Event()
        self.compute = ComputeQueue(worker, stage, self._seal)
        # Registered at `start`: a peer moving between stages builds its next stage's
        # server while the last one still serves (one service per protocol and host).
        self._service: rpc.RpcService | None = None
        # Audits: commitments, kept answers, recomputations for trainers, convictions read.
        self.audits = AuditService(self)
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        """Announce the stage and serve (the caller has the state it must serve with)."""
        self._service = rpc.RpcService(self.dht.host, self.protocol)
        self._service.stream("forward")(self._forward)
        self._service.stream("backward")(self._backward)
        self._service.stream("fence")(self._fence)
        self._service.unary("flush")(self._flush)
        self._service.unary("progress")(self._progress)
        self.audits.register(self._service)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self.compute.run())]
        await self.announce()
        self._tasks.append(loop.create_task(self._announce_loop()))

    async def aclose(self) -> None:
        self.step_push.close()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._service is not None:
            self._service.close()
        self.compute.close()
        with contextlib.suppress(Exception):
            await self.dht.store(
                stage_key(self.experiment, self.stage),
                None,
                time.time() + RECORD_TTL,
                subkey=owner_marker(self.dht.peer_id),
            )

    @property
    def queued(self) -> int:
        return self.compute.queued

    @property
    def batches(self) -> int:
        """Computations run (several requests may share one)."""
        return self.compute.batches

    def record(self) -> dict[str, Any]:
        checkpoints = {"ckpt": self.checkpointed, "restored": self.restored}
        return {
            **{k: v for k, v in checkpoints.items() if v is not None},
            "addrs": [a.to_bytes() for a in self.dht.host.addresses()][:8],
            "fwd": self.forward_speed.value,
            "bwd": self.backward_speed.value,
            "queue": self.queued,
            "version": self.version,
            "since": self.since,
            "ready": self.serving,
            "t": time.time(),
        }

    async def announce(self) -> None:
        try:
            await self.dht.store(
                stage_key(self.experiment, self.stage),
                None if self.draining else self.record(),
                time.time() + RECORD_TTL,
                subkey=owner_marker(self.dht.peer_id),
            )
        except Exception as e:  # the next refresh tries again
            log.info("announcing stage %d failed: %r", self.stage, e)

    async def _announce_loop(self) -> None:
        while True:
            await asyncio.sleep(RECORD_REFRESH)
            await self.announce()
            # Convicted peers are blocked: our stage's all-reduce leaves them out.
            await self.audits.bans.refresh()

    def _refuse_if_unavailable(self) -> None:
        if self.draining:
            raise ConnectionRefusedError("this peer is leaving its stage")
        if not self.serving:
            raise ConnectionRefusedError("this peer is re-syncing its stage's state")

    async def drain(self) -> None:
        """Stop taking requests and withdraw the record (a move to another stage);
        the requests already taken finish: `wait_drained`."""
        self.draining = True
        await self.announce()

    def undrain(self) -> None:
        """Take requests again (a move given up)."""
        self.draining = False

    async def wait_drained(self) -> None:
        """Until no request taken is left (computing, or its answer being sent)."""
        await self._idle.wait()

    @contextlib.contextmanager
    def _request(self) -> Iterator[None]:
        self._refuse_if_unavailable()
        self._in_flight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.set()

    def _check(self, payload: Any) -> tuple[Any, int, Codec, list[bool]]:
        self._refuse_if_unavailable()
        if not isinstance(payload, dict) or payload.get("stage") != self.stage:
            raise ValueError(f"this peer serves stage {self.stage}")
        samples = payload.get("samples")
        if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
            raise ValueError("samples must be a positive integer")
        key = payload.get("key")
        if not isinstance(key, str | bytes) or len(key) > 200:
            raise ValueError("key must be a short string")
        codec = codec_of(payload.get("codec", "none"))
        enc = payload.get("enc", [])
        if not isinstance(enc, list) or not all(isinstance(e, bool) for e in enc):
            raise ValueError("enc must list booleans")
        return key, samples, codec, enc

    def set_version(self, version: int) -> None:
        self.version = version
        self._version_changed.set()
        self._version_changed = asyncio.Event()

    async def wait_version_after(self, version: int) -> None:
        """Until the stage stepped (or re-synced) past `version`."""
        while self.version <= version:
            await self._version_changed.wait()

    async def _check_version(self, payload: Any) -> None:
        """Refuse a request whose trainer knows a newer version of the stage than ours:
        we missed a step and must re-sync first. A step of ours about to commit (the
        trainer heard of it from a faster peer) is waited for, up to `BEHIND_WAIT_S`."""
        known = payload.get("version", 0) if isinstance(payload, dict) else 0
        if not isinstance(known, int) or known <= self.version:
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(BEHIND_WAIT_S):
                while known > self.version:
                    await self._version_changed.wait()
        if known > self.version:
            if self.on_behind is not None:
                self.on_behind()
            raise ConnectionRefusedError(f"this peer is behind its stage (version {self.version})")

    def _seal(self, job: Job, version: int | None, result: Any) -> None:
        """In the compute thread: the commitment of a job's answer (when it asked)."""
        if job.audit is None:
            return
        if version is None or job.retried:
            self.audits.counts["unsealed"] += 1
            return
        request = job.request
        inputs = (request,) if job.kind == "forward" else (request[1], request[2])
        commitment = seal(self.dht.host.identity, self.experiment, self.stage, job.kind,
                          version, job.audit, inputs, result)  # fmt: skip
        job.sealed = commitment.encode()
        if result is not None:
            self.audits.keep(commitment, result)

    def _step_log(self, caller: PeerID) -> list[list[Any]]:
        """Our last steps: version, members, samples and `caller`'s keys in our part."""
        return [
            [r.version, [p.to_bytes() for p in r.members], r.samples, _keys_of(r, caller)]
            for r in self.steps
        ]

    def _meta(self, seconds: float, caller: PeerID) -> dict[str, Any]:
        return {
            "seconds": seconds,
            "queue": self.queued,
            "version": self.version,
            "since": self.since,  # (which incarnation of ours applied a backward)
            "steps": self._step_log(caller),
        }

    def push_step(self) -> None:
        """Tell the trainers that sent us requests lately our new version and step log
        (`step_push`: a trainer waiting on this step is idle until it knows)."""
        self.step_push.push(lambda trainer: {"stage": self.stage, "version": self.version,
                                             "steps": self._step_log(trainer)})  # fmt: skip

    async def compute_forward(
        self,
        inputs: torch.Tensor,
        samples: int,
        audit: AuditRequest | None = None,
        caller: PeerID | None = None,
    ) -> tuple[Any, dict[str, Any]]:
        """A forward request's outputs and the answer's header (over RPC, or for a
        trainer in this very process, which calls it directly: `caller` None)."""
        with self._request():
            _check_batch(inputs, samples)
            job = Job("forward", inputs, samples, audit)
            outputs, seconds = await self.compute.submit(job)
        self.forward_speed.add(samples, seconds)
        self.served["forward"] += 1
        return outputs, self._meta(seconds, caller or self.dht.peer_id) | _sealed(job)

    async def compute_backward(
        self,
        key: Any,
        inputs: torch.Tensor,
        grad_outputs: torch.Tensor,
        samples: int,
        audit: AuditRequest | None = None,
        attempt: bytes | None = None,
        caller: PeerID | None = None,
        dry: bool = False,
    ) -> tuple[Any, dict[str, Any]]:
        """A backward request's input gradient (None for token ids) and the answer's
        header (`compute_queue.Fenced`: its trainer fenced `attempt` meanwhile).
        `caller`: the trainer (None: this process's); `dry`: count nothing."""
        caller = caller or self.dht.peer_id
        with self._request():
            _check_batch(inputs, samples)
            request: BackwardRequest = ((caller.to_bytes(), key), inputs, grad_outputs, samples)
            kind = "dry" if dry else "backward"
            job = Job(kind, request, samples, None if dry else audit, attempt=attempt)
            (grad_inputs, epoch), seconds = await self.compute.submit(job)
        self.backward_speed.add(samples, seconds)
        self.served["backward"] += 1
        if self.on_backward is not None and not dry:
            self.on_backward()
        meta = {**self._meta(seconds, caller), "epoch": epoch, "grad": grad_inputs is not None}
        return grad_inputs, meta | _sealed(job)

    @property
    def oversized_refused(self) -> int:
        """Requests (and audit requests) refused for holding more than `bounds`."""
        return 0 if self._service is None else self._service.oversized_refused

    def request_limits(self, samples: int | None) -> tuple[int, int]:
        """The most elements of inputs and of output gradients a request of `samples`
        may hold (None: an audit's, whose samples nobody announces)."""
        if self.bounds is None:
            return MAX_ELEMENTS, MAX_ELEMENTS
        if samples is not None:
            self.bounds.check_samples(samples)
        return self.bounds.inputs(samples), self.bounds.outputs(samples)

    async def _forward(self, ctx: rpc.CallContext, payload: Any):  # type: ignore[no-untyped-def]
        key, samples, codec, enc = self._check(payload)
        most, _ = self.request_limits(samples)
        self.step_push.heard_from(ctx.peer)
        with self._request():
            await self._check_version(payload)
            encoded = bool(enc[:1] and enc[0])
            inputs = await recv_tensor(ctx, codec, encoded, rows=samples, max_elements=most)
            audit = _audit(payload, key, codec)
            outputs, meta = await self.compute_forward(inputs, samples, audit, ctx.peer)
            yield {**meta, "enc": encodes(codec, outputs)}
            sent = await send_tensor(ctx, outputs, codec)  # (`+= await` loses concurrent adds)
            self.bytes_sent += sent

    async def _backward(self, ctx: rpc.CallContext, payload: Any):  # type: ignore[no-untyped-def]
        key, samples, codec, enc = self._check(payload)
        most_in, most_out = self.request_limits(samples)
        attempt = parse_attempt(payload)
        self.step_push.heard_from(ctx.peer)
        with self._request():
            await self._check_version(payload)
            enc = enc + [False] * (2 - len(enc))
            inputs = await recv_tensor(ctx, codec, enc[0], rows=samples, max_elements=most_in)
            grad_outputs = await recv_tensor(
                ctx, codec, enc[1], rows=samples, max_elements=most_out
            )
            audit = _audit(payload, key, codec)
            grad_inputs, meta = await self.compute_backward(
                key, inputs, grad_outputs, samples, audit, attempt, ctx.peer,
                dry=payload.get("dry") is True,
            )  # fmt: skip
            yield {**meta, "enc": grad_inputs is not None and encodes(codec, grad_inputs)}
            if grad_inputs is not None:
                sent = await send_tensor(ctx, grad_inputs, codec)
                self.bytes_sent += sent

    async def fence(
        self, key: Any, attempt: bytes, caller: PeerID | None = None
    ) -> tuple[tuple[torch.Tensor | None, int] | None, bool, dict[str, Any]]:
        """Fence a backward attempt its trainer (`caller`; None: this process's) gave up
        on (`fencing`): the answer it got if applied, whether that is settled, and our
        header (also while re-syncing or leaving: a trainer must learn where its
        microbatch counted)."""
        caller = caller or self.dht.peer_id
        answer, settled = await fence_answer(self.worker, (caller.to_bytes(), key), attempt)
        return answer, settled, self._meta(0.0, caller)

    async def _fence(self, ctx: rpc.CallContext, payload: Any):  # type: ignore[no-untyped-def]
        key, attempt, codec = parse_fence(payload, self.stage)
        answer, settled, meta = await self.fence(key, attempt, ctx.peer)
        header, grad = fence_header(answer, settled, codec)
        yield {**meta, **header}
        if grad is not None:
            await send_tensor(ctx, grad, codec)

    async def _flush(self, ctx: rpc.CallContext, payload: Any) -> bool:
        """A trainer waits for this stage's step and has nothing more to send: step with
        what the stage holds (its other microbatches died with a peer; the trainer
        replays them once it sees the step went without that peer)."""
        version = payload.get("version") if isinstance(payload, dict) else None
        if version != self.version or not self.serving or self.on_flush is None:
            return False
        return self.on_flush(version)

    async def _progress(self, ctx: rpc.CallContext, payload: Any) -> None:
        """A peer of our stage tells its progress: samples held at its version."""
        if not isinstance(payload, dict):
            raise ValueError("progress is a map")
        samples, version = payload.get("samples"), payload.get("version")
        for v in (samples, version):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError("samples and version are whole numbers")
        if self.on_progress is not None:
            self.on_progress(ctx.peer, samples, version)


def _audit(payload: dict[str, Any], key: Any, codec: Codec) -> AuditRequest | None:
    """What a request asks for its answer's commitment: a nonce's hash (none: no seal)."""
    nonce = payload.get("nonce")
    if nonce is None:
        return None
    if not isinstance(nonce, bytes) or len(nonce) != 32 or not isinstance(key, str):
        raise ValueError("nonce must be 32 bytes and key a string")
    return AuditRequest(key, nonce, codec)


def _keys_of(record: StepRecord, caller: PeerID) -> list[Any] | None:
    """`caller`'s keys among those `record` holds (None: more than LOGGED_KEYS, or not
    known: a step read back from a checkpoint without them)."""
    if record.keys is None:
        return None
    mine = caller.to_bytes()
    keys = [k[1] for k in record.keys if isinstance(k, tuple) and k[0] == mine]
    return keys if len(keys) <= LOGGED_KEYS else None


def _sealed(job: Job) -> dict[str, Any]:
    return {} if job.sealed is None else {"commitment": job.sealed}


def _check_batch(inputs: torch.Tensor, samples: int) -> None:
    if inputs.dim() < 1 or inputs.shape[0] != samples:
        raise ValueError("the inputs' first dimension must be the request's samples")
