"""Fencing a backward attempt: a trainer that gave up waiting learns whether it counted.

A backward request changes the stage peer's state (its gradients accumulate),
and its answer can fail to arrive although the peer applied it: the trainer's
deadline ran out while the request waited behind a state download, or the
connection broke on the way back. Sending it to another peer then would count
it twice. So each backward attempt carries a random `attempt` id, and before
a trainer sends a failed attempt elsewhere it asks the first peer to *fence*
it: the peer never applies that attempt from then on (a request still queued,
or still on the wire, is dropped) and says whether it applied the key before,
with the answer it gave. Applied: the trainer takes that answer and asks no
one else. Not applied: another peer may take it. No reply (the peer died, or
is cut off), or a computation of the key still under way: the attempt is
*unfenced* and the backward in doubt at that peer (`ledger.Doubt`); the
trainer goes on elsewhere with a dry backward (nothing counted there) until
that peer's step log, a later fence or the stage's steps settle it.

An error the peer's handler raised (`RemoteError`) or a dial that never
connected means nothing was applied: no fence is needed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch

from shoal.averaging.compression import Codec
from shoal.transport import rpc
from shoal.transport.errors import DialError, RemoteError, TransportError
from shoal.transport.host import Host
from shoal.transport.identity import PeerID

from .answers import Gone
from .stage import StageWorker
from .wire import MAX_ELEMENTS, codec_of, encodes, recv_tensor

__all__ = [
    "ATTEMPT_BYTES",
    "FENCE_TIMEOUT",
    "FenceOutcome",
    "ask_fence",
    "fence_answer",
    "fence_header",
    "maybe_applied",
    "parse_attempt",
    "parse_fence",
]

ATTEMPT_BYTES = 8
FENCE_TIMEOUT = 5.0  # the trainer's wait for a fence's answer
COMPUTING_WAIT_S = 4.0  # the peer's wait for a computation of the key under way
_POLL_S = 0.02


@dataclass
class FenceOutcome:
    """What a fence told: `applied` with the peer's answer (input gradient, header), or
    not applied (`settled`: the peer will never apply it), or nothing known."""

    applied: bool
    settled: bool
    grad: torch.Tensor | None = None
    meta: dict[str, Any] | None = None


def maybe_applied(error: BaseException) -> bool:
    """Whether an attempt that failed with `error` may have been applied."""
    return not isinstance(error, RemoteError | DialError)


def parse_attempt(payload: dict[str, Any]) -> bytes | None:
    attempt = payload.get("attempt")
    if attempt is None:
        return None
    if not isinstance(attempt, bytes) or not 8 <= len(attempt) <= 32:
        raise ValueError("attempt must be 8 to 32 bytes")
    return attempt


def parse_fence(payload: Any, stage: int) -> tuple[str | bytes, bytes, Codec]:
    """A fence request's stage (it must be `stage`), key, attempt and answer codec."""
    if not isinstance(payload, dict) or payload.get("stage") != stage:
        raise ValueError(f"this peer serves stage {stage}")
    key, attempt = payload.get("key"), parse_attempt(payload)
    if not isinstance(key, str | bytes) or len(key) > 200 or attempt is None:
        raise ValueError("a fence names a short key and an attempt")
    return key, attempt, codec_of(payload.get("codec", "none"))


async def fence_answer(
    worker: StageWorker, key: Hashable, attempt: bytes
) -> tuple[tuple[torch.Tensor | None, int] | None, bool]:
    """Fence `attempt` at `worker`: the applied answer (input gradient, epoch) of `key`
    if any, and whether that is settled (False: a computation of the key was still
    under way after `COMPUTING_WAIT_S`, or it was applied but its input gradient was
    dropped for room: the trainer's doubt, which our step log settles)."""
    loop = asyncio.get_running_loop()
    give_up = loop.time() + COMPUTING_WAIT_S
    while True:
        computing, answer = worker.fence(key, attempt)
        if answer is not None and isinstance(answer[0], Gone):
            return None, False
        if answer is not None or not computing:
            return answer, True
        if loop.time() > give_up:
            return None, False
        await asyncio.sleep(_POLL_S)


def fence_header(
    answer: tuple[torch.Tensor | None, int] | None, settled: bool, codec: Codec
) -> tuple[dict[str, Any], torch.Tensor | None]:
    """The peer's reply to a fence: a header, and the answer's tensor to send after it."""
    if answer is None:
        return {"applied": False, "settled": settled}, None
    grad, epoch = answer
    header = {"applied": True, "settled": True, "epoch": epoch, "grad": grad is not None,
              "enc": grad is not None and encodes(codec, grad)}  # fmt: skip
    return header, grad


async def ask_fence(
    host: Host,
    peer: PeerID,
    protocol: str,
    payload: dict[str, Any],
    codec: Codec,
    max_elements: int = MAX_ELEMENTS,
) -> FenceOutcome:
    """The trainer's side: fence the attempt `payload` names at `peer` (an unknown
    outcome when it does not answer in time, or answers a gradient of more than
    `max_elements`: the stage's inputs of the microbatch)."""
    try:
        async with (
            asyncio.timeout(FENCE_TIMEOUT),
            rpc.open_call(host, peer, protocol, "fence", payload, timeout=FENCE_TIMEOUT) as call,
        ):
            meta = await call.recv_item()
            if not isinstance(meta, dict):
                raise ValueError("malformed fence answer")
            if meta.get("applied") is not True:
                return FenceOutcome(applied=False, settled=meta.get("settled") is True)
            grad = None
            if meta.get("grad"):
                grad = await recv_tensor(call, codec, meta.get("enc") is True,
                                         max_elements=max_elements)  # fmt: skip
            return FenceOutcome(applied=True, settled=True, grad=grad, meta=meta)
    except (TransportError, TimeoutError, OSError, ValueError):
        return FenceOutcome(applied=False, settled=False)
