"""A stream as a transport: a secure, multiplexed Connection running over a relay stream.

The relay splices two streams together and only ever sees the Noise records of
the end-to-end connection. `StreamTransport` looks like an asyncio transport to
`Connection` (write/writelines/close/abort, pause_writing when too much is
queued, get_buffer/buffer_updated for what arrives) and pumps bytes from and to
a `Stream` of the connection to the relay. Its two pump tasks are owned by the
transport and end with it.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import Any

from ..connection import Connection, Stream
from ..errors import ConnectionLost, RelayLimitExceeded, StreamReset, TransportError
from ..identity import PeerID
from ..tasks import TaskSet

log = logging.getLogger("shoal.transport.nat")

# What a relay puts in the RESET of a circuit it cuts for exceeding a limit.
LIMIT_RESET_PREFIX = "relay limit exceeded"
_HIGH_WATER = 1024 * 1024
_LOW_WATER = 256 * 1024
_CLOSE_TIMEOUT = 10.0  # after our end of stream, how long the remote may take to end its own


class StreamTransport(asyncio.Transport):
    """Drives `protocol` (a Connection) over `stream`; call `start()` once."""

    def __init__(self, stream: Stream, protocol: Connection, relay: PeerID) -> None:
        super().__init__()
        self._stream = stream
        self._protocol = protocol
        self._relay = relay
        self._loop = asyncio.get_running_loop()
        self._queue: deque[bytes | bytearray | memoryview] = deque()
        self._queued = 0
        self._high = _HIGH_WATER
        self._low = _LOW_WATER
        self._writing_paused = False
        self._reading_paused = False
        self._resume_reading = asyncio.Event()
        self._wake_writer = asyncio.Event()
        self._closing = False
        self._remote_closed = asyncio.Event()  # the reader met the remote's end of stream
        self._lost = False
        self._tasks = TaskSet(log, "relayed connection")

    def start(self) -> None:
        self._protocol.connection_made(self)
        if self._lost or self._closing:  # the connection refused itself (limits)
            return
        self._tasks.spawn(self._read_loop())
        self._tasks.spawn(self._write_loop())

    # --- asyncio.Transport API used by Connection ---------------------------------------------

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        if name == "relay":
            return self._relay
        if name == "stream":
            return self._stream
        return default  # no socket, peername or sockname: the peer is behind the relay

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        # The relay stream has its own flow control; keep enough queued to fill it.
        self._high = max(high or _HIGH_WATER, _HIGH_WATER)
        self._low = min(low if low is not None else _LOW_WATER, self._high // 4)

    def get_write_buffer_size(self) -> int:
        return self._queued

    def is_closing(self) -> bool:
        return self._closing or self._lost

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._closing or self._lost or not data:
            return
        self._queue.append(data)
        self._queued += len(data)
        self._wake_writer.set()
        if not self._writing_paused and self._queued > self._high:
            self._writing_paused = True
            self._protocol.pause_writing()

    def writelines(self, list_of_data: Any) -> None:
        for data in list_of_data:
            self.write(data)

    def pause_reading(self) -> None:
        self._reading_paused = True
        self._resume_reading.clear()

    def resume_reading(self) -> None:
        self._reading_paused = False
        self._resume_reading.set()

    def is_reading(self) -> bool:
        return not self._reading_paused

    def can_write_eof(self) -> bool:
        return False

    def close(self) -> None:
        """Send what is queued, then end the stream; the protocol hears connection_lost."""
        if self._closing or self._lost:
            return
        self._closing = True
        self._wake_writer.set()
        if not self._tasks:
            self._lose(None, reset=False)

    def abort(self) -> None:
        if self._lost:
            return
        self._closing = True
        self._stream.reset("relayed connection aborted")
        self._lose(None)

    # --- pumps -------------------------------------------------------------------------------

    async def _read_loop(self) -> None:
        stream, protocol = self._stream, self._protocol
        try:
            while True:
                if self._reading_paused:
                    await self._resume_reading.wait()
                await stream.wait_readable()
                if stream.at_eof():
                    break
                # The buffer is asked for only now that data is here: the connection may
                # replace its receive buffer while we wait.
                n = stream.readinto_nowait(protocol.get_buffer(-1))
                protocol.buffer_updated(n)
                if self._lost:
                    return
            protocol.eof_received()
            self._remote_closed.set()
            self.close()  # the remote ended its side: the writer ends ours, then we are done
        except TransportError as e:
            self._lose(self._translate(e))

    async def _write_loop(self) -> None:
        stream = self._stream
        try:
            while True:
                if not self._queue:
                    if self._closing:
                        break
                    self._wake_writer.clear()
                    await self._wake_writer.wait()
                    continue
                chunks = list(self._queue)
                self._queue.clear()
                size = self._queued
                # One write per batch: small records are joined (a copy, as the stream
                # would copy them anyway); large batches go out without copying.
                data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
                await stream.write(data)
                self._queued -= size
                if self._writing_paused and self._queued <= self._low:
                    self._writing_paused = False
                    self._protocol.resume_writing()
            await stream.drain()
            # Half-close, then wait for the remote's end: the relay then sees both ends
            # finish cleanly (Connection.aclose aborts us if the remote never answers).
            await stream.close()
            try:
                async with asyncio.timeout(_CLOSE_TIMEOUT):
                    await self._remote_closed.wait()
            except TimeoutError:
                self._lose(None)  # the remote never finished its side: reset
                return
            self._lose(None, reset=False)
        except TransportError as e:
            self._lose(self._translate(e))

    def _translate(self, e: TransportError) -> ConnectionLost:
        relay = self._relay.short()
        peer = self._protocol.remote_peer
        who = peer.short() if peer is not None else "peer"
        if isinstance(e, StreamReset) and LIMIT_RESET_PREFIX in e.reason:
            return RelayLimitExceeded(
                f"relay {relay} cut the relayed connection to {who}: {e.reason.split(': ', 1)[-1]}"
            )
        return ConnectionLost(f"relayed connection to {who} via {relay} lost: {e}")

    def _lose(self, exc: Exception | None, *, reset: bool = True) -> None:
        if self._lost:
            return
        log.debug("relayed connection via %s ends: %r", self._relay.short(), exc)
        self._lost = True
        self._closing = True
        current = asyncio.current_task()
        for task in list(self._tasks):
            if task is not current:
                task.cancel()
        if reset:
            # Not a graceful end (after which our FIN is on its way): the relay's splice
            # must end too.
            self._stream.reset("relayed connection closed")
        self._loop.call_soon(self._protocol.connection_lost, exc)
