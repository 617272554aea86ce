"""A trainer's audits of the answers it gets from stage peers (after the answer: the
training path never waits for one).

Every request carries the hash of a fresh nonce (`nonce_commit`); the answer
carries the prover's signed commitment. Right after the answer the trainer
decides with its private RNG whether to audit it: at `policy.rate`, or at
`policy.probation_rate` for a peer with fewer than `policy.probation_passes`
passed audits. An audited answer must match its commitment (the tensor the
trainer decoded has the committed hash, the key, stage, direction and nonce
are the request's); one that does not is the prover's own doing, provable to
nobody else: this trainer alone stops routing to it. Then a `StageDispute` runs
(`verification.stage_audit`): the revealed nonce draws the referees among the
stage's other peers, each referee gets the request's tensors and the trainer's
signature of what it received under that referee's seed, recomputes and signs a
verdict; a referee at another version says it cannot. A conviction is published
in the DHT (`audit_bans`): every peer that reads it blocks the convicted one.
An acquittal gives strikes to the accusers; a referee with `MAX_STRIKES` is not
asked again by this trainer.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from shoal.averaging.compression import Codec
from shoal.dht.node import DHTNode
from shoal.transport import rpc
from shoal.transport.errors import TransportError
from shoal.transport.identity import PeerID
from shoal.transport.tasks import TaskSet
from shoal.verification.disputes import MAX_STRIKES
from shoal.verification.evidence import EvidenceError, Verdict
from shoal.verification.stage_audit import (
    StageAuditPolicy,
    StageCommitment,
    StageDispute,
    StageOutcome,
    nonce_commit,
    tensor_hash,
    token_signature,
)

from .audit import inputs_hash, wire_roundtrip
from .audit_bans import StageBans
from .audit_service import signature_to_wire
from .wire import encodes, send_tensor

__all__ = ["Answer", "TrainerAuditor"]

log = logging.getLogger("shoal.pipeline.audit")

AUDIT_TIMEOUT_S = 30.0
# A peer may leave this many answers (and this share of them) unsealed before we stop
# routing to it: more would let it cheat on the answers it chose not to seal.
UNSEALED_FREE = 10
UNSEALED_SHARE = 0.25


@dataclass
class Answer:
    """One answer as the trainer got it, with what an audit needs."""

    stage: int
    direction: str
    key: str
    peer: PeerID
    nonce: bytes
    meta: dict[str, Any]
    inputs: tuple[torch.Tensor, ...]  # as sent (before the wire codec)
    received: torch.Tensor | None  # as decoded


class TrainerAuditor:
    """Decides which answers to audit and runs their audits in the background."""

    def __init__(
        self,
        dht: DHTNode,
        experiment: str,
        protocol: str,
        codec: Codec,
        *,
        policy: StageAuditPolicy | None = None,
        candidates: Callable[[int], list[PeerID]],
        rng: random.Random | None = None,
    ) -> None:
        self.dht = dht
        self.experiment = experiment
        self.protocol = protocol
        self.codec = codec
        self.policy = policy or StageAuditPolicy()
        self.candidates = candidates
        self.bans = StageBans(dht, experiment)
        self.distrusted: set[PeerID] = set()  # answered against its commitment: ours alone
        self.on_distrust: Callable[[PeerID], None] | None = None
        self.passes: Counter[PeerID] = Counter()
        self.answers: Counter[PeerID] = Counter()  # answers got, audited or not
        self.unsealed: Counter[PeerID] = Counter()  # answers without a commitment
        self.strikes: Counter[PeerID] = Counter()
        self.outcomes: Counter[str] = Counter()
        self.bytes_sent = 0  # tensors and signatures sent to referees, verdicts back
        self.commitment_bytes = 0  # nonce hashes in requests and commitments in answers
        self._rng = rng or random.Random(int.from_bytes(os.urandom(8), "little"))
        self._tasks = TaskSet(log, "stage audit")

    @staticmethod
    def new_nonce() -> tuple[bytes, bytes]:
        """A request's nonce and the hash it carries."""
        nonce = os.urandom(16)
        return nonce, nonce_commit(nonce)

    def rate(self, peer: PeerID) -> float:
        if self.passes[peer] < self.policy.probation_passes:
            return max(self.policy.rate, self.policy.probation_rate)
        return self.policy.rate

    def answered(self, answer: Answer) -> bool:
        """An answer arrived: audit it (in the background) or not; whether it is audited."""
        commitment = answer.meta.get("commitment")
        # (The nonce's hash in the request, the commitment in the answer.)
        self.commitment_bytes += 34 + (len(commitment) if isinstance(commitment, bytes) else 0)
        self.answers[answer.peer] += 1
        if not isinstance(commitment, bytes):
            # Legitimately unsealed: a retried backward (answered before, at a version
            # it may have left) or one computed while the peer downloaded its state.
            self.unsealed[answer.peer] += 1
            self.outcomes["unsealed"] += 1
            if self.unsealed[answer.peer] > max(
                UNSEALED_FREE, UNSEALED_SHARE * self.answers[answer.peer]
            ):
                self._distrust(answer, "too few commitments")
            return False
        if answer.peer in self.bans or self._rng.random() >= self.rate(answer.peer):
            return False
        self._tasks.spawn(self._audit(answer))
        return True

    async def settled(self) -> None:
        """Wait for the audits under way."""
        await self._tasks.wait()

    async def aclose(self) -> None:
        self._tasks.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _commitment(self, answer: Answer) -> StageCommitment | None:
        """The answer's commitment when it is the request's and matches the received
        tensor; None otherwise (and this trainer stops routing to a peer whose
        commitment contradicts its answer, or that seals too few of its answers)."""
        try:
            c = StageCommitment.decode(answer.meta.get("commitment"))
        except EvidenceError:
            self._distrust(answer, "a malformed commitment")
            return None
        received = answer.received if answer.received is not None else torch.zeros(0)
        ours = (self.experiment, answer.stage, answer.direction, answer.key, answer.peer,
                nonce_commit(answer.nonce), self.codec.name)  # fmt: skip
        if (c.experiment, c.stage, c.direction, c.key, c.prover, c.nonce_commit, c.codec) != ours:
            self._distrust(answer, "a commitment to another request")
            return None
        if tensor_hash(received) != c.output:
            self._distrust(answer, "an answer other than the one it committed to")
            return None
        return c

    def _distrust(self, answer: Answer, why: str) -> None:
        log.warning("%s answered %s with %s: not routing to it", answer.peer.short(),
                    answer.key, why)  # fmt: skip
        self.distrusted.add(answer.peer)
        self.outcomes["mismatch"] += 1
        if self.on_distrust is not None:
            self.on_distrust(answer.peer)

    async def _audit(self, answer: Answer) -> None:
        c = self._commitment(answer)
        if c is None or answer.received is None:
            return  # (a backward into token ids returns nothing to check)
        sent = tuple(wire_roundtrip(t, self.codec) for t in answer.inputs)
        if hashlib.sha256(inputs_hash(*sent)).digest() != c.inputs:
            self.outcomes["inputs differ"] += 1  # (the codec was not idempotent: no audit)
            return
        candidates = [p for p in self.candidates(answer.stage) if p not in self.bans
                      and self.strikes[p] < MAX_STRIKES]  # fmt: skip
        dispute = StageDispute(c, answer.nonce, candidates)
        try:
            async with asyncio.timeout(AUDIT_TIMEOUT_S * 3):
                while (referee := dispute.next_referee()) is not None:
                    verdict = await self._ask(referee, dispute, sent, answer.received)
                    if verdict is None:
                        dispute.cannot(referee)
                    else:
                        dispute.add(verdict)
        except TimeoutError:
            pass
        await self._conclude(dispute)

    async def _ask(
        self,
        referee: PeerID,
        dispute: StageDispute,
        sent: tuple[torch.Tensor, ...],
        received: torch.Tensor,
    ) -> Verdict | None:
        sig = await asyncio.to_thread(
            token_signature, received, dispute.seed_for(referee), self.policy
        )
        payload = {"commitment": dispute.commitment.encode(), "nonce": dispute.nonce,
                   "codec": self.codec.name, "enc": [encodes(self.codec, t) for t in sent],
                   "sig": signature_to_wire(sig)}  # fmt: skip
        try:
            async with (
                asyncio.timeout(AUDIT_TIMEOUT_S),
                rpc.open_call(
                    self.dht.host, referee, self.protocol, "audit", payload, timeout=AUDIT_TIMEOUT_S
                ) as call,  # fmt: skip
            ):
                self.bytes_sent += len(sig.bits) + len(sig.log_norms) + 200
                reply = await call.recv_item()
                if isinstance(reply, dict) and reply.get("ready") is True:
                    for t in sent:
                        sent = await send_tensor(call, t, self.codec)
                        self.bytes_sent += sent
                    reply = await call.recv_item()
        except (TransportError, OSError, TimeoutError, ValueError) as e:
            log.info("referee %s: %r", referee.short(), e)
            return None
        if not isinstance(reply, dict) or "verdict" not in reply:
            return None
        with contextlib.suppress(TypeError):
            self.bytes_sent += sum(len(part) for part in reply["verdict"])
        try:
            verdict = Verdict.from_wire(reply["verdict"])
        except EvidenceError:
            return None
        return verdict if verdict.verifier == referee else None

    async def _conclude(self, dispute: StageDispute) -> None:
        outcome, prover = dispute.outcome, dispute.commitment.prover
        self.outcomes[str(outcome)] += 1
        if outcome is StageOutcome.PASSED or outcome is StageOutcome.ACQUITTED:
            self.passes[prover] += 1
        for accuser in dispute.overruled():
            self.strikes[accuser] += 1
        if outcome is StageOutcome.CONVICTED:
            log.warning("stage %d peer %s convicted by an audit of %s", dispute.commitment.stage,
                        prover.short(), dispute.commitment.key)  # fmt: skip
            await self.bans.publish(dispute.evidence())
