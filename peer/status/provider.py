"""`StatusProvider`: what the daemon gives the status endpoint (`status`) and
the metrics (`metrics`); on its own so that neither imports the other for it."""

from __future__ import annotations

from typing import Any, Protocol


class StatusProvider(Protocol):
    """What the daemon gives the status endpoint (schemas in the module docstring).

    `status()`, `history()` and `swarm()` run on the event loop: they must only
    read in-memory state (microseconds). The server encodes history and swarm in a
    thread from copies of the lists, so a sample, once appended, must not be changed. `peers()`
    may ask the DHT, but should serve from a cache the daemon refreshes; the
    server cancels it after `peers_timeout`.
    """

    def status(self) -> dict[str, Any]: ...

    async def peers(self) -> list[dict[str, Any]]: ...

    def history(self) -> list[dict[str, Any]]: ...

    def swarm(self) -> dict[str, Any]: ...
