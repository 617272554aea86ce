"""The host's stream handlers: each stream a remote opens goes to the handler of its
protocol, which runs owned by the connection; failures reset only the stream."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from .connection import Stream
from .errors import TransportError
from .remote_log import RemoteEvents

log = logging.getLogger("shoal.transport")

StreamHandler = Callable[[Stream], Awaitable[None]]


class StreamRouter:
    """Protocol -> handler; `remote_events` gets the failures a remote may cause."""

    def __init__(self, remote_events: Callable[[], RemoteEvents]) -> None:
        self.handlers: dict[str, StreamHandler] = {}
        self._remote_events = remote_events

    def route(self, stream: Stream, *, closing: bool) -> None:
        handler = self.handlers.get(stream.protocol)
        conn = stream.connection
        if handler is None or closing:
            reason = "host is shutting down" if handler else f"unknown protocol {stream.protocol}"
            conn.refuse_stream(stream, reason, unknown_protocol=handler is None)
            return
        conn.spawn(self._run_handler(handler, stream), stream)

    async def _run_handler(self, handler: StreamHandler, stream: Stream) -> None:
        try:
            await handler(stream)
        except asyncio.CancelledError:
            stream.reset("handler cancelled")
            raise
        except TransportError as e:
            log.debug("handler %s for %s: %s", stream.protocol, stream.remote_peer.short(), e)
            stream.reset(type(e).__name__)
        except Exception:
            # A bug here, but a remote peer may trigger it at will: the first few with
            # their traceback, then a count.
            self._remote_events().error(
                f"handler {stream.protocol} failed",
                stream.connection.remote_key(),
                "handler %s failed for %s",
                stream.protocol,
                stream.remote_peer,
                exc_info=True,
            )
            stream.reset("handler error")
        else:
            await stream.close(discard_input=True)
