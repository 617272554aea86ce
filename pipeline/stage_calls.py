"""A trainer's requests to stages: pick a peer, send, retry on another, fence.

Per stage and direction the stage's `StageBalancer` picks a peer; a request
that fails or outlives its deadline bans that peer (with backoff) and goes to
another peer of the same stage, up to `attempts` tries. Deadlines adapt: a
request may take `DEADLINE_FACTOR` times what the chosen peer's measured speed
and reported queue predict, plus `DEADLINE_SLACK` for the network, between
`DEADLINE_MIN` and the trainer's `deadline`. A backward attempt that fails
without an answer is fenced at its peer before it goes to another
(`fencing`): when the peer had applied it, its answer is taken from there and
nobody else applies it. When the peer cannot tell (no reply, or still
computing it), the backward is *in doubt* there (`doubted`): its further
attempts, here and after a failure, are dry (the input gradient, nothing
counted) until the trainer's ledger settles the doubt. A stage this process
serves itself is called directly, without the wire.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from shoal.averaging.compression import Codec
from shoal.dht.node import DHTNode
from shoal.transport import rpc
from shoal.transport.errors import PayloadTooLarge, RemoteError, TransportError
from shoal.transport.identity import PeerID

from .auditor import Answer, TrainerAuditor
from .balancer import NoPeerAvailable, StageBalancer
from .bounds import StageBounds
from .fencing import ATTEMPT_BYTES, FenceOutcome, ask_fence, maybe_applied
from .server import StageServer
from .wire import MAX_ELEMENTS, encodes, recv_tensor, send_tensor

__all__ = [
    "DEADLINE_FACTOR",
    "DEADLINE_MIN",
    "DEADLINE_SLACK",
    "StageCalls",
    "StageFailed",
    "TrainerCounters",
]

log = logging.getLogger("shoal.pipeline")

DEADLINE_FACTOR = 4.0
DEADLINE_SLACK = 2.0
DEADLINE_MIN = 3.0


class StageFailed(Exception):
    """No peer of a stage answered a request within its attempts."""


@dataclass
class TrainerCounters:
    microbatches: int = 0
    samples: int = 0
    retries: int = 0
    requests: dict[str, int] = field(default_factory=lambda: {"forward": 0, "backward": 0})
    bytes_sent: int = 0  # tensor payloads to stages, as sent (encoded or not)
    # Backwards whose answer was lost but that the peer had applied (a fence told):
    # taken from that peer, sent nowhere else.
    recovered: int = 0
    # Failed backwards whose peer could not be asked whether it applied them
    # (`fencing`): in doubt there, sent elsewhere dry (the ledger settles them).
    unfenced: int = 0
    # Answers refused for holding more than the stage's bounds (`bounds`).
    oversized_refused: int = 0


class StageCalls:
    """Requests to the stages of one pipeline, for one trainer."""

    def __init__(
        self,
        dht: DHTNode,
        protocol: str,
        codec: Codec,
        balancers: list[StageBalancer],
        *,
        deadline: float,
        attempts: int,
        refresh: Callable[[], Awaitable[object]],
    ) -> None:
        """`refresh`: reads the stages' records again (no peer of a stage is left)."""
        self.dht = dht
        self.protocol = protocol
        self.codec = codec
        self.balancers = balancers
        self.deadline = deadline
        self.attempts = attempts
        self.refresh = refresh
        self.counters = TrainerCounters()
        self.versions = [0] * len(balancers)  # the newest version seen per stage
        self.served_by: dict[PeerID, int] = {}  # requests answered, per peer
        # The newest version each peer answered (or pushed a step) at since its last
        # (re)start: fresher than its DHT record, which lags its steps.
        self.told: dict[PeerID, int] = {}
        self.local: dict[int, StageServer] = {}  # stages this process serves: called directly
        self.auditor: TrainerAuditor | None = None  # audits answers (a trainer's option)
        # What each stage's answers may hold (`probe_bounds`); None: only the wire's bound.
        self.bounds: list[StageBounds] | None = None
        # Backward keys in doubt at a peer (-> the peer, the attempt, the stage's version
        # and restores then): sent dry from then on; the trainer takes them with the answer.
        self.doubted: dict[str, tuple[PeerID, bytes, int, int]] = {}
        # Restores of each stage the trainer learned of (`PipelineTrainer._restored`): a
        # doubt whose version was read before one is settled as the restore settled
        # those it found (its dry answer, which makes it a doubt, may come after).
        self.restores = [0] * len(balancers)

    async def request(
        self, stage: int, method: str, key: str, samples: int, tensors: list[torch.Tensor]
    ) -> tuple[Any, dict[str, Any], PeerID]:
        balancer = self.balancers[stage]
        backward = method == "backward"
        for attempt in range(self.attempts):
            try:
                peer = balancer.choose(time.monotonic(), samples, backward=backward)
            except NoPeerAvailable:
                if attempt + 1 < self.attempts:
                    await self.refresh()
                    await asyncio.sleep(0.2 * (attempt + 1))
                    continue
                raise StageFailed(f"no peer serves stage {stage}") from None
            expected = balancer.expected_seconds(peer, samples, backward=backward)
            deadline = min(
                self.deadline, max(DEADLINE_MIN, DEADLINE_FACTOR * expected + DEADLINE_SLACK)
            )
            nonce = None
            if self.auditor is not None and peer != self.dht.peer_id:
                nonce = TrainerAuditor.new_nonce()
            dry = backward and key in self.doubted
            attempt_id = secrets.token_bytes(ATTEMPT_BYTES) if backward and not dry else None
            if dry:
                nonce = None  # (nothing counted: nothing to audit)
            try:
                result, meta = await self._call(
                    peer, stage, method, key, samples, tensors, deadline, nonce, attempt_id,
                    dry=dry,
                )  # fmt: skip
            except (TransportError, TimeoutError, OSError, ValueError) as e:
                # (A refusal is an answer: the peer is alive, its record's version counts.)
                answered = isinstance(e, RemoteError) or peer == self.dht.peer_id
                banned = balancer.failed(peer, time.monotonic(), answered=answered)
                self.counters.retries += 1
                if isinstance(e, PayloadTooLarge):
                    self.counters.oversized_refused += 1
                if attempt_id is not None and maybe_applied(e):
                    recovered = await self._fence(peer, stage, key, attempt_id, samples)
                    if isinstance(recovered, tuple):  # it counted there: its answer was late
                        self._served(stage, method, peer, recovered[1])
                        return recovered[0], recovered[1], peer
                    if recovered is False:  # it cannot tell: in doubt there
                        self.doubted[key] = (peer, attempt_id, self.versions[stage],
                                             self.restores[stage])  # fmt: skip
                log.info("stage %d %s on %s failed (%s: %s); banned for %.0fs, trying another peer",
                         stage, method, str(peer)[-8:], type(e).__name__, e, banned)  # fmt: skip
                continue
            balancer.succeeded(peer, samples, float(meta.get("seconds", 0.0)),
                               queue=int(meta.get("queue", 0)), backward=backward)  # fmt: skip
            self._served(stage, method, peer, meta)
            if self.auditor is not None and nonce is not None:
                self.auditor.answered(Answer(stage, method, key, peer, nonce[0], meta,
                                             tuple(tensors), result))  # fmt: skip
            return result, meta, peer
        raise StageFailed(f"stage {stage} {method}: {self.attempts} attempts failed")

    def _served(self, stage: int, method: str, peer: PeerID, meta: dict[str, Any]) -> None:
        version = meta.get("version")
        if isinstance(version, int) and not isinstance(version, bool):
            self.versions[stage] = max(self.versions[stage], version)
            self.told[peer] = max(self.told.get(peer, version), version)
        self.counters.requests[method] += 1
        self.served_by[peer] = self.served_by.get(peer, 0) + 1

    def _most(self, stage: int, method: str, samples: int) -> int:
        """The most elements an answer of `stage` to `method` of `samples` may hold: its
        outputs for a forward, its inputs' gradient for a backward."""
        if self.bounds is None:
            return MAX_ELEMENTS
        bounds = self.bounds[stage]
        return bounds.inputs(samples) if method == "backward" else bounds.outputs(samples)

    async def _fence(
        self, peer: PeerID, stage: int, key: str, attempt: bytes, samples: int
    ) -> tuple[Any, dict[str, Any]] | bool:
        """Fence a failed backward attempt at `peer`: its answer if the peer had applied
        it, else whether it is settled that it never will (False: in doubt)."""
        outcome = await self.fence_outcome(peer, stage, key, attempt, samples)
        if outcome.applied and outcome.meta is not None:
            self.counters.recovered += 1
            log.info("stage %d backward %s: %s had applied it; its answer was late", stage,
                     key, str(peer)[-8:])  # fmt: skip
            return outcome.grad, outcome.meta
        if not outcome.settled:
            self.counters.unfenced += 1
            log.info("stage %d backward %s: %s cannot tell whether it applied it; in doubt "
                     "there, sent elsewhere dry", stage, key, str(peer)[-8:])  # fmt: skip
        return outcome.settled

    async def fence_outcome(
        self, peer: PeerID, stage: int, key: str, attempt: bytes, samples: int
    ) -> FenceOutcome:
        """What fencing `attempt` of backward `key` at `peer` tells."""
        local = self.local.get(stage)
        if local is not None and peer == self.dht.peer_id:
            answer, settled, meta = await local.fence(key, attempt)
            outcome = FenceOutcome(answer is not None, settled or answer is not None)
            if answer is not None:
                outcome.grad, outcome.meta = answer[0], {**meta, "epoch": answer[1]}
        else:
            payload = {"stage": stage, "key": key, "attempt": attempt, "codec": self.codec.name}
            outcome = await ask_fence(self.dht.host, peer, self.protocol, payload, self.codec,
                                      self._most(stage, "backward", samples))  # fmt: skip
        return outcome

    async def _call(
        self,
        peer: PeerID,
        stage: int,
        method: str,
        key: str,
        samples: int,
        tensors: list[torch.Tensor],
        deadline: float,
        nonce: tuple[bytes, bytes] | None = None,
        attempt: bytes | None = None,
        *,
        dry: bool = False,
    ) -> tuple[Any, dict[str, Any]]:
        local = self.local.get(stage)
        if local is not None and peer == self.dht.peer_id:  # our own stage: no wire
            async with asyncio.timeout(deadline):
                if method == "forward":
                    return await local.compute_forward(tensors[0], samples)
                return await local.compute_backward(
                    key, tensors[0], tensors[1], samples, attempt=attempt, dry=dry
                )
        enc = [encodes(self.codec, t) for t in tensors]
        # The newest version we know of the stage: a peer behind it refuses (it missed a
        # step and must re-sync before it serves again).
        payload = {"stage": stage, "key": key, "samples": samples, "codec": self.codec.name,
                   "enc": enc, "version": self.versions[stage]}  # fmt: skip
        if nonce is not None:  # the answer carries a commitment we may audit
            payload["nonce"] = nonce[1]
        if attempt is not None:  # (fenced if it fails: `fencing`)
            payload["attempt"] = attempt
        if dry:  # (in doubt elsewhere: the input gradient only)
            payload["dry"] = True
        async with (
            asyncio.timeout(deadline),
            rpc.open_call(
                self.dht.host, peer, self.protocol, method, payload, timeout=deadline
            ) as call,
        ):
            for t in tensors:
                sent = await send_tensor(call, t, self.codec)  # (`+= await` loses adds)
                self.counters.bytes_sent += sent
            meta = await call.recv_item()
            if not isinstance(meta, dict):
                raise ValueError("malformed stage answer")
            if method == "backward" and not meta.get("grad"):
                return None, meta
            most = self._most(stage, method, samples)
            result = await recv_tensor(call, self.codec, meta.get("enc") is True,
                                       rows=samples, max_elements=most)  # fmt: skip
            return result, meta
