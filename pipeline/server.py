"""A stage server: forward and backward requests over RPC, and the stage's record in the DHT.

One RPC protocol per experiment (`/shoal/pipeline/<experiment>/1.0.0`); a
request names its stage, so one peer could serve several. Each request is a
bidirectional call: a header (stage, idempotency key, samples), the input
tensor (and for a backward the output gradient), then the answer: a header
with what the peer measured (compute seconds, requests queued behind it) and
the result tensor. Activations and gradients travel under the codec the request
names (`wire`: int8 by default, or none). Requests are computed one at a time in a worker thread, in
arrival order; the event loop only moves bytes.

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
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from shoal.averaging.compression import Codec
from shoal.dht.node import DHTNode
from shoal.dht.records import owner_marker
from shoal.transport import rpc

from .stage import StageWorker
from .wire import codec_of, encodes, recv_tensor, send_tensor

__all__ = ["RECORD_REFRESH", "RECORD_TTL", "StageServer", "pipeline_protocol", "stage_key"]

log = logging.getLogger("shoal.pipeline")

RECORD_TTL = 60.0
RECORD_REFRESH = 15.0
_EMA = 0.1


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

    def __init__(self, dht: DHTNode, experiment: str, stage: int, worker: StageWorker) -> None:
        self.dht = dht
        self.experiment = experiment
        self.stage = stage
        self.worker = worker
        self.version = 0  # optimizer steps applied to the stage's parameters
        self.forward_speed = _Speed()
        self.backward_speed = _Speed()
        self.served = {"forward": 0, "backward": 0}
        self.bytes_sent = 0  # activation and gradient payloads, as sent
        self._queued = 0
        self._compute = ThreadPoolExecutor(1, thread_name_prefix=f"shoal-stage{stage}")
        self._service = rpc.RpcService(dht.host, pipeline_protocol(experiment))
        self._service.stream("forward")(self._forward)
        self._service.stream("backward")(self._backward)
        self._announcer: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.announce()
        self._announcer = asyncio.get_running_loop().create_task(self._announce_loop())

    async def aclose(self) -> None:
        if self._announcer is not None:
            self._announcer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._announcer
        self._service.close()
        self._compute.shutdown(wait=False, cancel_futures=True)

    def record(self) -> dict[str, Any]:
        return {
            "addrs": [a.to_bytes() for a in self.dht.host.addresses()][:8],
            "fwd": self.forward_speed.value,
            "bwd": self.backward_speed.value,
            "queue": self._queued,
            "version": self.version,
            "t": time.time(),
        }

    async def announce(self) -> None:
        try:
            await self.dht.store(
                stage_key(self.experiment, self.stage),
                self.record(),
                time.time() + RECORD_TTL,
                subkey=owner_marker(self.dht.peer_id),
            )
        except Exception as e:  # the next refresh tries again
            log.info("announcing stage %d failed: %r", self.stage, e)

    async def _announce_loop(self) -> None:
        while True:
            await asyncio.sleep(RECORD_REFRESH)
            await self.announce()

    def _check(self, payload: Any) -> tuple[Any, int, Codec, list[bool]]:
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

    async def _run(self, fn: Any, *args: Any) -> tuple[Any, float]:
        self._queued += 1
        try:
            loop = asyncio.get_running_loop()

            def timed() -> tuple[Any, float]:
                started = time.perf_counter()
                result = fn(*args)
                return result, time.perf_counter() - started

            return await loop.run_in_executor(self._compute, timed)
        finally:
            self._queued -= 1

    async def _forward(self, ctx: rpc.CallContext, payload: Any):  # type: ignore[no-untyped-def]
        _, samples, codec, enc = self._check(payload)
        inputs = await recv_tensor(ctx, codec, bool(enc[:1] and enc[0]))
        outputs, seconds = await self._run(self.worker.forward, inputs)
        self.forward_speed.add(samples, seconds)
        self.served["forward"] += 1
        yield {"seconds": seconds, "queue": self._queued, "version": self.version,
               "enc": encodes(codec, outputs)}  # fmt: skip
        self.bytes_sent += await send_tensor(ctx, outputs, codec)

    async def _backward(self, ctx: rpc.CallContext, payload: Any):  # type: ignore[no-untyped-def]
        key, samples, codec, enc = self._check(payload)
        enc = enc + [False] * (2 - len(enc))
        inputs = await recv_tensor(ctx, codec, enc[0])
        grad_outputs = await recv_tensor(ctx, codec, enc[1])
        grad_inputs, seconds = await self._run(
            self.worker.backward, key, inputs, grad_outputs, samples
        )
        self.backward_speed.add(samples, seconds)
        self.served["backward"] += 1
        yield {
            "seconds": seconds,
            "queue": self._queued,
            "version": self.version,
            "grad": grad_inputs is not None,
            "enc": grad_inputs is not None and encodes(codec, grad_inputs),
        }
        if grad_inputs is not None:
            self.bytes_sent += await send_tensor(ctx, grad_inputs, codec)
