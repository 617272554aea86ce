"""The errors of the DHT node's public API, and the bound on a busy answer's wait."""

from __future__ import annotations

from shoal.transport.identity import PeerID


class DHTError(Exception):
    """Base class of DHT errors."""


class BootstrapError(DHTError):
    """None of the bootstrap peers could be reached."""


class PeerBusy(DHTError):
    """The peer refused a request by its rate limits ("busy"): it is up and honest
    as far as we know, so it is neither garbage nor a failure in the table."""

    def __init__(self, peer: PeerID, retry_after: float) -> None:
        super().__init__(f"{peer.short()} is busy; retry after {retry_after:.1f}s")
        self.retry_after = retry_after


# A busy answer's retry_after is bounded, so a peer cannot make itself skipped for long
# (nor ask to be asked again at once).
BUSY_BLOCK = (0.1, 10.0)


def busy_from(peer: PeerID, reply: object) -> PeerBusy | None:
    """The PeerBusy a reply means (a typed busy answer), else None."""
    if not (isinstance(reply, dict) and reply.get("busy") is True):
        return None
    retry = reply.get("retry_after")
    retry = float(retry) if isinstance(retry, int | float) else 1.0
    return PeerBusy(peer, min(max(retry, BUSY_BLOCK[0]), BUSY_BLOCK[1]))
