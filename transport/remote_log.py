"""Log lines that remote peers cause, rate-limited and summarized.

A remote peer decides how often we log "refusing connection", "handshake not
finished" or "answered garbage": 2,000 silent connections used to write 2,000
lines. Here each kind of event logs its first `first_per_window` lines per
window (60 s) as before; the rest of the window is counted, per address, and
written as one summary line when the window ends:

    suppressed 1,987 'handshake not finished' from 1,024 addresses in the last 60 s;
    most from 203.0.113.7 (300)

`RemoteEventCounter` is the sans-I/O core (the caller passes the time);
`RemoteEvents` drives it for one logger, with a loop timer that writes the
summary even when the flood stops (and a check at every event when no loop runs).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["RemoteEventCounter", "RemoteEvents", "Summary"]

DEFAULT_WINDOW = 60.0
DEFAULT_FIRST_PER_WINDOW = 5
DEFAULT_MAX_ADDRESSES = 4096  # per kind and window: the memory a flood of distinct sources costs


@dataclass(slots=True)
class Summary:
    """What was suppressed of one kind over one window."""

    kind: str
    level: int
    suppressed: int
    addresses: int  # distinct addresses among the suppressed (a lower bound past the cap)
    addresses_capped: bool
    top_address: str | None
    top_count: int
    window: float

    def line(self) -> str:
        more = "at least " if self.addresses_capped else ""
        plural = "" if self.addresses == 1 else "es"
        text = (
            f"suppressed {self.suppressed:,} {self.kind!r} from {more}{self.addresses:,} "
            f"address{plural} in the last {self.window:g} s"
        )
        if self.top_address is not None and self.addresses > 1:
            text += f"; most from {self.top_address} ({self.top_count:,})"
        return text


@dataclass(slots=True)
class _Window:
    started: float
    level: int
    logged: int = 0
    suppressed: int = 0
    by_address: dict[str, int] = field(default_factory=dict)
    capped: bool = False


class RemoteEventCounter:
    """Decides which events of each kind are logged, and summarizes the others (sans I/O)."""

    def __init__(
        self,
        *,
        window: float = DEFAULT_WINDOW,
        first_per_window: int = DEFAULT_FIRST_PER_WINDOW,
        max_addresses: int = DEFAULT_MAX_ADDRESSES,
    ) -> None:
        if window <= 0 or first_per_window < 0 or max_addresses < 1:
            raise ValueError("window > 0, first_per_window >= 0 and max_addresses >= 1")
        self.window = window
        self.first_per_window = first_per_window
        self.max_addresses = max_addresses
        self._windows: dict[str, _Window] = {}
        self.total: dict[str, int] = {}  # every event ever noted, per kind (for tests and /status)

    def note(self, kind: str, address: str | None, now: float, level: int = logging.INFO) -> bool:
        """Count one event; True if it should be logged in full."""
        self.total[kind] = self.total.get(kind, 0) + 1
        w = self._windows.get(kind)
        if w is None or now - w.started >= self.window:
            # (RemoteEvents calls `due` first, so an ended window is summarized, not lost)
            w = self._windows[kind] = _Window(started=now, level=level)
        w.level = max(w.level, level)
        if w.logged < self.first_per_window:
            w.logged += 1
            return True
        w.suppressed += 1
        key = address if address is not None else "unknown"
        if key in w.by_address:
            w.by_address[key] += 1
        elif len(w.by_address) < self.max_addresses:
            w.by_address[key] = 1
        else:
            w.capped = True
        return False

    def due(self, now: float) -> list[Summary]:
        """Summaries of the windows that have ended; those windows are forgotten."""
        out: list[Summary] = []
        for kind, w in list(self._windows.items()):
            if now - w.started < self.window:
                continue
            del self._windows[kind]
            if w.suppressed:
                out.append(self._summary(kind, w))
        return out

    def next_due(self) -> float | None:
        """When the earliest window with suppressed events ends (None: nothing to summarize)."""
        ends = [w.started + self.window for w in self._windows.values() if w.suppressed]
        return min(ends, default=None)

    def flush(self) -> list[Summary]:
        """Summaries of every window, ended or not (at shutdown)."""
        out = [self._summary(k, w) for k, w in self._windows.items() if w.suppressed]
        self._windows.clear()
        return out

    def _summary(self, kind: str, w: _Window) -> Summary:
        top = max(w.by_address.items(), key=lambda kv: kv[1], default=(None, 0))
        return Summary(
            kind=kind,
            level=w.level,
            suppressed=w.suppressed,
            addresses=len(w.by_address),
            addresses_capped=w.capped,
            top_address=top[0],
            top_count=top[1],
            window=self.window,
        )


class RemoteEvents:
    """Log remote-caused events through `logger`, rate-limited per kind.

        remote = RemoteEvents(log)
        remote.info("handshake not finished", ip, "closing connection from %s: ...", name)

    `kind` names the event in summaries; `address` is who caused it (an IP, or a
    peer ID where the IP is unknown).
    """

    def __init__(
        self,
        logger: logging.Logger,
        *,
        window: float = DEFAULT_WINDOW,
        first_per_window: int = DEFAULT_FIRST_PER_WINDOW,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.counter = RemoteEventCounter(window=window, first_per_window=first_per_window)
        self._clock = clock
        self._timer: asyncio.TimerHandle | None = None
        self._timer_loop: asyncio.AbstractEventLoop | None = None

    def info(self, kind: str, address: str | None, msg: str, *args: object) -> None:
        self.event(logging.INFO, kind, address, msg, *args)

    def warning(self, kind: str, address: str | None, msg: str, *args: object) -> None:
        self.event(logging.WARNING, kind, address, msg, *args)

    def error(
        self, kind: str, address: str | None, msg: str, *args: object, exc_info: object = False
    ) -> None:
        self.event(logging.ERROR, kind, address, msg, *args, exc_info=exc_info)

    def event(
        self,
        level: int,
        kind: str,
        address: str | None,
        msg: str,
        *args: object,
        exc_info: object = False,
    ) -> None:
        """Log `msg % args` at `level`, unless this kind has had its share this window."""
        now = self._clock()
        self._write(self.counter.due(now))
        if not self.logger.isEnabledFor(level):
            self.counter.total[kind] = self.counter.total.get(kind, 0) + 1
            return
        if self.counter.note(kind, address, now, level):
            self.logger.log(level, msg, *args, exc_info=exc_info)
        else:
            self._arm()

    def flush(self) -> None:
        """Write every pending summary now."""
        self._write(self.counter.flush())

    def _write(self, summaries: list[Summary]) -> None:
        for s in summaries:
            self.logger.log(s.level, "%s", s.line())

    def _arm(self) -> None:
        """A timer that writes the summary when the window ends, flood or no flood."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop: the next event (or flush) writes it
        if self._timer is not None and self._timer_loop is loop and not self._timer.cancelled():
            return
        at = self.counter.next_due()
        if at is None:
            return
        self._timer_loop = loop
        self._timer = loop.call_later(max(0.0, at - self._clock()), self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._write(self.counter.due(self._clock()))
        if self.counter.next_due() is not None:
            self._arm()
