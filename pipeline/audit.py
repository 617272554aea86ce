"""The stage peer's side of audits (sans-I/O): sealing answers, keeping them, recomputing.

- `seal`: the signed `StageCommitment` of one answer, computed in the stage's
  compute thread right after the batch (hashes of the inputs as the peer
  decoded them, of the answer as the trainer will decode it, and of the full-
  precision result; the version of the weights it was computed with).
- `OutputStore`: the answers' full-precision results, kept for a retention
  window (seconds and bytes), revealed on a referee's request in a dispute.
- `recompute`: a referee's recomputation of a request, alone, at its own
  version, without touching the stage's accumulated gradients; `None` when it
  is not at the claimed version (it cannot judge, and says so).

`wire_roundtrip` gives what a receiver decodes from a tensor under a codec
(the int8 codec is idempotent on decoded tensors, so a referee that receives
the prover's decoded inputs again through the codec gets them bit-exact).
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch

from shoal.averaging.compression import Codec
from shoal.transport.identity import Identity
from shoal.verification.stage_audit import StageCommitment, tensor_hash

from .stage import StageWorker

__all__ = ["AuditRequest", "OutputStore", "recompute", "seal", "wire_roundtrip"]

RETENTION_S = 300.0
RETENTION_BYTES = 256 << 20


@dataclass(frozen=True)
class AuditRequest:
    """What a request says for its answer's commitment."""

    key: str
    nonce_commit: bytes
    codec: Codec


def wire_roundtrip(t: torch.Tensor, codec: Codec) -> torch.Tensor:
    """What the receiver decodes when `t` is sent under `codec` (`wire.send_tensor`)."""
    if codec.name == "none" or not t.is_floating_point():
        return t
    flat = t.detach().to("cpu", torch.float32).contiguous().view(-1)
    out = torch.empty_like(flat)
    codec.decode(codec.encode(flat), out)
    return out.view(t.shape).to(t.dtype)


def inputs_hash(*tensors: torch.Tensor) -> bytes:
    return b"".join(tensor_hash(t) for t in tensors)


def seal(
    identity: Identity,
    experiment: str,
    stage: int,
    direction: str,
    version: int,
    request: AuditRequest,
    inputs: tuple[torch.Tensor, ...],
    result: torch.Tensor | None,
) -> StageCommitment:
    """The signed commitment of one answer (`result`: None for a backward into ids)."""
    empty = torch.zeros(0)
    full = result if result is not None else empty
    sent = wire_roundtrip(full, request.codec)
    return StageCommitment(
        identity.peer_id, experiment, stage, direction, request.key, version,
        hashlib.sha256(inputs_hash(*inputs)).digest(), tensor_hash(sent), tensor_hash(full),
        request.nonce_commit, request.codec.name,
    ).signed(identity)  # fmt: skip


class OutputStore:
    """Answers' full-precision results by commitment digest, for a retention window."""

    def __init__(self, *, seconds: float = RETENTION_S, max_bytes: int = RETENTION_BYTES) -> None:
        self.seconds = seconds
        self.max_bytes = max_bytes
        self.bytes = 0
        self._kept: OrderedDict[bytes, tuple[float, torch.Tensor, Codec]] = OrderedDict()

    def keep(
        self, digest: bytes, result: torch.Tensor, codec: Codec, now: float | None = None
    ) -> None:
        now = time.monotonic() if now is None else now
        self._kept[digest] = (now, result.detach(), codec)
        self.bytes += result.numel() * result.element_size()
        self._expire(now)

    def _expire(self, now: float) -> None:
        while self._kept:
            at, t, _ = next(iter(self._kept.values()))
            if now - at <= self.seconds and self.bytes <= self.max_bytes:
                return
            self._kept.popitem(last=False)
            self.bytes -= t.numel() * t.element_size()

    def reveal(self, digest: bytes) -> torch.Tensor | None:
        """The answer as its trainer decoded it (None once forgotten)."""
        kept = self._kept.get(digest)
        if kept is None:
            return None
        return wire_roundtrip(kept[1], kept[2])

    def full(self, digest: bytes) -> torch.Tensor | None:
        """The full-precision result (None once forgotten)."""
        kept = self._kept.get(digest)
        return None if kept is None else kept[1]

    def __contains__(self, digest: object) -> bool:
        return digest in self._kept

    def __len__(self) -> int:
        return len(self._kept)


def recompute(
    worker: StageWorker,
    version: int,
    direction: str,
    inputs: torch.Tensor,
    grad_outputs: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """`direction`'s result for one request computed alone at `version` (None when the
    worker is not at that version). A backward's parameter gradients are not kept."""
    with worker.lock:
        if worker.version != version:
            return None
        x = inputs.to(worker.device)
        if direction == "forward":
            with torch.no_grad():
                return worker.module(x)
        if grad_outputs is None or not x.is_floating_point():
            raise ValueError("a backward audit needs float inputs and output gradients")
        x = x.detach().requires_grad_(True)
        with torch.enable_grad():
            out = worker.module(x)
            (grad,) = torch.autograd.grad(out, [x], grad_outputs.to(x.device, out.dtype))
        return grad.detach()
