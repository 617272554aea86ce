"""The NAT manager's relay directory, kept in the DHT.

One DHT dictionary lists the public relays: each relay writes its addresses
under a subkey only it may write (owner-signed), so nobody can list or unlist
a relay in another's name; entries expire with their TTL.
"""

from __future__ import annotations

import time

from shoal.transport.identity import PeerID
from shoal.transport.multiaddr import Multiaddr, MultiaddrError

from .node import DHTNode
from .records import RecordError, owner_marker, owner_of

__all__ = ["RELAYS_KEY", "DHTRelayDirectory"]

RELAYS_KEY = "_shoal.relays"
MAX_LISTED = 64  # relays read from one lookup (the dictionary is untrusted input)
MAX_ADDRS = 8  # addresses read per relay


class DHTRelayDirectory:
    """`transport.nat.directory.RelayDirectory` over a DHT node."""

    def __init__(self, node: DHTNode, key: str = RELAYS_KEY) -> None:
        self.node = node
        self.key = key

    async def advertise(self, peer: PeerID, addrs: list[Multiaddr], ttl: float) -> None:
        # Also kept locally and republished by the node: no replica now is no error.
        await self.node.store(
            self.key, [str(a) for a in addrs], time.time() + ttl, subkey=owner_marker(peer)
        )

    async def find(self) -> dict[PeerID, list[Multiaddr]]:
        found = await self.node.get(self.key)
        entries = found.value if found is not None else None
        if not isinstance(entries, dict):
            return {}
        relays: dict[PeerID, list[Multiaddr]] = {}
        for subkey, value in list(entries.items())[:MAX_LISTED]:
            peer = _owner(subkey)
            if peer is None or not isinstance(value, list):
                continue
            addrs = [a for a in map(_addr, value[:MAX_ADDRS]) if a is not None]
            if addrs:
                relays[peer] = addrs
        return relays


def _owner(subkey: object) -> PeerID | None:
    if not isinstance(subkey, str):
        return None
    try:
        return owner_of(subkey)
    except RecordError:
        return None


def _addr(raw: object) -> Multiaddr | None:
    if not isinstance(raw, str):
        return None
    try:
        return Multiaddr(raw)
    except MultiaddrError:
        return None
