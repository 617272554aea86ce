"""What the fuzz targets share: the Target record, a stream that never blocks, and
ways to run a decoder's coroutine without (or with one reused) event loop."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import msgpack

from shoal.transport.errors import StreamTruncated
from shoal.transport.identity import Identity

__all__ = ["BytesStream", "Target", "expect", "message", "run_in_loop", "run_now", "split"]

# The peer on the other end of every fuzzed stream.
REMOTE_IDENTITY = Identity.from_seed(b"\x02" * 32)


@dataclass(frozen=True)
class Target:
    name: str
    run: Callable[[bytes], None]
    allowed: tuple[type[BaseException], ...]  # the decoder's documented errors
    doc: str


class _FakeConnection:
    """What a served stream's handler reads of its connection: a direct one from a
    loopback address (the fuzzed bytes are the stream's, not the connection's)."""

    remote_address = ("127.0.0.1", 1)
    kind = "direct"
    relay = None
    remote_peer = REMOTE_IDENTITY.peer_id

    def remote_key(self) -> str:
        return self.remote_address[0]


class BytesStream:
    """A stream holding `data` and then its end: reads never wait. It has the
    end-of-stream behaviour of `shoal.transport.connection.Stream` (a short read
    raises StreamTruncated, a ProtocolViolation)."""

    protocol = "/fuzz/1.0.0"
    remote_peer = REMOTE_IDENTITY.peer_id
    connection = _FakeConnection()

    def __init__(self, data: bytes) -> None:
        self._data = memoryview(data)
        self._pos = 0
        self.written: list[bytes] = []

    def at_eof(self) -> bool:
        return self._pos >= len(self._data)

    @property
    def buffered(self) -> int:
        """Bytes not read yet (all of them arrived at once)."""
        return len(self._data) - self._pos

    def peek(self, n: int) -> bytes:
        """The next `n` bytes (fewer at the end), left unread."""
        return bytes(self._data[self._pos : self._pos + n])

    async def read(self, max_bytes: int = 65536) -> bytes:
        out = bytes(self._data[self._pos : self._pos + max_bytes])
        self._pos += len(out)
        return out

    async def readexactly(self, n: int) -> bytes:
        if self._pos + n > len(self._data):
            have = len(self._data) - self._pos
            self._pos = len(self._data)
            raise StreamTruncated(f"stream ended after {have} of {n} bytes")
        out = bytes(self._data[self._pos : self._pos + n])
        self._pos += n
        return out

    async def readexactly_into(self, buffer: memoryview | bytearray) -> None:
        out = memoryview(buffer).cast("B")
        out[:] = await self.readexactly(len(out))

    async def write(self, data: bytes | memoryview) -> None:
        self.written.append(bytes(data))

    def reserve(self, nbytes: int) -> None:
        pass


def run_now(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run a coroutine that never waits (it reads a BytesStream) to its end."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    coro.close()
    raise AssertionError("the decoder waited on something other than its input")


_LOOP: list[asyncio.AbstractEventLoop] = []


def run_in_loop(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run a coroutine that needs a running loop (timeouts, sockets) on one loop
    kept for the whole fuzzing process (a loop per input would cost more than the input)."""
    if not _LOOP:
        _LOOP.append(asyncio.new_event_loop())
    return _LOOP[0].run_until_complete(coro)


def message(data: bytes) -> Any:
    """`data` decoded as the RPC layer decodes a message body (None if undecodable)."""
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False, use_list=True)
    except Exception:
        return None


def split(data: bytes, parts: int) -> list[bytes]:
    """`data` cut into `parts` pieces at offsets taken from its first bytes."""
    head, rest = data[: parts - 1], data[parts - 1 :]
    out, pos = [], 0
    for b in head:
        cut = min(len(rest), pos + b)
        out.append(rest[pos:cut])
        pos = cut
    out.append(rest[pos:])
    return out + [b""] * (parts - len(out))


def expect(allowed: tuple[type[BaseException], ...], fn: Callable[[], Any]) -> Any:
    """`fn()`, or None when it raised one of `allowed` (one decoder's documented errors,
    for targets that feed the same input to several decoders)."""
    try:
        return fn()
    except allowed:
        return None
