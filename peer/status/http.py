"""The status server's HTTP hardening: timeouts, size limits, a connection cap, quiet logs.

aiohttp's defaults suit a server behind a reverse proxy, not one a remote end
can reach directly (`--status-addr 0.0.0.0:8080`, or a published docker port):

- keep-alive 3,630 s, and nothing bounds how long a request head may take: 600
  sockets trickling one header byte at a time (slowloris) held 600 handlers for
  an hour. Here `keepalive_timeout` (15 s) bounds both: aiohttp closes a
  connection whose handler still waits for a complete request when it runs out,
  whether the client is idle or trickling.
- no cap on connections: each costs a file descriptor the P2P host also needs.
  Here at most `max_connections`, and `max_connections_per_ip` from one address.
  Over the per-IP cap a newcomer is closed as it is accepted. At the total cap a
  newcomer from an address holding fewer connections than the most crowded one
  takes the oldest of that address's; one from (one of) the most crowded is
  closed. So sockets held from a few addresses cannot lock out anyone else.
- a request line over 8,190 bytes was logged at ERROR with a traceback, one per
  request. Here line, field and header-count limits are explicit, the client gets
  a 4xx, and the log gets one counted line per kind and minute
  (`transport.remote_log`).
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from dataclasses import dataclass

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from shoal.transport.remote_log import RemoteEvents

__all__ = ["BoundedTCPSite", "HttpLimits", "RemoteHttpErrors", "http_error_logger"]


@dataclass(frozen=True, slots=True)
class HttpLimits:
    # Idle keep-alive, and the longest a request head may take to arrive (see above).
    # The status page polls every 2 s, so its connection never idles this long.
    keepalive_timeout: float = 15.0
    max_line_size: int = 8190  # request line (the path and query): 414/400 beyond
    max_field_size: int = 8190  # one header line
    max_headers: int = 64
    max_connections: int = 256
    max_connections_per_ip: int = 64

    def handler_args(self) -> dict[str, object]:
        """The keyword arguments aiohttp's request handler takes for these limits."""
        return {
            "keepalive_timeout": self.keepalive_timeout,
            "max_line_size": self.max_line_size,
            "max_field_size": self.max_field_size,
            "max_headers": self.max_headers,
        }


class RemoteHttpErrors(logging.Filter):
    """Turns what aiohttp logs about a client's bad request into a counted one-liner.

    aiohttp logs a malformed or oversized request (an `HttpProcessingError`) with
    `logger.exception`: an ERROR with a traceback per request, as often as a remote
    client likes. This filter drops the record and reports it through `events`
    (rate-limited, no traceback); other errors keep their traceback, rate-limited too.
    """

    def __init__(self, events: RemoteEvents) -> None:
        super().__init__()
        self.events = events

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        exc = record.exc_info[1] if record.exc_info else None
        args = record.args if isinstance(record.args, tuple) else ()
        remote = str(args[0]) if len(args) == 1 else None
        if isinstance(exc, HttpProcessingError):
            reason = (exc.message or type(exc).__name__).splitlines()[0][:200]
            self.events.info(
                "bad HTTP request",
                remote,
                "status endpoint: bad request from %s (%d): %s",
                remote,
                exc.code,
                reason,
            )
        else:
            self.events.event(
                record.levelno,
                "HTTP error",
                remote,
                "status endpoint: %s",
                record.getMessage(),
                exc_info=record.exc_info or False,
            )
        return False


def http_error_logger(events: RemoteEvents) -> logging.Logger:
    """A logger for one server's aiohttp request handlers, filtered by `RemoteHttpErrors`.

    Its own Logger object (not registered by name, so each server's filter and
    counts stay its own), propagating to "shoal.peer.status.server.http" like any child.
    """
    logger = logging.Logger("shoal.peer.status.server.http")
    logger.parent = logging.getLogger("shoal.peer.status.server")
    logger.addFilter(RemoteHttpErrors(events))
    return logger


class BoundedTCPSite(web.TCPSite):
    """A TCPSite that serves at most `limits.max_connections` (and per IP) at a time."""

    def __init__(
        self,
        runner: web.BaseRunner,
        host: str | None,
        port: int | None,
        *,
        limits: HttpLimits,
        events: RemoteEvents,
    ) -> None:
        # reuse_port off: a second peer on the same port must fail, not share it.
        super().__init__(runner, host, port, reuse_port=False)
        self._limits = limits
        self._events = events
        # Open connections by client address, oldest first.
        self._by_ip: dict[str, OrderedDict[_Counted, None]] = {}
        self._count = 0
        self.evicted = 0

    @property
    def open_connections(self) -> int:
        return self._count

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site with the runner
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            self._protocol,
            self._host,
            self._port,
            backlog=self._backlog,
            reuse_address=self._reuse_address,
            reuse_port=self._reuse_port,
        )
        sockets = self._server.sockets
        self._bound_port = sockets[0].getsockname()[1] if sockets else self._port

    def _protocol(self) -> asyncio.BaseProtocol:
        # The peer's address is known only in connection_made: count there.
        return _Counted(self)

    def _admit(self, conn: _Counted, ip: str) -> bool:
        lim = self._limits
        mine = self._by_ip.get(ip)
        why = None
        if mine is not None and len(mine) >= lim.max_connections_per_ip:
            why = f"per-IP connection limit ({lim.max_connections_per_ip}) reached"
        elif self.open_connections >= lim.max_connections:
            crowded = max(self._by_ip.values(), key=len)
            if (len(mine) if mine else 0) + 1 > len(crowded):
                why = f"connection limit ({lim.max_connections}) reached"
            else:
                self.evicted += 1
                next(iter(crowded)).evict()
        if why is not None:
            self._events.info(
                "status connection refused", ip, "status endpoint: refusing %s: %s", ip, why
            )
            return False
        self._by_ip.setdefault(ip, OrderedDict())[conn] = None
        self._count += 1
        return True

    def _release(self, conn: _Counted, ip: str) -> None:
        mine = self._by_ip.get(ip)
        if mine is None or conn not in mine:
            return
        del mine[conn]
        self._count -= 1
        if not mine:
            del self._by_ip[ip]


class _Counted(asyncio.Protocol):
    """Admits a connection against the site's caps, then hands it to aiohttp's handler."""

    def __init__(self, site: BoundedTCPSite) -> None:
        self._site = site
        self._inner: asyncio.Protocol | None = None
        self._ip: str | None = None
        self._transport: asyncio.BaseTransport | None = None

    def evict(self) -> None:
        """Close at once, to make room for a newer connection."""
        if self._ip is not None:
            self._site._release(self, self._ip)
        if self._transport is not None:
            self._transport.abort()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peer = transport.get_extra_info("peername")
        ip = str(peer[0]) if peer else "?"
        if not self._site._admit(self, ip):
            transport.abort()
            return
        self._ip = ip
        self._transport = transport
        server = self._site._runner.server
        assert server is not None
        self._inner = server()
        self._inner.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._ip is not None:
            self._site._release(self, self._ip)
            self._ip = None
        if self._inner is not None:
            self._inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._inner is not None:
            self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._inner is not None else None

    def pause_writing(self) -> None:
        if self._inner is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._inner is not None:
            self._inner.resume_writing()
