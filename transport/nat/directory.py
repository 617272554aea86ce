"""Where public relays are listed: an interface the NAT manager uses, implemented above it.

A public peer that serves as a relay advertises its addresses; a private peer
that needs relays looks them up. The transport only states what it needs: the
DHT implements it (`shoal.dht.relay_directory.DHTRelayDirectory`), tests may
implement it with a dict. Entries come from untrusted peers: the manager
checks every address it is given before it dials one.
"""

from __future__ import annotations

from typing import Protocol

from ..identity import PeerID
from ..multiaddr import Multiaddr

__all__ = ["RelayDirectory"]


class RelayDirectory(Protocol):
    async def advertise(self, peer: PeerID, addrs: list[Multiaddr], ttl: float) -> None:
        """List `peer` (this host) as a relay at `addrs` for `ttl` seconds; raises on
        failure (the manager retries)."""
        ...

    async def find(self) -> dict[PeerID, list[Multiaddr]]:
        """The relays listed now, each with the addresses it advertised (unchecked)."""
        ...
