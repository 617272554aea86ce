"""A stage server's part in audits: the prover's reveals and the referee's recomputation.

RPCs on the stage's protocol (`server.pipeline_protocol`):

- ``audit`` (stream; a trainer asks a referee): the prover's commitment, the
  revealed nonce, the trainer's signature of the answer it received (under
  this referee's seed), then the request's tensors as the prover decoded them.
  The referee says at once whether it holds the claimed version (``{"ready": true}``,
  or ``{"cannot": ...}`` before any tensor is sent); then it checks the commitment,
  the nonce and the inputs' hash, recomputes
  the request alone at the claimed version (``{"cannot": ...}`` when it does
  not hold that version), asks the prover for its signature of the full-
  precision result under the same seed (``reveal``), and compares both: the
  full-precision one with its recomputation, the received one with its
  recomputation as the wire codec delivers it. When both agree it passes; when
  either disagrees it asks the prover for the full result (``reveal_full``,
  checked against both hashes of the commitment) and judges that, so neither
  a trainer's false signature nor a prover's false one decides alone. It
  answers with its signed `Verdict`.
- ``reveal`` (unary; a referee asks the prover): its signature of a kept
  result under the caller's seed.
- ``reveal_full`` (stream): the kept full-precision result itself.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from typing import Any, Protocol

import torch

from shoal.dht.node import DHTNode
from shoal.transport import rpc
from shoal.transport.errors import PayloadTooLarge, TransportError
from shoal.transport.identity import PeerID
from shoal.verification.evidence import Result
from shoal.verification.lsh import Signature
from shoal.verification.stage_audit import (
    StageAuditPolicy,
    StageCommitment,
    TokenJudgment,
    audit_seed,
    judge_signatures,
    judge_tokens,
    nonce_commit,
    tensor_hash,
    token_signature,
    verdict_for,
)

from .audit import OutputStore, inputs_hash, recompute, wire_roundtrip
from .audit_bans import StageBans
from .compute_queue import ComputeQueue
from .stage import StageWorker
from .wire import codec_of, recv_tensor, send_tensor

__all__ = ["AuditService", "AuditedStage", "signature_from_wire", "signature_to_wire"]

log = logging.getLogger("shoal.pipeline.audit")

REVEAL_TIMEOUT_S = 10.0


def signature_to_wire(sig: Signature) -> dict[str, Any]:
    return {"bits": sig.bits, "norms": sig.log_norms, "n": sig.elements}


def signature_from_wire(obj: Any, like: Signature) -> Signature | None:
    """A signature sent as `signature_to_wire` gives, compared with `like` (None if malformed)."""
    if not isinstance(obj, dict):
        return None
    bits, norms, n = obj.get("bits"), obj.get("norms"), obj.get("n")
    if not (isinstance(bits, bytes) and isinstance(norms, bytes) and n == like.elements):
        return None
    if len(bits) != len(like.bits) or len(norms) != len(like.log_norms):
        return None
    return Signature(like.seed, like.config, like.elements, bits, norms)


class AuditedStage(Protocol):
    """What the audit service needs of the stage it audits for (`StageServer` is one)."""

    @property
    def dht(self) -> DHTNode: ...
    @property
    def experiment(self) -> str: ...
    @property
    def stage(self) -> int: ...
    @property
    def worker(self) -> StageWorker: ...
    @property
    def protocol(self) -> str: ...
    @property
    def compute(self) -> ComputeQueue: ...

    def request_limits(self, samples: int | None) -> tuple[int, int]:
        """The most elements of inputs and of output gradients a request may hold."""
        ...


class AuditService:
    """The audit RPCs of `server` and what they need: kept answers, the ban list."""

    def __init__(self, server: AuditedStage, policy: StageAuditPolicy | None = None) -> None:
        self.server = server
        self.policy = policy or StageAuditPolicy()
        self.store = OutputStore()
        self.commitments: dict[bytes, StageCommitment] = {}
        self.bans = StageBans(server.dht, server.experiment)
        self.counts = {
            "sealed": 0,
            "unsealed": 0,
            "audited": 0,
            "passed": 0,
            "failed": 0,
            "cannot": 0,
            # Full results a prover revealed larger than our recomputation: refused.
            "oversized_refused": 0,
        }
        self.bytes_sent = 0  # signatures and reveals we sent

    def register(self, service: rpc.RpcService) -> None:
        """Serve the audit RPCs on the stage's protocol."""
        service.stream("audit")(self._audit)
        service.unary("reveal")(self._reveal)
        service.stream("reveal_full")(self._reveal_full)

    def keep(self, commitment: StageCommitment, result: torch.Tensor) -> None:
        """(In the compute thread.) Keep an answer's result for the retention window."""
        digest = commitment.digest()
        self.commitments[digest] = commitment
        self.store.keep(digest, result, codec_of(commitment.codec))
        self.counts["sealed"] += 1
        if len(self.commitments) > 2 * len(self.store) + 64:  # (forget the forgotten)
            for d in [d for d in self.commitments if d not in self.store]:
                del self.commitments[d]

    # -- the prover's side

    def _kept(self, payload: Any, caller: PeerID) -> tuple[StageCommitment, torch.Tensor, bytes]:
        digest = payload.get("digest") if isinstance(payload, dict) else None
        nonce = payload.get("nonce") if isinstance(payload, dict) else None
        commitment = self.commitments.get(digest) if isinstance(digest, bytes) else None
        full = self.store.full(digest) if commitment is not None else None
        if commitment is None or full is None:
            raise KeyError("no such answer kept")
        if not isinstance(nonce, bytes) or nonce_commit(nonce) != commitment.nonce_commit:
            raise ValueError("the nonce does not match")
        return commitment, full, audit_seed(commitment, nonce, caller)

    async def _reveal(self, ctx: rpc.CallContext, payload: Any) -> dict[str, Any]:
        _, full, seed = self._kept(payload, ctx.peer)
        sig = await asyncio.to_thread(token_signature, full, seed, self.policy)
        self.bytes_sent += len(sig.bits) + len(sig.log_norms)
        return signature_to_wire(sig)

    async def _reveal_full(self, ctx: rpc.CallContext, payload: Any):  # type: ignore[no-untyped-def]
        _, full, _ = self._kept(payload, ctx.peer)
        yield {"ok": True}
        sent = await send_tensor(ctx, full, codec_of("none"))
        self.bytes_sent += sent

    # -- the referee's side

    async def _audit(self, ctx: rpc.CallContext, payload: Any):  # type: ignore[no-untyped-def]
        if not isinstance(payload, dict):
            raise ValueError("an audit request is a map")
        server = self.server
        commitment = StageCommitment.decode(payload.get("commitment"))
        nonce = payload.get("nonce")
        codec = codec_of(payload.get("codec", "none"))
        if commitment.experiment != server.experiment or commitment.stage != server.stage:
            raise ValueError(f"this peer referees stage {server.stage}")
        if not isinstance(nonce, bytes) or nonce_commit(nonce) != commitment.nonce_commit:
            raise ValueError("the nonce does not match the commitment")
        if commitment.prover == server.dht.peer_id:
            raise ValueError("a prover does not referee itself")
        backward = commitment.direction == "backward"
        if server.worker.version != commitment.version:
            # Said before the tensors come: a referee at another version costs no bytes.
            self.counts["cannot"] += 1
            yield {"cannot": f"not at version {commitment.version}"}
            return
        yield {"ready": True}
        enc = payload.get("enc", [])
        enc = [bool(e) for e in enc] + [False] * 2
        # As a request of the stage at most (an audit names no samples); past that,
        # refused before anything is allocated (the service counts it).
        most_in, most_out = server.request_limits(None)
        inputs = await recv_tensor(ctx, codec, enc[0], max_elements=most_in)
        grads = await recv_tensor(ctx, codec, enc[1], max_elements=most_out) if backward else None
        tensors = (inputs,) if grads is None else (inputs, grads)
        if hashlib.sha256(inputs_hash(*tensors)).digest() != commitment.inputs:
            self.counts["cannot"] += 1
            yield {"cannot": "the inputs do not match the commitment"}
            return
        # (On the stage's compute thread: audits queue behind training work, never beside it.)
        args = (server.worker, commitment.version, commitment.direction, inputs, grads)
        z = await server.compute.in_thread(recompute, *args)
        if z is None:
            self.counts["cannot"] += 1
            yield {"cannot": f"not at version {commitment.version}"}
            return
        judgment = await self._judge(ctx.peer, commitment, nonce, z, payload.get("sig"))
        self.counts["audited"] += 1
        self.counts["passed" if judgment.result is Result.PASS else "failed"] += 1
        verdict = verdict_for(server.dht.host.identity, commitment, judgment)
        yield {"verdict": verdict.to_wire()}

    async def _judge(
        self, trainer: PeerID, commitment: StageCommitment, nonce: bytes, z: torch.Tensor, sig: Any
    ) -> TokenJudgment:
        me = self.server.dht.peer_id
        seed = audit_seed(commitment, nonce, me)
        received_z = wire_roundtrip(z, codec_of(commitment.codec))
        mine_full, mine_received = await asyncio.to_thread(
            lambda: (
                token_signature(z, seed, self.policy),
                token_signature(received_z, seed, self.policy),
            )
        )
        claimed = signature_from_wire(sig, mine_received)
        prover_sig = await self._ask_signature(commitment, nonce, mine_full)
        on_wire = None if claimed is None else judge_signatures(claimed, mine_received, self.policy)
        if on_wire is not None and on_wire.result is Result.PASS:
            if prover_sig is None:
                # The prover is gone (a crash after answering is no cheat): what the
                # trainer used agrees, the full precision cannot be checked.
                return on_wire
            full = judge_signatures(prover_sig, mine_full, self.policy)
            if full.result is Result.PASS:
                return full
        # Someone's signature disagrees: the prover's kept result decides.
        revealed = await self._ask_full(commitment, nonce, z.numel())
        bad = TokenJudgment(Result.BAD_REVEAL, judge_tokens(z, z, seed).comparison, 0, 0.0)
        if revealed is None or tensor_hash(revealed) != commitment.full:
            return bad
        if tensor_hash(wire_roundtrip(revealed, codec_of(commitment.codec))) != commitment.output:
            return bad  # it committed to sending something else than its result
        return await asyncio.to_thread(judge_tokens, revealed, z, seed, self.policy)

    async def _ask_signature(
        self, commitment: StageCommitment, nonce: bytes, like: Signature
    ) -> Signature | None:
        self.bytes_sent += 100  # (the request: digest, nonce, framing)
        try:
            answer = await rpc.call(self.server.dht.host, commitment.prover, self.server.protocol,
                                    "reveal", {"digest": commitment.digest(), "nonce": nonce},
                                    timeout=REVEAL_TIMEOUT_S)  # fmt: skip
        except (TransportError, OSError, TimeoutError, ValueError) as e:
            log.info("%s revealed no signature: %r", commitment.prover.short(), e)
            return None
        return signature_from_wire(answer, like)

    async def _ask_full(
        self, commitment: StageCommitment, nonce: bytes, elements: int
    ) -> torch.Tensor | None:
        """The prover's kept result: as many `elements` as our recomputation at most."""
        server = self.server
        try:
            async with (
                asyncio.timeout(REVEAL_TIMEOUT_S),
                rpc.open_call(
                    server.dht.host,
                    commitment.prover,
                    server.protocol,
                    "reveal_full",
                    {"digest": commitment.digest(), "nonce": nonce},
                    timeout=REVEAL_TIMEOUT_S,
                ) as call,  # fmt: skip
            ):
                head = await call.recv_item()
                if not isinstance(head, dict) or head.get("ok") is not True:
                    return None
                return await recv_tensor(call, codec_of("none"), False, max_elements=elements)
        except (TransportError, OSError, TimeoutError, ValueError) as e:
            if isinstance(e, PayloadTooLarge):
                self.counts["oversized_refused"] += 1
            log.info("%s revealed no result: %r", commitment.prover.short(), e)
            return None
