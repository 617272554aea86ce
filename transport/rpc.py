"""RPC over streams: unary and streaming calls with msgpack payloads and raw tensors.

One call is one stream, opened with the service's protocol name. On the stream
every message is a frame ``length:u32 kind:u8`` + body, where the body is
msgpack (kind MSG) or a msgpack tensor header followed by the tensor's raw
bytes (kind TENSOR). The first client message is ``[method, timeout_s, payload]``;
the server answers ``[OK, result]`` (once for unary calls, once per item for
streams) or ``[ERR, [kind, message]]``, then half-closes.

Bulk data (the all-reduce's parts, state downloads) travels as *chunks*: a
TENSOR frame whose 8-byte body is ``index:u32 nbytes:u32``, followed by the
raw bytes. Both sides know every chunk's index and size in advance, so a chunk
is read straight into a buffer posted for it, and anything else (another
index, another size) is a protocol violation. An ``ERR`` message where a chunk
was due becomes the RemoteError it carries.

Deadlines travel as a relative timeout (no clock agreement needed); the server
runs the handler under it. Cancelling the caller resets the stream, which
cancels the handler on the other side.

What a remote caller can make a service hold is bounded (`RpcLimits`): the
request must arrive within `first_message_timeout` of the stream opening (a
stream opened and left silent is reset, not served forever), a call without a
timeout runs under `default_timeout`, and each peer has at most
`max_concurrent_per_peer` calls in a service at once (optionally also
`max_requests_per_s_per_peer`); beyond that the caller gets `PeerBusy` at once.
What one call may make it allocate is bounded too: a message by `max_message`,
read only as its bytes arrive; a tensor by `max_tensor`, and tighter by what the
handler expects (``recv_tensor(max_bytes=, max_elements=)``; a chunk is read only
into a buffer of the size the receiver expects). A tensor header announcing more
raises `PayloadTooLarge` before anything is allocated for it; in a service, the
call is answered ``PayloadTooLarge``, its stream reset and the refusal counted
(`RpcService.oversized_refused`).
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgpack

from . import tensors
from .connection import Stream
from .deadline import deadline
from .errors import (
    ConnectionLost,
    PayloadTooLarge,
    ProtocolViolation,
    RemoteError,
    RpcTimeout,
    StreamReset,
    StreamTruncated,
    TransportError,
    UnknownMethod,
)
from .host import Host
from .identity import PeerID
from .multiaddr import Multiaddr
from .ratelimit import KeyedBuckets

log = logging.getLogger("shoal.transport.rpc")

FRAME = struct.Struct(">IB")
CHUNK = struct.Struct(">IBII")  # FRAME (length 8, kind TENSOR), then index and byte count
_CHUNK_BODY = struct.Struct(">II")
MSG, TENSOR = 0, 1
OK, ERR = 0, 1
DEFAULT_MAX_MESSAGE = 16 * 1024 * 1024
DEFAULT_MAX_TENSOR = 4 * 1024 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class RpcLimits:
    max_message: int = DEFAULT_MAX_MESSAGE  # one msgpack frame
    max_tensor: int = DEFAULT_MAX_TENSOR  # one tensor's raw bytes
    max_timeout: float = 3600.0  # a peer may not ask us to hold a handler longer
    # Honest callers write the request right after opening the stream.
    first_message_timeout: float = 10.0
    # The handler's deadline when the caller sends none (the all-reduce's data streams
    # and its control messages, which the round's own deadlines bound far sooner).
    default_timeout: float = 600.0
    # Calls one peer may have running in one service; more wait in a queue (FIFO),
    # and beyond the queue the caller gets PeerBusy. Honest peaks: the all-reduce
    # opens streams_per_peer (1-8) data streams plus a few control calls per round,
    # a pipeline trainer 2 x stages microbatches (16 in bench/pipeline.py), DHT
    # lookups alpha (3) per key times the keys of a get_many, bench/transport.py 64;
    # tests/test_rpc.py starts 2,000 at once (they queue).
    max_concurrent_per_peer: int = 64
    # The multiplexer's stream cap (MuxLimits.max_streams) bounds it per connection too.
    max_queued_per_peer: int = 2048
    # Calls per second one peer may start in one service (burst: two seconds' worth);
    # None: no rate limit (bench/transport.py alone makes >10k/s on purpose).
    max_requests_per_s_per_peer: float | None = None


_DEFAULT_LIMITS = RpcLimits()
_IDLE_SLOTS_KEPT = 1024  # peers whose (idle) call slots a service keeps


def _unpack(body: bytes) -> Any:
    try:
        return msgpack.unpackb(body, raw=False, strict_map_key=False, use_list=True)
    except Exception as e:  # msgpack raises several unrelated types on bad input
        raise ProtocolViolation(f"undecodable message: {type(e).__name__}") from None


def pack_message(obj: Any) -> bytes:
    body = msgpack.packb(obj, use_bin_type=True)
    return FRAME.pack(len(body), MSG) + body


class MessageStream:
    """Message framing on top of a Stream (used by both sides of a call)."""

    __slots__ = ("limits", "stream")

    def __init__(self, stream: Stream, limits: RpcLimits = _DEFAULT_LIMITS) -> None:
        self.stream = stream
        self.limits = limits

    async def send(self, obj: Any) -> None:
        await self.stream.write(pack_message(obj))

    async def send_tensor(self, tensor: Any) -> None:
        """Send a torch tensor or numpy array: header, then bytes straight from its storage."""
        header, view = tensors.describe(tensor)
        body = msgpack.packb(header, use_bin_type=True)
        await self.stream.write(FRAME.pack(len(body), TENSOR) + body)
        await self.stream.write(view)

    async def send_chunk(self, index: int, payload: memoryview) -> int:
        """Chunk `index`: its header, then `payload` straight from its buffer.
        Returns the bytes written."""
        await self.stream.write(CHUNK.pack(8, TENSOR, index, len(payload)))
        await self.stream.write(payload)
        return CHUNK.size + len(payload)

    async def recv_chunk_into(self, index: int, into: memoryview) -> int:
        """Read chunk `index`, of exactly len(into) bytes, into `into`; returns the
        bytes read. The remote handler's error, sent instead, raises as RemoteError."""
        length, kind = FRAME.unpack(await self.stream.readexactly(FRAME.size))
        if kind == MSG:
            if length > self.limits.max_message:
                raise PayloadTooLarge(f"message of {length} bytes where chunk {index} was due")
            msg = _unpack(await self.stream.readexactly(length))
            if isinstance(msg, list) and len(msg) == 2 and msg[0] == ERR:
                _raise_remote(msg[1])
            raise ProtocolViolation(f"a message where chunk {index} was due")
        if kind != TENSOR or length != _CHUNK_BODY.size:
            raise ProtocolViolation(f"bad chunk frame (kind {kind}, length {length})")
        got_index, nbytes = _CHUNK_BODY.unpack(await self.stream.readexactly(_CHUNK_BODY.size))
        if got_index != index:
            raise ProtocolViolation(f"chunk {got_index} where chunk {index} was due")
        if nbytes != len(into):
            raise ProtocolViolation(f"chunk {index} has {nbytes} bytes, {len(into)} were due")
        await self.stream.readexactly_into(into)
        return CHUNK.size + nbytes

    def frame_buffered(self) -> bool:
        """Whether a whole frame is buffered: the next `recv` returns without waiting."""
        stream = self.stream
        buffered = stream.buffered
        return (
            buffered >= FRAME.size
            and buffered >= FRAME.size + FRAME.unpack(stream.peek(FRAME.size))[0]
        )

    async def _read_frame(self) -> tuple[int, bytes] | None:
        head = await self.stream.readexactly(FRAME.size) if not self.stream.at_eof() else b""
        if not head:
            return None
        length, kind = FRAME.unpack(head)
        if length > self.limits.max_message:
            raise PayloadTooLarge(
                f"message of {length} bytes exceeds the limit of {self.limits.max_message}"
            )
        if kind not in (MSG, TENSOR):
            raise ProtocolViolation(f"unknown frame kind {kind}")
        return kind, await self.stream.readexactly(length)

    async def recv(self) -> Any:
        """The next message; raises EOFError at the end of the stream."""
        frame = await self._read_frame()
        if frame is None:
            raise EOFError("stream ended")
        kind, body = frame
        if kind != MSG:
            raise ProtocolViolation("expected a message, got a tensor")
        return _unpack(body)

    async def recv_tensor(
        self, out: Any = None, *, max_bytes: int | None = None, max_elements: int | None = None
    ) -> Any:
        """The next tensor, read straight into `out` when given (shape/dtype must match).

        `max_bytes`, `max_elements`: what this call expects at most (the limits'
        `max_tensor` bounds every call); a header announcing more raises
        PayloadTooLarge before anything is allocated for it or read."""
        frame = await self._read_frame()
        if frame is None:
            raise EOFError("stream ended")
        kind, body = frame
        if kind != TENSOR:
            raise ProtocolViolation("expected a tensor, got a message")
        limit = self.limits.max_tensor
        if max_bytes is not None:
            limit = min(limit, max_bytes)
        try:
            header = tensors.validate(_unpack(body), limit, max_elements)
            result, view = tensors.allocate(header, out)
        except tensors.TensorTooLarge as e:
            raise PayloadTooLarge(str(e)) from None
        except ValueError as e:
            raise ProtocolViolation(f"bad tensor: {e}") from None
        await self.stream.readexactly_into(view)
        return result


class PeerBusy(RemoteError):
    """The service refused the call at once: this peer has too many calls in flight
    there, or starts them too fast. Not a fault of the callee; retry later."""


class CallContext(MessageStream):
    """What a handler sees: the caller, its deadline, and the stream for streaming calls."""

    __slots__ = ("method", "peer", "timeout")

    def __init__(self, stream: Stream, method: str, timeout: float | None, limits: RpcLimits):
        self.stream = stream  # (MessageStream's two fields, set here: a call less per call)
        self.limits = limits
        self.peer: PeerID = stream.remote_peer
        self.method = method
        self.timeout = timeout

    @property
    def remote_ip(self) -> str | None:
        """The IP the caller's connection comes from (not what it advertises), for
        per-IP limits; None on a relayed connection."""
        conn = self.stream.connection
        address = conn.remote_address
        return None if conn.kind == "relayed" or address is None else address[0]

    async def send_item(self, item: Any) -> None:
        """One item of a streaming response."""
        await self.send([OK, item])


Handler = Callable[[CallContext, Any], Awaitable[Any]]
StreamHandler = Callable[[CallContext, Any], AsyncIterator[Any]]


class RpcService:
    """Methods served under one protocol name, e.g. ``/shoal/dht/1.0.0``."""

    def __init__(self, host: Host, protocol: str, limits: RpcLimits | None = None) -> None:
        self.host = host
        self.protocol = protocol
        self.limits = limits or _DEFAULT_LIMITS
        self._unary: dict[str, Handler] = {}
        self._streams: dict[str, StreamHandler] = {}
        self._slots: dict[PeerID, _PeerSlots] = {}
        rate = self.limits.max_requests_per_s_per_peer
        self._rates = None if rate is None else KeyedBuckets(rate, max(1.0, 2 * rate))
        self.busy_refusals = 0  # calls answered PeerBusy
        self.silent_streams = 0  # streams reset for sending no request in time
        # Calls refused for announcing more than the handler expects (PayloadTooLarge).
        self.oversized_refused = 0
        host.set_handler(protocol, self._serve)

    def unary(self, name: str) -> Callable[[Handler], Handler]:
        """Register ``async def handler(ctx, payload) -> result``."""

        def register(fn: Handler) -> Handler:
            self._unary[name] = fn
            return fn

        return register

    def stream(self, name: str) -> Callable[[StreamHandler], StreamHandler]:
        """Register ``async def handler(ctx, payload)`` yielding response items.

        The handler may also use ``ctx.recv()``/``ctx.recv_tensor()`` to read more
        client messages, and ``ctx.send_tensor()`` to answer with tensors.
        """

        def register(fn: StreamHandler) -> StreamHandler:
            self._streams[name] = fn
            return fn

        return register

    def close(self) -> None:
        self.host.remove_handler(self.protocol)

    def in_flight(self, peer: PeerID) -> int:
        """Calls from `peer` this service is running or queueing now."""
        slots = self._slots.get(peer)
        return 0 if slots is None else slots.running + len(slots.waiting)

    def _refusal(self, peer: PeerID) -> str | None:
        lim = self.limits
        slots = self._slots.get(peer)
        if slots is not None and len(slots.waiting) >= lim.max_queued_per_peer:
            return f"{lim.max_concurrent_per_peer + lim.max_queued_per_peer} calls from this peer"
        if self._rates is not None and not self._rates.take(
            peer, asyncio.get_running_loop().time()
        ):
            return f"more than {lim.max_requests_per_s_per_peer:g} calls per second"
        return None

    async def _serve(self, stream: Stream) -> None:
        peer = stream.remote_peer
        slots = self._slots.get(peer)
        if self._rates is not None or (
            slots is not None and len(slots.waiting) >= self.limits.max_queued_per_peer
        ):
            refusal = self._refusal(peer)
            if refusal is not None:
                # Answered before the request is read: a flood costs one small write.
                self._refuse(stream, peer, refusal)
                await _try_send(MessageStream(stream, self.limits), [ERR, ["Busy", refusal]])
                return
        if slots is None:
            slots = self._new_slots(peer)
        request_due: float | None = None  # None: served at once, due from now
        if not slots.try_acquire():
            # Queued calls wait before their request is read: they cost a task, and the
            # bytes the stream's window lets the peer send.
            request_due = self._loop_time() + self.limits.first_message_timeout
            await slots.acquire()
        try:
            await self._serve_admitted(stream, request_due)
        finally:
            slots.release()

    def _new_slots(self, peer: PeerID) -> _PeerSlots:
        # A peer's slots outlive its calls (a quick handler would make and drop them
        # on every call); the idle ones go when a new peer finds the table full.
        if len(self._slots) >= _IDLE_SLOTS_KEPT:
            self._slots = {p: s for p, s in self._slots.items() if not s.idle}
        slots = self._slots[peer] = _PeerSlots(self.limits.max_concurrent_per_peer)
        return slots

    @staticmethod
    def _loop_time() -> float:
        return asyncio.get_running_loop().time()

    def _refuse(self, stream: Stream, peer: PeerID, refusal: str) -> None:
        self.busy_refusals += 1
        self.host.remote_events.info(
            f"{self.protocol} busy",
            stream.connection.remote_key(),
            "%s: refusing a call from %s: %s",
            self.protocol,
            peer.short(),
            refusal,
        )

    async def _read_request(self, msgs: MessageStream, request_due: float | None) -> Any:
        """The call's request, due `first_message_timeout` after the stream opened
        (`request_due`, or now when it was not queued), queueing included (so a queue
        of silent streams drains at once); one that has begun to arrive gets the full
        time to finish."""
        wait = self.limits.first_message_timeout
        now = self._loop_time()
        due = now + wait if request_due is None else request_due
        if msgs.stream.buffered:
            due = max(due, now + wait)
        try:
            async with asyncio.timeout_at(due):
                return await msgs.recv()
        except TimeoutError:
            self.silent_streams += 1
            raise ProtocolViolation(f"no request within {wait:g} s") from None

    async def _serve_admitted(self, stream: Stream, request_due: float | None) -> None:
        msgs = MessageStream(stream, self.limits)
        try:
            if msgs.frame_buffered():
                # Read without waiting (an honest request comes with the stream's
                # opening): no deadline to arm, a timer less per call.
                request = await msgs.recv()
            else:
                request = await self._read_request(msgs, request_due)
        except PayloadTooLarge as e:
            self._oversized(stream, "(request)", e)
            raise
        if not (isinstance(request, list) and len(request) == 3 and isinstance(request[0], str)):
            raise ProtocolViolation("malformed RPC request")
        method, timeout, payload = request
        if timeout is not None:
            if not isinstance(timeout, int | float) or timeout <= 0:
                raise ProtocolViolation(f"bad RPC timeout {timeout!r}")
            timeout = min(float(timeout), self.limits.max_timeout)
        ctx = CallContext(stream, method, timeout, self.limits)
        limit = self.limits.default_timeout if timeout is None else timeout
        try:
            with deadline(limit):
                if method in self._unary:
                    result = await self._unary[method](ctx, payload)
                    await ctx.send([OK, result])
                elif method in self._streams:
                    async for item in self._streams[method](ctx, payload):
                        await ctx.send([OK, item])
                else:
                    await ctx.send([ERR, ["UnknownMethod", f"{self.protocol} has no {method!r}"]])
        except TimeoutError:
            await _try_send(ctx, [ERR, ["DeadlineExceeded", f"{method} exceeded {limit:g}s"]])
        except PayloadTooLarge as e:
            # Refused before its bytes were read: the caller learns why, then the stream
            # is reset (what it still sends is dropped, not buffered).
            self._oversized(stream, method, e)
            await _try_send(ctx, [ERR, ["PayloadTooLarge", str(e)[:1000]]])
            raise
        except TransportError:
            raise
        except Exception as e:
            log.debug("%s.%s raised %r", self.protocol, method, e)
            await _try_send(ctx, [ERR, [type(e).__name__, str(e)[:1000]]])

    def _oversized(self, stream: Stream, method: str, e: PayloadTooLarge) -> None:
        self.oversized_refused += 1
        self.host.remote_events.info(
            f"{self.protocol} oversized",
            stream.connection.remote_key(),
            "%s.%s: refusing a call from %s: %s",
            self.protocol,
            method,
            stream.remote_peer.short(),
            e,
        )


class _PeerSlots:
    """A FIFO semaphore: the calls of one peer running in one service."""

    __slots__ = ("limit", "running", "waiting")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.running = 0
        self.waiting: deque[asyncio.Future[None]] = deque()

    @property
    def idle(self) -> bool:
        return self.running == 0 and not self.waiting

    def try_acquire(self) -> bool:
        """Take a slot if one is free and nobody waits (no suspension: the usual case)."""
        if self.running < self.limit and not self.waiting:
            self.running += 1
            return True
        return False

    async def acquire(self) -> None:
        if self.try_acquire():
            return
        fut = asyncio.get_running_loop().create_future()
        self.waiting.append(fut)
        try:
            await fut  # release() hands its slot over: running is already counted
        except BaseException:
            if fut.done() and not fut.cancelled():
                self.release()  # handed a slot while being cancelled: pass it on
            elif fut in self.waiting:  # (a release may have dropped it already)
                self.waiting.remove(fut)
            raise

    def release(self) -> None:
        while self.waiting:
            fut = self.waiting.popleft()
            if not fut.done():
                fut.set_result(None)
                return
        self.running -= 1


async def _try_send(ctx: CallContext, msg: Any) -> None:
    try:
        await ctx.send(msg)
    except TransportError:
        pass


def _raise_remote(body: Any) -> None:
    if isinstance(body, list) and len(body) == 2:
        kind, message = str(body[0]), str(body[1])
    else:
        kind, message = "RemoteError", repr(body)[:200]
    if kind == "UnknownMethod":
        raise UnknownMethod(kind, message)
    if kind == "Busy":
        raise PeerBusy(kind, message)
    raise RemoteError(kind, message)


class Call(MessageStream):
    """The client side of a streaming call (``async with open_call(...) as call``)."""

    __slots__ = ("deadline",)

    async def close_send(self) -> None:
        await self.stream.close()

    async def recv_item(self) -> Any:
        """The next response item; EOFError when the server finished."""
        msg = await self.recv()
        if not (isinstance(msg, list) and len(msg) == 2):
            raise ProtocolViolation("malformed RPC response")
        if msg[0] == OK:
            return msg[1]
        _raise_remote(msg[1])
        return None  # unreachable

    async def __aiter__(self) -> AsyncIterator[Any]:
        while True:
            try:
                yield await self.recv_item()
            except EOFError:
                return


def _translate(e: BaseException, method: str, peer: object) -> BaseException:
    if isinstance(e, TimeoutError) and not isinstance(e, RpcTimeout):
        return RpcTimeout(f"{method} on {peer} timed out")
    if isinstance(e, StreamReset) and not isinstance(e, UnknownMethod):
        return e
    if isinstance(e, StreamTruncated):
        return ConnectionLost(f"{method} on {peer}: {e}")
    return e


def _abandon(stream: Stream | None, e: BaseException, method: str, peer: object) -> BaseException:
    """Reset the call's stream (so the handler is cancelled) and give the error to raise."""
    if stream is not None:
        cancelled = isinstance(e, asyncio.CancelledError | GeneratorExit)
        stream.reset("cancelled" if cancelled else "error")
    return _translate(e, method, peer)


async def _open(
    host: Host,
    peer: PeerID | Multiaddr | str,
    protocol: str,
    method: str,
    payload: Any,
    timeout: float | None,
    limits: RpcLimits,
) -> Call:
    conn = host.connection(peer) if isinstance(peer, PeerID) else None
    if conn is None:
        conn = await host.connect(peer)
    stream = await conn.open_stream(protocol)
    call = Call(stream, limits)
    await stream.write(pack_message([method, timeout, payload]))
    return call


async def call(
    host: Host,
    peer: PeerID | Multiaddr | str,
    protocol: str,
    method: str,
    payload: Any = None,
    *,
    timeout: float | None = 30.0,
    limits: RpcLimits = _DEFAULT_LIMITS,
) -> Any:
    """A unary call: send `payload`, return the handler's result."""
    stream: Stream | None = None
    try:
        with deadline(timeout):
            c = await _open(host, peer, protocol, method, payload, timeout, limits)
            stream = c.stream
            await stream.close()
            result = await c.recv_item()
            return result
    except BaseException as e:
        err = _abandon(stream, e, method, peer)
        if err is e:
            raise
        raise err from None


async def stream_call(
    host: Host,
    peer: PeerID | Multiaddr | str,
    protocol: str,
    method: str,
    payload: Any = None,
    *,
    timeout: float | None = 30.0,
    limits: RpcLimits = _DEFAULT_LIMITS,
) -> AsyncIterator[Any]:
    """A server-streaming call: iterate over the response items."""
    c: Call | None = None
    try:
        async with asyncio.timeout(timeout):
            c = await _open(host, peer, protocol, method, payload, timeout, limits)
            await c.stream.close()
            async for item in c:
                yield item
    except BaseException as e:
        err = _abandon(c.stream if c is not None else None, e, method, peer)
        if err is e:
            raise
        raise err from None


class open_call:
    """A bidirectional streaming call; the stream is reset if the block raises."""

    def __init__(
        self,
        host: Host,
        peer: PeerID | Multiaddr | str,
        protocol: str,
        method: str,
        payload: Any = None,
        *,
        timeout: float | None = 30.0,
        limits: RpcLimits = _DEFAULT_LIMITS,
    ) -> None:
        self._args = (host, peer, protocol, method, payload, timeout, limits)
        self._timeout = asyncio.timeout(timeout)
        self._call: Call | None = None

    async def __aenter__(self) -> Call:
        await self._timeout.__aenter__()
        try:
            self._call = await _open(*self._args)
        except BaseException as e:
            await self._timeout.__aexit__(type(e), e, e.__traceback__)
            raise
        return self._call

    async def __aexit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        if exc is not None and self._call is not None:
            self._call.stream.reset("cancelled" if exc_type is asyncio.CancelledError else "error")
        elif self._call is not None:
            await self._call.stream.close()
        try:
            suppress = await self._timeout.__aexit__(exc_type, exc, tb)
        except TimeoutError as e:
            raise RpcTimeout(f"{self._args[3]} on {self._args[1]} timed out") from e
        return bool(suppress)
