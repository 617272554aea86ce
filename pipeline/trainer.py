"""Driving microbatches through the stages: route, retry on another peer, keep the inputs.

A trainer sends each microbatch forward through stage 0 .. n-1, computes the
loss of the last stage's outputs locally, and sends the output gradient back
through stage n-1 .. 0. Per stage and direction it asks that stage's
`StageBalancer` for a peer; a request that fails or outlives its deadline bans
that peer (with backoff) and goes to another peer of the same stage. The
trainer holds every stage's inputs of the microbatch until its backward is
done, and a backward recomputes the forward, so a peer that dies loses
nothing but time.

Each request carries an idempotency key (`<trainer>/<microbatch>/<stage>`); a
peer applies a backward key once. `ledger` records which peer applied each
backward, so that the stage's averaging round can replay the microbatches a
peer that died before the round took with it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from shoal.dht.node import DHTNode
from shoal.dht.records import owner_of
from shoal.transport import rpc
from shoal.transport.errors import TransportError
from shoal.transport.identity import PeerID

from .balancer import NoPeerAvailable, StageBalancer
from .server import pipeline_protocol, stage_key
from .wire import codec_of, encodes, recv_tensor, send_tensor

__all__ = ["PipelineTrainer", "StageFailed"]

log = logging.getLogger("shoal.pipeline")


class StageFailed(Exception):
    """No peer of a stage answered a request within its attempts."""


@dataclass
class TrainerCounters:
    microbatches: int = 0
    retries: int = 0
    requests: dict[str, int] = field(default_factory=lambda: {"forward": 0, "backward": 0})
    bytes_sent: int = 0  # tensor payloads to stages, as sent (encoded or not)


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
    ) -> None:
        """`codec`: how activations and gradients travel (`wire`; "none" for exact)."""
        self.dht = dht
        self.experiment = experiment
        self.protocol = pipeline_protocol(experiment)
        self.balancers = [StageBalancer() for _ in range(stages)]
        self.deadline = deadline
        self.attempts = attempts
        self.codec = codec_of(codec)
        self.counters = TrainerCounters()
        self.ledger: dict[str, PeerID] = {}  # backward key -> the peer that applied it
        self._name = str(dht.peer_id)[-12:]

    async def refresh(self) -> list[int]:
        """Read every stage's records from the DHT; the number of peers per stage."""
        found = await self.dht.get_many(
            [stage_key(self.experiment, s) for s in range(len(self.balancers))], latest=True
        )
        counts = []
        for s, balancer in enumerate(self.balancers):
            value = found.get(stage_key(self.experiment, s))
            peers = []
            for subkey, (record, _) in ((value.subkeys or {}) if value else {}).items():
                peer = owner_of(subkey)
                if peer is not None and isinstance(record, dict):
                    speed = record.get("fwd")
                    peers.append((peer, speed if isinstance(speed, int | float) else None))
            balancer.set_peers(peers)
            counts.append(len(peers))
        return counts

    async def run(
        self,
        microbatch: int,
        inputs: torch.Tensor,
        loss_of: Callable[[torch.Tensor], torch.Tensor],
    ) -> float:
        """One microbatch through every stage and back; its loss."""
        samples = int(inputs.shape[0])
        stage_inputs = []
        x = inputs
        for s in range(len(self.balancers)):
            stage_inputs.append(x)
            x = await self._request(s, "forward", f"{microbatch}", samples, [x])
        outputs = x.detach().requires_grad_(True)
        loss = loss_of(outputs)
        loss.backward()
        grad = outputs.grad
        for s in reversed(range(len(self.balancers))):
            key = f"{self._name}/{microbatch}/{s}"
            grad = await self._request(s, "backward", key, samples, [stage_inputs[s], grad])
        self.counters.microbatches += 1
        return float(loss.detach())

    async def _request(
        self, stage: int, method: str, key: str, samples: int, tensors: list[torch.Tensor]
    ) -> Any:
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
            try:
                result, meta = await self._call(peer, stage, method, key, samples, tensors)
            except (TransportError, TimeoutError, OSError, ValueError) as e:
                banned = balancer.failed(peer, time.monotonic())
                self.counters.retries += 1
                log.info(
                    "stage %d %s on %s failed (%s); banned for %.0fs, trying another peer",
                    stage,
                    method,
                    str(peer)[-8:],
                    type(e).__name__,
                    banned,
                )
                continue
            balancer.succeeded(
                peer,
                samples,
                float(meta.get("seconds", 0.0)),
                queue=int(meta.get("queue", 0)),
                backward=backward,
            )
            self.counters.requests[method] += 1
            if backward:
                self.ledger[key] = peer
            return result
        raise StageFailed(f"stage {stage} {method}: {self.attempts} attempts failed")

    async def _call(
        self,
        peer: PeerID,
        stage: int,
        method: str,
        key: str,
        samples: int,
        tensors: list[torch.Tensor],
    ) -> tuple[Any, dict[str, Any]]:
        enc = [encodes(self.codec, t) for t in tensors]
        payload = {"stage": stage, "key": key, "samples": samples, "codec": self.codec.name,
                   "enc": enc}  # fmt: skip
        async with rpc.open_call(
            self.dht.host, peer, self.protocol, method, payload, timeout=self.deadline
        ) as call:
            for t in tensors:
                self.counters.bytes_sent += await send_tensor(call, t, self.codec)
            meta = await call.recv_item()
            if not isinstance(meta, dict):
                raise ValueError("malformed stage answer")
            if method == "backward" and not meta.get("grad"):
                return None, meta
            return await recv_tensor(call, self.codec, meta.get("enc") is True), meta
