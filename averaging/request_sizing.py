"""How many bytes a state download asks a holder for in one request.

Each request is one RPC bounded as a whole by the download's `request_timeout`: the
caller's wait and the server handler's deadline alike. A fixed request size therefore
fails on every link slower than size / timeout: 64 MB in 30 s needs 17 Mbit/s, so over
a 10 Mbit/s home link no state above about 37 MB could ever be downloaded, whatever
the re-sync's own deadline allowed (bench/wan.py's 25M-parameter run: every peer that
fell behind stayed behind).

So requests follow the rate the link shows. The first is small; each next one is what
the last request's measured rate moves in a quarter of the timeout, so the rate may
fall fourfold mid-request before a request runs out of time. A request grows at most
fourfold at a time, since a small one's duration is mostly round trips and says little
of the rate, and never beyond the caller's cap (`max_bytes`). On a fast link requests
reach the cap within a few round trips; at 10 Mbit/s and a 30 s timeout they settle
near 9 MB, one round trip lost every 7 s or so.
"""

from __future__ import annotations

from dataclasses import dataclass, field

FIRST_REQUEST_BYTES = 1 << 20  # (1 MiB in 30 s: any link above 0.3 Mbit/s)
MIN_REQUEST_BYTES = 64 << 10
TIMEOUT_SHARE = 0.25  # of the request timeout a request is sized to fill
MAX_GROWTH = 4


@dataclass(slots=True)
class RequestSizer:
    """The size of the next request of a download from one holder (sans I/O: the
    caller reports each completed request's bytes and seconds)."""

    request_timeout: float
    max_bytes: int
    next_bytes: int = field(init=False)

    def __post_init__(self) -> None:
        if self.request_timeout <= 0 or self.max_bytes < 1:
            raise ValueError("request_timeout > 0 and max_bytes >= 1")
        self.next_bytes = min(self.max_bytes, FIRST_REQUEST_BYTES)

    def observe(self, nbytes: int, seconds: float) -> None:
        """A request of `nbytes` took `seconds`, from its opening to its last byte."""
        if nbytes <= 0:
            return
        rate = nbytes / max(seconds, 1e-6)
        fits = int(rate * self.request_timeout * TIMEOUT_SHARE)
        wanted = max(MIN_REQUEST_BYTES, min(MAX_GROWTH * nbytes, fits))
        self.next_bytes = min(self.max_bytes, wanted)


__all__ = ["FIRST_REQUEST_BYTES", "MAX_GROWTH", "MIN_REQUEST_BYTES", "RequestSizer"]
